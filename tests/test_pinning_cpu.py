"""Host blocks: exact bytes held, pinning ahead (reserve, background, growth forecast), host
refusals, the ``timing`` option and the profiler ranges. Runs on CPU: the arena is given an
allocator that stands in for the pinned one (same contract: ``n -> (block, bytes held)``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
import torch

import offload
from offload.host.arena import BLOCK_GRANULE, HostArena

from _util import assert_bitwise, cpu_context, make_mlp_layers, plain_reference, train_step


class FakePinned:
    """Allocator that rounds like a huge-page pinner (2 MiB) and records who called it."""

    def __init__(self, round_to: int = 2 << 20, fail: bool = False, gate: threading.Event | None = None) -> None:
        self.round_to = round_to
        self.fail = fail
        self.gate = gate
        self.calls: list[tuple[int, str]] = []

    def __call__(self, nbytes: int) -> tuple[torch.Tensor, int]:
        self.calls.append((nbytes, threading.current_thread().name))
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail:
            raise RuntimeError("cuMemHostRegister failed with CUDA_ERROR_OUT_OF_MEMORY")
        return torch.empty(nbytes, dtype=torch.uint8), -(-nbytes // self.round_to) * self.round_to


def pinned_arena(allocator: FakePinned, budget: int = 1 << 30) -> HostArena:
    return HostArena(pinned=True, budget_bytes=budget, retain=False, allocate=allocator)


def test_bytes_held_are_the_bytes_really_pinned() -> None:
    alloc = FakePinned()
    arena = pinned_arena(alloc)
    region = arena.acquire(3 * BLOCK_GRANULE, step=1)
    assert region is not None and region.block.numel() == 3 * BLOCK_GRANULE
    assert arena.counters.bytes_held == 2 << 20  # what the allocator says it locked, not the request
    arena.release(region, None)
    other = arena.acquire(40 * BLOCK_GRANULE, step=2)  # too big for the idle block: a new one
    assert arena.counters.bytes_held == (2 << 20) + (4 << 20)
    arena.end_step(2)  # the first block was not used in step 2: trimmed, its real bytes given back
    assert arena.counters.bytes_held == 4 << 20 and other is not None


def test_reserve_pins_ahead_and_the_step_then_allocates_nothing() -> None:
    layers, x = make_mlp_layers(4, width=256), torch.randn(256, 256)  # 256 KiB activations
    expected = plain_reference(layers, x)
    probe_ctx, probe_sync = cpu_context(3, 4)
    train_step(layers, x, probe_ctx, probe_sync)
    need = probe_ctx.stats["bytes_h2d"]  # the three groups' regions
    ctx, sync = cpu_context(3, 4)
    assert ctx.reserve(need) >= need
    assert ctx.engine.arena.counters.pinned_allocations == 3  # one block per offloaded layer
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    assert ctx.engine.arena.counters.pinned_allocations == 3
    assert ctx.stats["pinned_allocations"] == 0


def test_reserve_after_a_step_repeats_its_group_sizes() -> None:
    alloc = FakePinned(round_to=1)
    arena = pinned_arena(alloc)
    for size in (5 * BLOCK_GRANULE, 2 * BLOCK_GRANULE):
        arena.acquire(size, step=1)
    assert arena.sizes_for(14 * BLOCK_GRANULE, blocks_if_unknown=9) == [5 * BLOCK_GRANULE, 2 * BLOCK_GRANULE] * 2
    fresh = pinned_arena(FakePinned())
    assert fresh.sizes_for(24 * BLOCK_GRANULE, blocks_if_unknown=3) == [9 * BLOCK_GRANULE] * 3  # 1/8 headroom


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (1.5, TypeError), (True, TypeError), ("8", TypeError)])
def test_reserve_bad_input(bad: Any, error: type) -> None:
    ctx, _ = cpu_context(1, 2)
    with pytest.raises(error, match="reserve"):
        ctx.reserve(bad)


def test_reserve_over_the_host_budget_names_it_and_pins_nothing() -> None:
    ctx, _ = cpu_context(2, 3, host_budget_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"host budget of 1048576 bytes \(host_budget_bytes"):
        ctx.reserve(4 << 20)
    assert ctx.engine.arena.counters.bytes_held == 0
    oa = offload.OffloadActivations(make_mlp_layers(3), device="cpu", host_budget_bytes=1 << 20)
    with pytest.raises(ValueError, match="host budget"):
        oa.reserve(4 << 20)


def test_background_preallocate_runs_on_the_pinner_thread_and_acquire_waits_for_it() -> None:
    gate = threading.Event()
    alloc = FakePinned(gate=gate)
    arena = pinned_arena(alloc)
    arena.preallocate([4 * BLOCK_GRANULE], background=True)
    assert arena.counters.bytes_pending == 4 * BLOCK_GRANULE
    threading.Timer(0.2, gate.set).start()  # the block finishes pinning while acquire waits
    region = arena.acquire(3 * BLOCK_GRANULE, step=1)
    assert region is not None and region.block.numel() == 4 * BLOCK_GRANULE
    assert arena.counters.waited_for_pinning == 1
    assert arena.counters.bytes_pending == 0
    assert [name for _, name in alloc.calls] and all(n.startswith("offload-pinner") for _, n in alloc.calls)


def test_blocks_queued_ahead_are_pinned_by_the_pinners_workers_at_a_time() -> None:
    # At most PINNER_WORKERS blocks pin at once, whatever is queued: each registration holds the
    # driver's lock, and the training thread needs gaps in it (offload.host.pinning).
    from offload.host import pinning

    gate = threading.Event()
    alloc = FakePinned(gate=gate)
    arena = pinned_arena(alloc)
    queued = pinning.PINNER_WORKERS + 2
    arena.preallocate([(4 + i) * BLOCK_GRANULE for i in range(queued)], background=True)
    deadline = time.monotonic() + 5
    while len(alloc.calls) < pinning.PINNER_WORKERS and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # time for a worker too many to start
    assert len(alloc.calls) == pinning.PINNER_WORKERS
    gate.set()
    arena.settle(wait=True)
    assert arena.counters.bytes_pending == 0 and arena.counters.pinned_allocations == queued


def test_a_held_pinner_starts_no_block_and_a_step_that_needs_one_lets_them_go() -> None:
    # A step new to the allocator holds the pinning (its cudaMalloc calls would wait behind each
    # registration); a block queued then starts only once let go, and a step that must wait for
    # a block being pinned lets the pinner go rather than wait forever.
    alloc = FakePinned()
    arena = pinned_arena(alloc)
    arena.pinner.hold(True)
    arena.preallocate([4 * BLOCK_GRANULE, 6 * BLOCK_GRANULE], background=True)
    time.sleep(0.2)
    assert alloc.calls == [] and arena.counters.bytes_pending > 0 and arena.pinner.held
    region = arena.acquire(4 * BLOCK_GRANULE, step=1)  # waits for the queued block: lets them go
    assert region is not None and arena.counters.waited_for_pinning == 1 and not arena.pinner.held
    arena.pinner.hold(True)
    arena.preallocate([8 * BLOCK_GRANULE], background=True)
    arena.settle(wait=True)  # (waiting for every queued block lets them go too)
    assert arena.counters.bytes_pending == 0 and len(alloc.calls) == 3 and not arena.pinner.held


def test_first_miss_forecasts_the_steps_remaining_layers() -> None:
    alloc = FakePinned()
    arena = pinned_arena(alloc)
    first = arena.acquire(BLOCK_GRANULE, step=1, expected_more=lambda: 3)
    assert first is not None
    later = [arena.acquire(BLOCK_GRANULE, step=1, expected_more=lambda: 2 - i) for i in range(3)]
    assert all(r is not None for r in later)
    pinner_calls = [n for n, name in alloc.calls if name.startswith("offload-pinner")]
    assert len(pinner_calls) == 3  # the three later layers were pinned in the background
    assert len(alloc.calls) == 4 and arena.counters.pinned_allocations == 4


def test_forecast_stays_inside_the_budget() -> None:
    alloc = FakePinned(round_to=1)
    arena = pinned_arena(alloc, budget=3 * BLOCK_GRANULE)
    arena.acquire(BLOCK_GRANULE, step=1, expected_more=lambda: 10)
    assert arena.counters.bytes_pending + arena.counters.bytes_held <= 3 * BLOCK_GRANULE


def test_host_refusal_keeps_the_group_on_the_gpu_counted_as_budget_and_loses_nothing() -> None:
    layers, x = make_mlp_layers(4, width=64), torch.randn(8, 64)
    expected = plain_reference(layers, x)
    ctx, sync = cpu_context(3, 4)
    ctx.engine.arena.allocate = FakePinned(fail=True)
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    stats = ctx.stats
    assert stats["groups_kept"] == 3 and stats["kept"].get("budget", 0) > 0
    assert stats["offloaded_tensors"] == 0 and ctx.engine.arena.counters.failures == 3


def test_background_refusal_falls_back_to_allocating_now() -> None:
    alloc = FakePinned(fail=True)
    arena = pinned_arena(alloc)
    arena.preallocate([BLOCK_GRANULE], background=True)
    alloc.fail = False
    # The queued block may or may not have failed yet; either way acquire ends with a block.
    assert arena.acquire(BLOCK_GRANULE, step=1) is not None


def test_background_pinning_at_exit_does_not_crash_the_interpreter() -> None:
    script = textwrap.dedent(
        """
        import time, torch
        from offload.host.arena import HostArena
        def slow(n):
            time.sleep(0.3)
            return torch.empty(n, dtype=torch.uint8), n
        arena = HostArena(pinned=True, budget_bytes=1 << 30, retain=False, allocate=slow)
        arena.preallocate([1 << 16] * 5, background=True)
        time.sleep(0.05)
        del arena   # dropped with blocks queued and one being pinned
        print("done")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "done"
    assert "Traceback" not in result.stderr and "Exception" not in result.stderr


