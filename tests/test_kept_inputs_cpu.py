"""RECOMPUTE with the checkpoint's inputs kept on the device (``LayerPlan.keep_inputs``).

Where the host room binds (a shared node, context parallelism's large boundaries), the planner
could only send a recomputed layer's inputs to the host or keep the whole layer; gradient
checkpointing's plan, every boundary on the device, was not expressible. Here:

- the plan type: validation, ``to_dict``/``from_dict`` (older four-field lists still load),
  ``describe()`` and the table;
- the cost model: such a layer holds its inputs to its backward and copies nothing;
- the search: under a host budget below every layer's inputs the plans found copy nothing and
  peak below the plain step (before: the plain step, or BudgetError under a lower budget);
  without a host budget, or with one that binds nothing, the candidates and plans are as before;
- the engine: such a layer runs under checkpointing and makes no group (its inputs are not
  offloaded) while another recomputed layer's inputs are, gradients bit for bit.
"""

from __future__ import annotations

import concurrent.futures
import json
import types

import pytest
import torch

import offload
from offload.engine.schedules.planned import PlannedSchedule
from offload.host.arena import BLOCK_GRANULE, HostArena
from offload.host.blocks import REUSE_SLACK, with_headroom
from offload.host.layout import align_up
from offload.forwards import recompute
from offload.planner import Action, LayerPlan, Plan, profile_step
from offload.planner.make import choose
from offload.planner.model import held_bytes, offloaded_bytes, resident_bytes
from offload.planner.search import (
    BudgetError, _space, best_plan, layer_candidates, lowest_peak, lowest_recompute, most_copied_bytes, plan_for,
)
from offload.planner.shapes import StepShape
from offload.planner.tiling import longest_fitting, lowest_at

from _bench_util import bench_module
from _util import assert_bitwise, make_gpt_layers, oa_step, plain_reference, run_layers, train_step

pytestmark = pytest.mark.usefixtures("deterministic")

KEPT = LayerPlan(Action.RECOMPUTE, keep_inputs=True)
SENT = LayerPlan(Action.RECOMPUTE)


def _x() -> torch.Tensor:
    return torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def model() -> tuple[torch.nn.ModuleList, object]:
    """Five small GPT layers and their probe's profile (layer 0 saves an activation, not the leaf)."""
    layers = make_gpt_layers(5)
    prof = profile_step(layers, lambda: train_step(layers, _x(), scale_input=True), device="cpu", min_offload_bytes=0)
    return layers, prof


# ---------------------------------------------------------------------------------- the plan type

def test_keep_inputs_applies_to_recompute_only() -> None:
    for action in (Action.KEEP, Action.OFFLOAD):
        with pytest.raises(ValueError, match=f"keep_inputs applies to RECOMPUTE only.*{action.value}"):
            LayerPlan(action, keep_inputs=True)
    with pytest.raises(ValueError, match="keep_inputs must be a bool"):
        LayerPlan(Action.RECOMPUTE, keep_inputs=1)  # type: ignore[arg-type]
    assert KEPT.keep_inputs and not KEPT.offloads and SENT.offloads and not LayerPlan(Action.KEEP).offloads


def test_saved_plans_round_trip_and_say_what_they_keep(model) -> None:
    _, prof = model
    plan = plan_for(prof, [LayerPlan(Action.KEEP), SENT, KEPT, LayerPlan(Action.OFFLOAD), KEPT])
    assert plan.describe() == "keep 1, offload 1, recompute 3 (2 inputs kept)"
    table = plan.table()
    assert table.count("recompute, inputs kept") == 2, table
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back == plan and [lp.keep_inputs for lp in back.layers] == [False, False, True, False, True]
    # A plan saved before kept inputs existed (four fields a layer) loads with none kept.
    old = plan.to_dict()
    old["layers"] = [entry[:4] for entry in old["layers"]]
    assert not any(lp.keep_inputs for lp in Plan.from_dict(old).layers)


def test_the_cost_model_holds_kept_inputs_and_copies_nothing(model) -> None:
    _, prof = model
    layer = prof.layers[1]
    assert offloaded_bytes(layer, KEPT) == 0 and offloaded_bytes(layer, SENT) == layer.input_bytes
    assert held_bytes(layer, KEPT) == resident_bytes(layer, KEPT) == layer.input_bytes
    assert resident_bytes(layer, SENT) == 0
    pred = plan_for(prof, [KEPT] * 5, 1).prediction
    assert pred.d2h_bytes == pred.h2d_bytes == 0
    # Every boundary held at the end of forward (a recompute's forward builds no more than keep's).
    assert pred.peak_bytes < prof.plain_peak_bytes


