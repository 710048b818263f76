"""Several micro-batches in flight on one engine (a pipeline stage's 1F1B order), on one process.

Forward mb0, forward mb1, backward mb0, ...: each micro-batch is a step whose groups are keyed by
(micro-batch, layer). Gradients stay bitwise; backward reaching a micro-batch prefetches *its*
groups (none is left to be reloaded on demand); the layer budget counts the GPU memory of every
micro-batch in flight; and the host blocks of one pipeline iteration are reused by the next.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytest
import torch

import offload
from offload.models import run_layers
from offload.planner import Action, plan_for

from _util import assert_bitwise, cpu_context, make_mlp_layers, train_step

ONE_F_ONE_B = [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]


class Stage:
    """Four MLP layers run in a given order of forwards and backwards of micro-batches, plainly
    or offloaded; records which groups each backward reloaded.

    ``form``: "te" (TransformerEngine's call shape, v2), "v1" (that call shape under
    ``NVTE_CPU_OFFLOAD_V1=1``, which the test sets), "oa" (``OffloadActivations``, v2) or
    "planned" (``OffloadActivations`` following a plan, with ``budget`` if given). Each offloads
    layers 0-2 and keeps layer 3.
    """

    def __init__(self, form: Optional[str], micro_batches: int = 3, budget: Optional[int] = None) -> None:
        self.layers = make_mlp_layers(4, width=64)
        torch.manual_seed(7)
        self.batches = [torch.randn(16, 64) for _ in range(micro_batches)]
        self.engine: Any = None
        if form in ("te", "v1"):
            # v1 offloads only opted-in tensors by default; these layers mark none.
            ctx, sync = cpu_context(3, 4, **({"selection": "auto"} if form == "v1" else {}))
            self.engine = ctx.engine
            self.forward: Callable[[torch.Tensor], torch.Tensor] = lambda x: run_layers(self.layers, x, ctx, sync)
            self.stats = lambda: ctx.stats
        elif form in ("oa", "planned"):
            plan = self.plan(budget) if form == "planned" else None
            oa = offload.OffloadActivations(self.layers, plan=plan, device="cpu", min_offload_bytes=0, group_bytes=0)
            self.engine = oa.engine

            def forward(x: torch.Tensor) -> torch.Tensor:
                with oa:
                    return run_layers(self.layers, x)

            self.forward = forward
            self.stats = lambda: oa.stats
        else:
            self.forward = lambda x: run_layers(self.layers, x)
        if self.engine is not None:
            assert self.engine.schedule.name == {"te": "v2", "oa": "v2"}.get(form, form)
        self.reloads: list[tuple[int, int, int]] = []  # (running backward's micro-batch, group's step, layer)
        self.step_of: dict[int, int] = {}  # micro-batch -> its step index
        self.after_backward: dict[int, dict[str, Any]] = {}  # micro-batch -> stats right after
        self._in_backward = -1
        if self.engine is not None:
            start_reload = self.engine.start_reload

            def recording(group: Any, *args: Any, **kwargs: Any) -> None:
                if group.state.value == "offloaded":
                    self.reloads.append((self._in_backward, group.step, group.layer))
                start_reload(group, *args, **kwargs)

            self.engine.start_reload = recording

    def plan(self, budget: Optional[int]) -> offload.planner.Plan:
        """Offload layers 0-2 and keep layer 3, from a probe of one plain step."""
        x = self.batches[0]
        profile = offload.planner.profile_step(
            self.layers, lambda: train_step(self.layers, x), device="cpu", min_offload_bytes=0
        )
        return plan_for(profile, [Action.OFFLOAD] * 3 + [Action.KEEP], budget)

    def run(self, order: list[tuple[str, int]]) -> list[torch.Tensor]:
        """The order's gradients: every parameter's, then every micro-batch input's."""
        for p in self.layers.parameters():
            p.grad = None
        inputs, losses = {}, {}
        for kind, mb in order:
            if kind == "F":
                inputs[mb] = self.batches[mb].detach().requires_grad_(True)
                losses[mb] = (self.forward(inputs[mb]) ** 2).mean()
                if self.engine is not None:
                    self.step_of[mb] = self.engine.step.index
            else:
                self._in_backward = mb
                losses.pop(mb).backward()
                self._in_backward = -1
                if self.engine is not None:
                    self.after_backward[mb] = dict(self.stats())
        return [p.grad.clone() for p in self.layers.parameters()] + [inputs[mb].grad.clone() for mb in sorted(inputs)]


