"""Host memory is the node's, not the process's share of its total (issue 48 §3), and one host
figure feeds the planner (issue 49 item 8).

A run held 140 GB of a 252 GiB node while its plan needed 45 GiB (its budget was 75% of the
node's total, LOCAL_WORLD_SIZE being 1), and the kernel's OOM killer ended it when a second job
started. These tests hold offload to its promises on the ``cpu`` transport, with the node
simulated (``offload.host.node.SimulatedNode``: only the source of the numbers is replaced):
growth past the node's available memory less its floor is refused and said once; what the
process holds counts as its own; the planner plans for the least of the context's cap, the
process's budget and the node's room; what the arena holds stays within its plans' need plus a
slack; and two processes whose plans each ask for 60% of a node both finish within it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import offload
from offload.host import room
from offload.host.blocks import BLOCK_GRANULE
from offload.host.arena import HostArena
from offload.host.ledger import HostLedger, set_process_host_budget
from offload.host.node import SimulatedNode, cgroup_limit, node_floor, node_source_from_env

from _util import assert_bitwise, make_gpt_layers, oa_step, plain_reference, train_step

MIB = 1 << 20
TESTS = Path(__file__).resolve().parent


def _arena(ledger: HostLedger, budget: int = 1 << 40) -> HostArena:
    # A pinned arena whose "pinned" blocks are plain host tensors (CPU CI), charging ``ledger``.
    return HostArena(pinned=True, budget_bytes=budget, retain=False, ledger=ledger,
                     allocate=lambda n: (torch.empty(n, dtype=torch.uint8), n))


def _other_process(directory: Path, nbytes: int) -> None:
    # Another process on the simulated node holding ``nbytes`` (what it publishes there).
    (directory / "1").write_text(str(nbytes))



# -- the node ----------------------------------------------------------------------------------
def test_growth_past_the_nodes_floor_is_refused_and_said_once_with_the_figures(tmp_path: Path) -> None:
    total = 64 * MIB
    floor = node_floor(total)
    _other_process(tmp_path, 30 * MIB)
    ledger = HostLedger(node=SimulatedNode(total, str(tmp_path)))
    arena = _arena(ledger)
    regions = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(32):
            region = arena.acquire(MIB, step=1)
            if region is None:
                break
            regions.append(region)
        assert arena.acquire(MIB, step=1) is None
    held = arena.counters.bytes_held
    assert held <= total - 30 * MIB - floor, f"held {held} bytes, past the node's available memory less its floor"
    assert held > total - 30 * MIB - floor - 2 * MIB, "the node's room was not used"
    said = [str(w.message) for w in seen if "floor" in str(w.message)]
    assert len(said) == 1, f"the refusal was not said exactly once: {said}"
    assert f"floor of {floor} bytes" in said[0] and "available" in said[0] and "fewer jobs per node" in said[0]
    assert ledger.node_refusals >= 2 and arena.counters.failures >= 2


def test_the_bytes_the_process_holds_count_as_its_own(tmp_path: Path) -> None:
    """The node's available memory is read with this process's blocks already taken: they are not
    counted twice, and blocks it holds are reused when the node has no room left."""
    total = 64 * MIB
    ledger = HostLedger(node=SimulatedNode(total, str(tmp_path)))
    arena = _arena(ledger)
    region = arena.acquire(20 * MIB, step=1)
    assert region is not None
    room_then = arena.host_room().held_bytes
    assert room_then == total - node_floor(total), "the arena's own 20 MiB were counted against it"
    arena.release(region, None)
    _other_process(tmp_path, total - node_floor(total) - 20 * MIB)  # the node is full now
    assert arena.acquire(20 * MIB, step=2) is not None, "a block the process holds was not reused"
    assert arena.host_room().held_bytes == 20 * MIB


def test_blocks_being_pinned_are_not_counted_as_gone_from_the_node(tmp_path: Path) -> None:
    ledger = HostLedger(node=SimulatedNode(64 * MIB, str(tmp_path)))
    account = ledger.open_account()
    assert account.try_charge(10 * MIB)
    account.mark_pending(10 * MIB)  # queued on the pinner: the node has not seen it yet
    assert int((tmp_path / str(os.getpid())).read_text()) == 0
    room_pending = ledger.node_room()
    account.mark_pending(-10 * MIB)  # pinned now: gone from available, held by the process
    ledger.read_node()
    assert ledger.node_room() == room_pending == 64 * MIB - node_floor(64 * MIB) - 10 * MIB


def test_cgroup_limits_are_read_v2_and_v1(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("1073741824\n")
    (v2 / "memory.current").write_text(str(800 << 20))
    (v2 / "memory.stat").write_text("anon 1\ninactive_file 104857600\n")
    assert cgroup_limit(v2) == (1 << 30, (1 << 30) - (800 << 20) + (100 << 20), f"cgroup v2 {v2 / 'memory.max'}")
    (v2 / "memory.max").write_text("max\n")
    assert cgroup_limit(v2) is None
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(2 << 30))
    (v1 / "memory" / "memory.usage_in_bytes").write_text(str(1 << 30))
    assert cgroup_limit(v1)[:2] == (2 << 30, 1 << 30)  # type: ignore[index]
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712")  # v1's "no limit"
    assert cgroup_limit(v1) is None


def test_a_limit_on_an_ancestor_cgroup_binds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Slurm job or a systemd slice sets the limit above the process's own cgroup."""
    step = tmp_path / "job" / "step"
    step.mkdir(parents=True)
    (tmp_path / "cgroup.controllers").write_text("memory")
    for d, limit, used in ((tmp_path / "job", str(4 << 30), 3 << 30), (step, "max", 1 << 30)):
        (d / "memory.max").write_text(limit)
        (d / "memory.current").write_text(str(used))
    monkeypatch.setattr("offload.host.node._own_cgroup", lambda controller: "job/step")
    assert cgroup_limit(tmp_path) == (4 << 30, 1 << 30, f"cgroup v2 {tmp_path / 'job' / 'memory.max'}")