# -------------------------------------------------------------------------------------- the search

def test_a_host_budget_below_every_layers_inputs_still_finds_a_lower_plan(model) -> None:
    _, prof = model
    host = min(layer.input_bytes for layer in prof.layers) - 1  # no layer's inputs fit the host
    low = lowest_peak(prof, host_budget=host)
    assert low.prediction.d2h_bytes <= host
    assert low.prediction.peak_bytes < 0.5 * prof.plain_peak_bytes, low.table()
    assert any(lp.keep_inputs for lp in low.layers), low.describe()
    # A budget under the plain peak: before, BudgetError (only whole layers could stay).
    budget = (low.prediction.peak_bytes + prof.plain_peak_bytes) // 2
    made = best_plan(prof, budget, host_budget=host)
    assert made.prediction.d2h_bytes <= host and made.prediction.peak_bytes <= budget
    chosen = choose(prof, budget, torch.device("cpu"), host_budget=host)
    assert chosen.prediction.d2h_bytes <= host and chosen.prediction.peak_bytes <= budget
    assert "host room" in chosen.budget_reason  # the host bound it, and the plan says so


def test_without_a_binding_host_budget_the_search_is_unchanged(model) -> None:
    _, prof = model
    most = most_copied_bytes(prof)
    assert most == plan_for(prof, [LayerPlan(Action.OFFLOAD)] * 5).prediction.d2h_bytes
    plain = [layer_candidates(layer) for layer in prof.layers]
    assert not any(lp.keep_inputs for c in plain for lp in c)
    assert _space(prof) == _space(prof, most) == _space(prof, 10 * most) == plain
    # Where it binds, the kept-input candidate sits before the last two (OFFLOAD all, RECOMPUTE).
    for c, bound in zip(plain, _space(prof, most - 1)):
        assert bound[:-2] == c[:-2] + [KEPT] and bound[-2:] == c[-2:]
    budget = (lowest_peak(prof).prediction.peak_bytes + prof.plain_peak_bytes) // 2
    assert best_plan(prof, budget, host_budget=most) == best_plan(prof, budget)
    assert lowest_peak(prof, host_budget=most) == lowest_peak(prof)


def test_the_h200_finding_llama_8b_layers_at_524288_tokens_with_little_host_room() -> None:
    # 32 LLAMA-8B-shaped layers at 524,288 tokens (4 GiB of inputs a layer, benchmarks/
    # plan_search.py) and a host room of 85% of what every input sent copies: before, the lowest
    # plan kept 5 whole layers and peaked at 522 GiB (BudgetError under any real budget); now a
    # few boundaries stay on the device, near all-recompute's peak, in a search of the deep path.
    bench = bench_module("plan_search")
    prof = bench.profile([bench.layer(scale=32, selective=False)] * 32)
    sent = lowest_recompute(prof)
    host = int(sent.prediction.d2h_bytes * 0.85)
    low = lowest_peak(prof, host_budget=host)
    assert low.prediction.d2h_bytes <= host and any(lp.keep_inputs for lp in low.layers), low.describe()
    assert low.prediction.peak_bytes <= 1.15 * sent.prediction.peak_bytes, low.table()
    made = best_plan(prof, int(low.prediction.peak_bytes * 1.05), host_budget=host)
    assert made.prediction.d2h_bytes <= host