def plain_1f1b() -> list[torch.Tensor]:
    plain = Stage(None)
    expected = plain.run(ONE_F_ONE_B)
    assert_bitwise(expected, plain.run(ONE_F_ONE_B))  # the plain order repeats itself
    return expected


@pytest.mark.parametrize("form", ["te", "oa"])
def test_hand_written_1f1b_order_is_bitwise(form: str) -> None:
    """Each backward reloads its own micro-batch's groups; gradients equal the plain order's."""
    expected = plain_1f1b()
    stage = Stage(form)
    for _ in range(2):
        assert_bitwise(expected, stage.run(ONE_F_ONE_B))
    assert stage.stats()["offloaded_tensors"] > 0


def assert_each_backward_prefetched_its_own_groups(stage: Stage) -> None:
    """Every reload of a micro-batch's backward was of its own groups, all three offloaded ones,
    and each was started ahead of use (none reloaded on demand)."""
    for mb in range(3):
        mine = [(step, layer) for running, step, layer in stage.reloads if running == mb]
        assert mine, f"backward of micro-batch {mb} reloaded nothing"
        assert all(step == stage.step_of[mb] for step, _ in mine), (
            f"backward of micro-batch {mb} (step {stage.step_of[mb]}) reloaded groups of other "
            f"micro-batches: {mine}"
        )
        assert sorted(layer for _, layer in mine) == [0, 1, 2], f"micro-batch {mb} reloaded {mine}"
        stats = stage.after_backward[mb]
        # Its backward finished it: the stats are its own, final, and every reload was started
        # ahead of use by backward reaching the layer above (a micro-batch still in flight
        # behind the current forward was reloaded on demand before the engine knew of them).
        assert stats["step"] == stage.step_of[mb] and stats["finished"], stats
        assert stats["reloads"] == stats["groups_offloaded"] == 3, stats
        assert stats["reloads_on_demand"] == 0, (
            f"micro-batch {mb}: {stats['reloads_on_demand']} of its groups were reloaded only when "
            "backward needed them: the prefetch did not follow it"
        )


@pytest.mark.parametrize("form", ["te", "oa"])
def test_backward_of_each_micro_batch_prefetches_its_own_groups(form: str) -> None:
    stage = Stage(form)
    stage.run(ONE_F_ONE_B)
    assert_each_backward_prefetched_its_own_groups(stage)