@pytest.mark.parametrize("timing", [None, True, False])
def test_timing_option(timing: Any) -> None:
    layers, x = make_mlp_layers(4, width=64), torch.randn(8, 64)
    expected = plain_reference(layers, x)
    ctx, sync = cpu_context(3, 4, timing=timing)
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    stats = ctx.stats
    if timing is False:
        assert stats["timed_bytes_d2h"] == 0 and stats["d2h_gbps"] is None
        assert "not timed" in ctx.report()
    else:  # the host clock costs nothing: host copies are timed unless turned off
        assert stats["timed_bytes_d2h"] == stats["bytes_d2h"] > 0


def test_timing_must_be_a_bool_or_none() -> None:
    with pytest.raises(TypeError, match="timing"):
        cpu_context(1, 2, timing="yes")


def test_profiler_trace_names_the_offload_work() -> None:
    layers, x = make_mlp_layers(4, width=64), torch.randn(8, 64)
    ctx, sync = cpu_context(3, 4)
    train_step(layers, x, ctx, sync)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        train_step(layers, x, ctx, sync)
    names = {e.name for e in prof.events()}
    for name in ("offload::pack", "offload::offload", "offload::release_wait", "offload::reload", "offload::unpack"):
        assert name in names, f"{name} missing from the trace"
    counts = {n: sum(e.name == n for e in prof.events()) for n in ("offload::offload", "offload::pack")}
    assert counts["offload::offload"] == 3  # one per offloaded layer
    assert counts["offload::pack"] == ctx.stats["offloaded_tensors"] + ctx.stats["kept_tensors"] - ctx.stats["kept"].get("layer", 0)