def test_no_kept_input_plan_below_its_floor_is_claimed(model) -> None:
    _, prof = model
    floor = lowest_peak(prof, host_budget=0).prediction.peak_bytes
    with pytest.raises(BudgetError, match="lowest peak reachable"):
        best_plan(prof, floor // 2, host_budget=0)


def test_what_fits_counts_kept_inputs_under_a_host_budget(model) -> None:
    # The "no plan fits" error's advice (the lowest plan's figures, the longest length that fits)
    # under a host room of nothing: every boundary kept, not "nothing fits".
    _, prof = model
    sent, kept = lowest_recompute(prof), lowest_recompute(prof, host_budget=0)
    assert sent.prediction.d2h_bytes == sum(layer.input_bytes for layer in prof.layers)
    assert kept.prediction.d2h_bytes == 0 and all(lp.keep_inputs for lp in kept.layers)
    device, host = lowest_at(prof, StepShape(2, 64), None, host_budget=0)
    assert host == 0
    longest = longest_fitting(prof, 2, device, None, 0)
    assert longest is not None and longest >= 64


def test_a_miss_under_a_plan_pins_ahead_only_the_later_regions_no_idle_block_serves(model) -> None:
    # A group that finds no idle block pins one and forecasts blocks for the step's later groups.
    # Under a plan those are its later regions, each at its own size, and only where no idle
    # block serves one: T22's 8192-token plan, one group over its prediction, pinned 1.8-9 GB
    # of blocks sized like the missing one for later layers whose own blocks were idle.
    _, prof = model
    off = LayerPlan(Action.OFFLOAD)
    plan = plan_for(prof, [off, SENT, SENT, off, SENT])
    schedule = PlannedSchedule(plan, prof)
    offloaded0, inputs1, inputs2, offloaded3, inputs4 = schedule.region_bytes()
    assert offloaded0 > REUSE_SLACK * inputs1 and schedule.offloaded_after(0) == 4
    assert schedule.groups_after(types.SimpleNamespace(layer=0, top=0, nbytes=offloaded0)) == [
        inputs1, inputs2, offloaded3, inputs4]
    schedule.scale = 0.5  # a step shorter than the plan's top asks for regions scaled to its tokens
    assert schedule.groups_after(types.SimpleNamespace(layer=3, top=3, nbytes=offloaded3)) == [inputs4 // 2]

    queued: list[int] = []
    arena = HostArena(pinned=True, budget_bytes=1 << 34, retain=False,
                      allocate=lambda n: (torch.empty(n, dtype=torch.uint8), n))
    arena.pinner.submit = lambda n: queued.append(n) or _done(n)  # type: ignore[method-assign]
    # The plan's blocks, pinned when it was put in force, all but the second offloaded layer's.
    arena.preallocate([inputs1, inputs2, inputs4])
    later = [inputs1, inputs2, offloaded3, inputs4]
    region = arena.acquire(offloaded0 + 4096, step=1, expected_more=lambda: later)  # over its prediction
    assert region is not None and queued == [with_headroom(align_up(offloaded3, BLOCK_GRANULE))]
    # A count (a schedule without a plan): that many blocks guessed at the missing group's size.
    queued.clear()
    arena.settle()
    arena.acquire(8 * offloaded0, step=2, expected_more=lambda: 2)
    assert queued == [with_headroom(align_up(8 * offloaded0, BLOCK_GRANULE))] * 2


def _done(n: int) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result((torch.empty(n, dtype=torch.uint8), n))
    return future


# -------------------------------------------------------------------------------------- the engine

def test_kept_inputs_stay_on_the_device_bit_for_bit(model, monkeypatch) -> None:
    layers, prof = model
    x = _x()
    expected = plain_reference(layers, x, scale_input=True)
    actions = [SENT, KEPT, LayerPlan(Action.OFFLOAD), KEPT, LayerPlan(Action.KEEP)]
    plan = plan_for(prof, actions)
    copied: dict[int, int] = {}
    real_end = PlannedSchedule.on_layer_end

    def on_layer_end(self, engine, layer, group):  # type: ignore[no-untyped-def]
        if group is not None:
            copied[layer] = group.copy_bytes
        return real_end(self, engine, layer, group)

    monkeypatch.setattr(PlannedSchedule, "on_layer_end", on_layer_end)
    checkpoints: list[int] = []
    real_checkpoint = recompute.checkpoint
    monkeypatch.setattr(recompute, "checkpoint", lambda *a, **k: checkpoints.append(1) or real_checkpoint(*a, **k))
    oa = offload.OffloadActivations(layers, plan=plan, device="cpu", min_offload_bytes=0)
    for _ in range(3):
        copied.clear()
        checkpoints.clear()
        assert_bitwise(expected, oa_step(layers, x, oa, run=lambda h: run_layers(layers, h * 1.0)))
        assert len(checkpoints) == 3  # layers 0, 1 and 3 ran under checkpointing
        # The kept layers made no group; the other recompute sent exactly its inputs.
        assert sorted(copied) == [0, 2], copied
        assert copied[0] == prof.layers[0].input_bytes
        assert oa.stats["offloaded_bytes"] == plan.prediction.d2h_bytes
    # Host blocks are pinned for the two copying layers only.
    assert len(PlannedSchedule(plan, prof).region_bytes()) == 2
    oa.close()