def test_a_simulated_node_is_named_in_the_environment(tmp_path: Path) -> None:
    source = node_source_from_env({"OFFLOAD_SIMULATED_NODE": f"{64 * MIB}:{tmp_path}"})
    assert isinstance(source, SimulatedNode) and source.read().total_bytes == 64 * MIB
    with pytest.raises(ValueError, match="OFFLOAD_SIMULATED_NODE"):
        node_source_from_env({"OFFLOAD_SIMULATED_NODE": "lots"})


# -- the plans' bound --------------------------------------------------------------------------
def _use(arena: HostArena, sizes: list[int], step: int) -> None:
    # A step of a plan: its groups take these regions, then give them back.
    regions = [arena.acquire(size, step=step) for size in sizes]
    assert all(region is not None for region in regions)
    for region in regions:
        arena.release(region, None)  # type: ignore[arg-type]


def test_the_plans_bound_holds_the_blocks_of_every_plan_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream of length buckets runs their plans in turn: the blocks of each stay held, so a
    bucket's next step pins nothing (the bound of the largest plan alone dropped the other
    buckets' blocks, and their next steps pinned them again on the step's thread: issue 50 s2)."""
    monkeypatch.setattr(room, "PLAN_SLACK_MIN_BYTES", 0)  # the slack is then 25% of the need
    arena = _arena(HostLedger())
    short, long = [MIB] * 4, [3 * MIB] * 4  # the 1 MiB blocks cannot serve 3 MiB regions
    arena.pin_for_plan(short, hold_idle=True)
    assert arena.needs.latest == 4 * MIB and arena.needs.cap == 5 * MIB
    arena.settle(wait=True)
    _use(arena, short, step=1)
    arena.pin_for_plan(long, hold_idle=True)
    arena.settle(wait=True)
    assert arena.needs.latest == 12 * MIB and arena.needs.cap == 16 * MIB + 4 * MIB
    _use(arena, long, step=2)
    arena.end_step(2)
    pinned = arena.counters.pinned_allocations
    for step in range(3, 7):  # the buckets in turn, each plan put in force again
        plan = short if step % 2 else long
        arena.pin_for_plan(plan, hold_idle=True)
        _use(arena, plan, step=step)
        arena.end_step(step)
    assert arena.counters.pinned_allocations == pinned and arena.counters.trimmed_for_plan == 0
    assert arena.counters.bytes_held == 16 * MIB


def test_blocks_shared_by_plans_are_held_once_and_kept_in_any_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block serves regions of 44% of its size up to all of it: a shorter bucket's plan takes
    the longer one's blocks, so less than the plans' needs together is held, and putting the
    plans in force in any order drops and pins nothing."""
    monkeypatch.setattr(room, "PLAN_SLACK_MIN_BYTES", 0)
    arena = _arena(HostLedger())
    long, short = [4 * MIB] * 3, [2 * MIB] * 2 + [MIB]  # two served by 4 MiB blocks, one not
    arena.pin_for_plan(long, hold_idle=True)
    arena.pin_for_plan(short, hold_idle=True)
    arena.settle(wait=True)
    assert arena.needs.cap == 17 * MIB + 17 * MIB // 4
    assert arena.counters.bytes_held == 13 * MIB
    pinned = arena.counters.pinned_allocations
    for step, plan in enumerate((long, short, short, long, short, long, long, short)):
        arena.pin_for_plan(plan, hold_idle=True)
        _use(arena, plan, step=step)
        arena.end_step(step)
    assert arena.counters.pinned_allocations == pinned and arena.counters.trimmed_for_plan == 0