def test_an_idle_block_is_taken_before_waiting_for_one_being_pinned() -> None:
    gate = threading.Event()
    arena = pinned_arena(FakePinned(gate=gate))
    gate.set()
    arena.preallocate([4 * BLOCK_GRANULE])  # idle, ready
    gate.clear()
    arena.preallocate([4 * BLOCK_GRANULE], background=True)  # held up on the pinner
    threading.Timer(2.0, gate.set).start()
    start = time.perf_counter()
    region = arena.acquire(3 * BLOCK_GRANULE, step=1)
    assert region is not None and time.perf_counter() - start < 1.0
    assert arena.counters.waited_for_pinning == 0
    gate.wait(5)


# -- keep_while_pinning: a group does not wait for its block (wait_for_pinning=False) -----------
def test_a_miss_that_would_pin_now_keeps_the_group_and_pins_in_the_background() -> None:
    gate = threading.Event()
    alloc = FakePinned(gate=gate)
    arena = pinned_arena(alloc)
    asked: list[int] = []
    arena.keep_while_pinning = lambda n: asked.append(n) is None
    start = time.perf_counter()
    assert arena.acquire(3 * BLOCK_GRANULE, step=1) is None  # kept: nothing pinned on this thread
    assert time.perf_counter() - start < 1.0
    assert asked == [3 * BLOCK_GRANULE]
    assert arena.counters.kept_while_pinning == 1 and arena.counters.failures == 0
    assert arena.counters.bytes_pending == 3 * BLOCK_GRANULE
    gate.set()
    arena.settle(wait=True)
    assert arena.counters.bytes_pending == 0 and arena.has_idle_blocks()
    region = arena.acquire(3 * BLOCK_GRANULE, step=2)  # the next step finds it pinned
    assert region is not None and region.block.numel() == 3 * BLOCK_GRANULE
    assert all(name.startswith("offload-pinner") for _, name in alloc.calls)