@pytest.mark.parametrize("form", ["v1", "planned"])
def test_v1_and_planned_schedules_prefetch_each_micro_batch_in_1f1b(form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The v1 schedule (``NVTE_CPU_OFFLOAD_V1=1``, TE's call shape) and a planned schedule in
    the 1F1B order: bitwise gradients, and each backward prefetches its own micro-batch."""
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1" if form == "v1" else "0")
    expected = plain_1f1b()
    stage = Stage(form)
    for _ in range(2):
        stage.reloads.clear()
        assert_bitwise(expected, stage.run(ONE_F_ONE_B))
        assert_each_backward_prefetched_its_own_groups(stage)


def test_the_layer_budget_counts_the_other_micro_batches_in_flight() -> None:
    """Backward of mb0 while mb1's forward is half done: mb1 holds two groups on the GPU (its
    copies not yet released), more than the one layer it will keep, so mb0 prefetches nothing
    ahead and reloads each group only when backward reaches it; alone, it prefetches ahead."""
    order = [("F", 0), ("Fhalf", 1), ("B", 0), ("Frest", 1), ("B", 1)]
    layers = make_mlp_layers(4, width=64)
    torch.manual_seed(3)
    batches = [torch.randn(16, 64) for _ in range(2)]

    def run(ctx: Any, sync: Any, order: list[tuple[str, int]]) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
        for p in layers.parameters():
            p.grad = None
        engine = ctx.engine if ctx is not None else None
        reach: list[tuple[int, int]] = []  # (layer reached, groups of mb0 on the GPU then)
        if engine is not None:
            reached = engine.on_backward_reach

            def recording(step: int, layer: int) -> None:
                reached(step, layer)
                if step == first_step[0]:
                    state = engine.step_state(step)
                    reach.append((layer, sum(g.holds_gpu_memory for g in state.groups.values())))

            engine.on_backward_reach = recording
        first_step = [0]
        inputs, outs = {}, {}
        for kind, mb in order:
            if kind in ("F", "Fhalf"):
                inputs[mb] = batches[mb].detach().requires_grad_(True)
                outs[mb] = run_layers(layers[:2] if kind == "Fhalf" else layers, inputs[mb], ctx, sync)
                if engine is not None and mb == 0:
                    first_step[0] = engine.step.index
            elif kind == "Frest":
                outs[mb] = run_layers(layers[2:], outs[mb], ctx, sync)
            else:
                (outs.pop(mb) ** 2).mean().backward()
        grads = [p.grad.clone() for p in layers.parameters()] + [inputs[mb].grad.clone() for mb in sorted(inputs)]
        return grads, reach

    expected, _ = run(None, None, order)
    assert_bitwise(expected, run(None, None, order)[0])
    ctx, sync = cpu_context(3, 4)  # budget max(4 - 3, 2) = 2 layers
    got, reach = run(ctx, sync, order)
    assert_bitwise(expected, got)
    # Reaching layer 3 (kept) with mb1 holding 2 groups: 1 + 2 >= 2 + 1 -> no prefetch of group 2.
    assert reach[0] == (3, 0), f"mb0 prefetched although mb1's groups fill the budget: {reach}"
    assert all(on_gpu <= 1 for _, on_gpu in reach), reach
    alone_ctx, alone_sync = cpu_context(3, 4)
    _, alone = run(alone_ctx, alone_sync, [("F", 0), ("B", 0)])
    assert alone[0] == (3, 1), f"alone, reaching layer 3 prefetches group 2: {alone}"


def test_the_planned_budget_counts_the_copies_of_every_micro_batch_in_flight() -> None:
    """A budget that one micro-batch's whole forward fits, and D2H copies never seen to finish
    (a slow link): alone, nothing is released and backward uses the originals. In 1F1B the next
    forward holds the earlier micro-batch's copies too, so it releases them by force, oldest
    first (the budget grows only by what the plan keeps of the other micro-batch: its layer 3),
    and that micro-batch's backward prefetches them back."""
    expected = plain_1f1b()
    one = 4096 + 3 * 8192  # layer 0 saves one 4 KiB tensor, layers 1-3 two (CPU: no workspace)

    def stage() -> Stage:
        staged = Stage("planned", budget=one)
        staged.engine.transport.offload_finished = lambda group: False
        staged.engine.schedule.trace = []
        return staged

    alone = stage()
    alone.run([("F", 0), ("B", 0)])
    assert alone.after_backward[0]["reloads"] == 0, "alone, the budget should fit the whole forward"
    assert max(held for _, _, held, _ in alone.engine.schedule.trace) == one
    pipelined = stage()
    assert_bitwise(expected, pipelined.run(ONE_F_ONE_B))
    for mb in (0, 1):  # a later forward ran while each was in flight; not after micro-batch 2
        stats = pipelined.after_backward[mb]
        mine = sorted(layer for running, step, layer in pipelined.reloads
                      if running == mb and step == pipelined.step_of[mb])
        assert mine == [0, 1, 2] and stats["reloads"] == 3, (
            f"micro-batch {mb}: reloads {pipelined.reloads}, stats {stats}: the next forward did not "
            "release its copies, although both micro-batches' activations were over the budget"
        )
        assert stats["reloads_on_demand"] == 0, stats
    kept = 8192  # layer 3 of the other micro-batch in flight
    seen = max(held for _, _, held, _ in pipelined.engine.schedule.trace)
    assert one < seen <= one + kept, f"the schedule's figure of both micro-batches' bytes: {seen}"


@pytest.mark.parametrize("form", ["te", "oa"])
def test_host_blocks_of_one_pipeline_iteration_serve_the_next(form: str) -> None:
    stage = Stage(form)
    stage.run(ONE_F_ONE_B)
    arena = stage.engine.arena
    allocated, held = arena.counters.pinned_allocations, arena.counters.bytes_held
    for _ in range(3):
        stage.run(ONE_F_ONE_B)
    assert arena.counters.pinned_allocations == allocated, (
        f"later iterations allocated {arena.counters.pinned_allocations - allocated} more host "
        "blocks: the blocks of micro-batches finished earlier in an iteration were trimmed"
    )
    assert arena.counters.bytes_held == held