def test_a_plan_half_as_long_runs_in_the_longer_ones_blocks_though_its_steps_ask_a_little_less(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Buckets a doubling apart (T22's 4096 and 8192): the shorter plan's predicted regions are
    half the longer one's blocks, and its steps ask a few percent less than predicted (a plan is
    made for its bucket's top). Its regions are served when its plan is put in force, and its
    steps take those blocks: none pinned on the step's thread (at a reuse slack of exactly 2,
    every such request missed: the plan looked ready, and its first step pinned them itself)."""
    monkeypatch.setattr(room, "PLAN_SLACK_MIN_BYTES", 0)
    arena = _arena(HostLedger())
    long = [128 * MIB + 4 * BLOCK_GRANULE] * 3
    predicted = [n // 2 for n in long]
    arena.pin_for_plan(long, hold_idle=True)
    arena.settle(wait=True)
    assert arena.unserved(predicted, pending=False) == []
    pinned = arena.counters.pinned_allocations
    arena.pin_for_plan(predicted, hold_idle=True)
    _use(arena, [n - 3 * n // 100 for n in predicted], step=1)  # the step asks 3% less
    assert arena.counters.pinned_allocations == pinned


def test_a_budget_under_the_plans_bound_drops_the_least_recently_used_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the budget cannot hold every plan's blocks, the new plan's are pinned ahead all the
    same: idle blocks go to make room, those used longest ago first."""
    monkeypatch.setattr(room, "PLAN_SLACK_MIN_BYTES", 0)
    arena = _arena(HostLedger(), budget=14 * MIB)
    arena.pin_for_plan([MIB] * 4, hold_idle=True)
    arena.settle(wait=True)
    _use(arena, [MIB] * 4, step=1)
    _use(arena, [MIB] * 2, step=2)  # two of them used again later
    arena.pin_for_plan([3 * MIB] * 4, hold_idle=True)
    arena.settle(wait=True)
    held = arena.counters.bytes_held + arena.counters.bytes_pending
    assert held <= 14 * MIB, f"held {held} bytes, over the budget"
    assert sum(r.block.numel() == 3 * MIB for r in arena._free) == 4, "the new plan's blocks were not pinned ahead"
    kept = sorted(r.used_in_step for r in arena._free if r.block.numel() == MIB)
    assert kept == [2, 2], f"the least recently used blocks were not dropped first: {kept}"


def test_a_forgotten_plans_blocks_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the last PLANS_REMEMBERED plans bound what is held: an older plan's blocks go."""
    monkeypatch.setattr(room, "PLAN_SLACK_MIN_BYTES", 0)
    monkeypatch.setattr(room, "PLANS_REMEMBERED", 2)
    arena = _arena(HostLedger())
    for step, size in enumerate((9 * MIB, MIB, 3 * MIB)):  # none serves another's regions
        arena.pin_for_plan([size] * 2, hold_idle=True)
        arena.settle(wait=True)
        _use(arena, [size] * 2, step=step)
        arena.end_step(step)
    assert arena.needs.cap == 8 * MIB + 2 * MIB
    assert sorted(r.block.numel() for r in arena._free) == [MIB] * 2 + [3 * MIB] * 2
    assert arena.counters.trimmed_for_plan == 2


def test_nothing_is_pinned_ahead_beyond_the_plans_need(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(room, "PLAN_SLACK_MIN_BYTES", 0)
    arena = _arena(HostLedger())
    arena.pin_for_plan([2 * MIB] * 2, hold_idle=True)
    arena.settle(wait=True)
    # A step whose groups want more blocks than its plan said: the one asked for now is pinned
    # (the GPU may have no room for its group), the 50 forecast after it are not.
    regions = [arena.acquire(2 * MIB, step=1) for _ in range(2)]
    regions.append(arena.acquire(MIB, step=1, expected_more=lambda: 50))
    assert all(region is not None for region in regions)
    arena.settle(wait=True)
    assert arena.counters.bytes_held + arena.counters.bytes_pending <= arena.needs.cap  # type: ignore[operator]


# -- one host figure for the planner (issue 49 item 8) -----------------------------------------
def _lowest_plan(**options: object) -> tuple[str, dict[str, int]]:
    layers = make_gpt_layers(4)
    x = torch.randn(2, 64, 64)
    expected = plain_reference(layers, x)
    oa = offload.OffloadActivations(layers, device="cpu", memory_budget_bytes="lowest", **options)  # type: ignore[arg-type]
    for _ in range(4):
        assert_bitwise(expected, oa_step(layers, x, oa))
    assert oa.plan is not None
    kept = dict(oa.stats["kept"])
    oa.close()
    return oa.plan.describe(), kept


def test_a_process_budget_of_zero_plans_what_host_budget_bytes_zero_plans(node_ledger: HostLedger) -> None:
    with pytest.warns(UserWarning, match="host room limits the plan"):
        given, given_kept = _lowest_plan(host_budget_bytes=0)
    set_process_host_budget(0)
    with pytest.warns(UserWarning, match="host room limits the plan.*set_process_host_budget"):
        process, process_kept = _lowest_plan()
    # No host room: nothing copied, the recomputed layers keep their inputs on the device.
    assert given == process and "inputs kept" in given and "offload" not in given, \
        f"host_budget_bytes=0 plans {given!r}, a process budget of 0 {process!r}"
    assert "budget" not in process_kept, f"the plan counted on copies the ledger then refused: {process_kept}"


def test_plans_are_made_for_the_nodes_room_and_nothing_is_refused(node_ledger: HostLedger, tmp_path: Path) -> None:
    free, _ = _lowest_plan()
    assert free != "keep 4"
    total = 64 * MIB
    _other_process(tmp_path, total - node_floor(total))  # nothing left above the floor
    node_ledger.set_node_source(SimulatedNode(total, str(tmp_path)))
    with pytest.warns(UserWarning, match=r"host room limits the plan.*the node's room.*floor"):
        planned, kept = _lowest_plan()
    # Copies nothing: the recomputed layers keep their inputs on the device.
    assert "inputs kept" in planned and "offload" not in planned and "budget" not in kept, planned


def test_a_node_that_fills_up_after_planning_gets_a_plan_for_the_room_left(node_ledger: HostLedger, tmp_path: Path) -> None:
    # The plan for a new length is made with the node's room as it is; then another job takes
    # what is left (here from a forward pre-hook on the first layer, which runs after the
    # context's own, where the plan is made), so the step's copies find no room and stay on the device, which the plan did not count
    # on (on a GPU, the way to an out-of-memory step). The next step is planned again for the
    # room left, and nothing is refused any more. Every step is plain's bit for bit.
    total = 256 * MIB
    node_ledger.set_node_source(SimulatedNode(total, str(tmp_path)))
    layers = make_gpt_layers(4)
    short, long = torch.randn(2, 32, 64), torch.randn(2, 128, 64)
    expected = {x.shape[1]: plain_reference(layers, x) for x in (short, long)}
    oa = offload.OffloadActivations(layers, device="cpu", memory_budget_bytes="lowest")
    try:
        for _ in range(4):
            assert_bitwise(expected[32], oa_step(layers, short, oa))
        assert oa.plan is not None and oa.plan.describe() != "keep 4", oa.plan.describe()

        def squeeze(*_: object) -> None:
            # Everything above the floor but what this process holds now, read at once (the
            # ledger reads the node at most every few ms; a CPU step is shorter than that).
            _other_process(tmp_path, total - node_floor(total) - node_ledger.held_bytes)
            node_ledger.read_node(0.0)

        hook = layers[0].register_forward_pre_hook(squeeze)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert_bitwise(expected[128], oa_step(layers, long, oa))
            hook.remove()
            squeezed = dict(oa.stats["kept"])
            assert squeezed.get("budget", 0) > 0, f"the squeeze refused nothing: {squeezed}"
            for step in range(2):
                assert_bitwise(expected[128], oa_step(layers, long, oa))
                kept = dict(oa.stats["kept"])
                assert "budget" not in kept, f"step {step} after the squeeze still counts on refused copies: {kept}"
        assert any("planned again for the room there is now" in str(w.message) for w in seen), \
            [str(w.message)[:120] for w in seen]
    finally:
        oa.close()


# -- two processes on one node -----------------------------------------------------------------
def test_two_processes_whose_plans_each_ask_for_60_percent_of_the_node_both_finish_within_it(tmp_path: Path) -> None:
    """Two independent processes on one (simulated) node, each planning for a device budget that
    needs offloading, each plan asking for 60% of the node's memory: the second sees the first's
    bytes through the node's ``available``, plans for the room left (keeping or recomputing the
    rest), and neither process, nor the two together, holds more than the node less its floor."""
    sys.path.insert(0, str(TESTS))
    from _shared_node_worker import workload

    layers, x = workload()
    profile = offload.planner.profile_step(layers, lambda: train_step(layers, x), device="cpu", warmup_steps=0)
    lowest = offload.planner.lowest_peak(profile).prediction.peak_bytes
    budget = (lowest + profile.plain_peak_bytes) // 2  # between the lowest and the plain peak: offloads
    procs = {role: subprocess.Popen(
        [sys.executable, str(TESTS / "_shared_node_worker.py"), role, str(tmp_path), str(tmp_path / f"{role}.json"),
         str(budget)],
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")])),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for role in ("first", "second")}
    for role, proc in procs.items():
        try:
            output, _ = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for other in procs.values():
                other.kill()
            pytest.fail(f"the {role} process did not finish in 240 s")
        assert proc.returncode == 0, f"the {role} process failed:\n{output[-3000:]}"
    first, second = (json.loads((tmp_path / f"{r}.json").read_text()) for r in ("first", "second"))
    total = int((tmp_path / "node" / ".total").read_text())  # the first plan's need / 0.6
    assert second["node_total_bytes"] == total and first["needed_bytes"] >= 0.59 * total
    floor = node_floor(total)
    assert first["ledger_peak_bytes"] <= total - floor, f"the first process held more than the node allows: {first}"
    assert first["ledger_peak_bytes"] + second["ledger_peak_bytes"] <= total - floor, (
        f"together they held {first['ledger_peak_bytes'] + second['ledger_peak_bytes']} bytes of a "
        f"{total}-byte node with a {floor}-byte floor: {first} {second}")
    assert second["node_available_bytes"] <= total - first["held_bytes"], "the second did not see the first's bytes"
    assert second["plan_d2h_bytes"] < first["plan_d2h_bytes"], f"the second planned as if alone: {second}"
    assert "budget" not in second["kept"], f"the second planned copies it was then refused: {second}"
    assert any("host room limits the plan" in w for w in second["warnings"]), second["warnings"]