def test_a_block_still_being_pinned_is_not_waited_for_when_the_group_can_stay() -> None:
    gate = threading.Event()
    alloc = FakePinned(gate=gate)
    arena = pinned_arena(alloc)
    arena.preallocate([4 * BLOCK_GRANULE], background=True)
    arena.keep_while_pinning = lambda n: True
    start = time.perf_counter()
    assert arena.acquire(3 * BLOCK_GRANULE, step=1) is None
    assert time.perf_counter() - start < 1.0 and arena.counters.waited_for_pinning == 0
    assert arena.counters.kept_while_pinning == 1
    assert len(alloc.calls) == 1  # no second block queued: the pending one will serve
    gate.set()
    arena.keep_while_pinning = lambda n: False  # no room now: wait for it
    region = arena.acquire(3 * BLOCK_GRANULE, step=2)
    assert region is not None and region.block.numel() == 4 * BLOCK_GRANULE


def test_each_kept_group_gets_its_own_block_for_the_next_step() -> None:
    gate = threading.Event()
    alloc = FakePinned(gate=gate)
    arena = pinned_arena(alloc)
    arena.keep_while_pinning = lambda n: True
    # Two groups of one step miss while nothing is pinned: the first queues a block; the second
    # must not count on that same block (it is promised to the first), so it queues its own.
    assert arena.acquire(BLOCK_GRANULE, step=1) is None
    assert arena.acquire(BLOCK_GRANULE, step=1) is None
    assert arena.counters.bytes_pending == 2 * BLOCK_GRANULE
    gate.set()
    arena.settle(wait=True)
    assert arena.acquire(BLOCK_GRANULE, step=2) is not None
    assert arena.acquire(BLOCK_GRANULE, step=2) is not None  # no group of step 2 is kept
    assert arena.counters.kept_while_pinning == 2


def test_no_room_to_keep_pins_now_as_before_and_budget_refusals_are_not_pinning_misses() -> None:
    alloc = FakePinned(round_to=1)
    arena = pinned_arena(alloc, budget=2 * BLOCK_GRANULE)
    arena.keep_while_pinning = lambda n: False
    assert arena.acquire(BLOCK_GRANULE, step=1) is not None  # pinned on this thread
    assert [name for _, name in alloc.calls] == [threading.current_thread().name]
    arena.keep_while_pinning = lambda n: True
    assert arena.acquire(4 * BLOCK_GRANULE, step=1) is None  # over the budget: a refusal
    assert arena.counters.failures == 1 and arena.counters.kept_while_pinning == 0


def test_groups_stay_on_the_device_while_their_blocks_pin_then_offload_exactly() -> None:
    layers, x = make_mlp_layers(4, width=64), torch.randn(8, 64)
    expected = plain_reference(layers, x)
    ctx, sync = cpu_context(3, 4)
    gate = threading.Event()
    arena = ctx.engine.arena
    arena.pinned, arena.allocate, arena.keep_while_pinning = True, FakePinned(gate=gate), lambda n: True
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    first = ctx.stats
    assert first["groups_kept"] == 3 and first["kept"].get("pinning", 0) > 0 and "budget" not in first["kept"]
    assert first["offloaded_tensors"] == 0
    gate.set()
    arena.settle(wait=True)
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    second = ctx.stats
    assert "pinning" not in second["kept"] and second["groups_offloaded"] == 3
    assert second["pinned_allocations"] == 0  # every block came from the background


def test_wait_for_pinning_is_a_checked_bool_option() -> None:
    with pytest.raises(TypeError, match="wait_for_pinning"):
        offload.get_cpu_offload_context(True, num_layers=1, model_layers=2, device="cpu", wait_for_pinning="no")
    ctx, _ = offload.get_cpu_offload_context(True, num_layers=1, model_layers=2, device="cpu", wait_for_pinning=False)
    assert ctx.engine.arena.keep_while_pinning is None  # host memory is never pinned: nothing to keep for


def test_a_claim_waits_for_the_fitting_block_queued_first() -> None:
    # A first plan's stand-in pins its few blocks first and its own plan's after: a claim that
    # several blocks being pinned fit waits for the one queued first (the pinner takes them in
    # order), not the smallest fitting one, which may be queued far behind.
    g = BLOCK_GRANULE
    busy, late = threading.Event(), threading.Event()

    def allocate(nbytes: int) -> tuple[torch.Tensor, int]:
        gate = {64 * g: busy, 4 * g: late}.get(nbytes)  # the 6-granule block pins at once
        if gate is not None:
            gate.wait(10)
        return torch.empty(nbytes, dtype=torch.uint8), nbytes

    arena = HostArena(pinned=True, budget_bytes=1 << 30, retain=False, allocate=allocate)
    arena.preallocate([64 * g, 64 * g, 6 * g, 4 * g], background=True)  # the workers busy, then 6, then 4
    threading.Timer(0.2, busy.set).start()
    threading.Timer(3.0, late.set).start()
    start = time.perf_counter()
    region = arena.acquire(3 * g, step=1)
    assert region is not None and region.block.numel() == 6 * g, "waited for the smallest, queued last"
    assert time.perf_counter() - start < 2.0 and arena.counters.waited_for_pinning == 1
    late.wait(5)


def test_each_pinner_worker_relaxes_its_capture_mode_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # Under torch's global capture mode a pin from any thread breaks a capture on another one:
    # each worker of a CUDA arena's pinner takes the relaxed mode before its first block.
    from offload.host import pinning

    relaxed: list[int] = []
    monkeypatch.setattr(pinning, "relax_capture_mode", lambda: relaxed.append(threading.get_ident()) or True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    pinner = pinning.BackgroundPinner(lambda n: (torch.empty(n, dtype=torch.uint8), n), 0)
    for future in [pinner.submit(16) for _ in range(3)]:
        future.result()
    pinner.close()
    assert len(relaxed) == pinning.PINNER_WORKERS and threading.get_ident() not in relaxed
    host_only = pinning.BackgroundPinner(lambda n: (torch.empty(n, dtype=torch.uint8), n), None)
    host_only.submit(16).result()
    host_only.close()
    assert len(relaxed) == pinning.PINNER_WORKERS  # a host-only arena's workers leave the driver alone
