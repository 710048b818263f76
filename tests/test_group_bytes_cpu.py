"""``group_bytes`` (v2): small layers share one group, copied once each way; on CPU (host transport).

The rule: a layer whose group holds fewer than ``group_bytes`` offloaded bytes when it ends stays
open for the next offloaded layer, up to the last offloaded layer, whose group is always closed.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

import offload
from offload.models import run_layers

from _util import assert_bitwise, cpu_context, make_gpt_layers, make_mlp_layers, train_step


def layer_bytes(layers: torch.nn.ModuleList, x: torch.Tensor, k: int) -> list[int]:
    """What each offloaded layer saves into its group (every layer a group, forward only)."""
    ctx, sync = cpu_context(k, len(layers), group_bytes=0)
    out = run_layers(layers, x.detach().requires_grad_(True), ctx, sync)
    groups = ctx.engine.step.groups
    sizes = [groups[layer].saved_bytes for layer in range(k)]
    del out
    return sizes


def expected_groups(sizes: list[int], group_bytes: int) -> list[tuple[int, int]]:
    """(first layer, last layer) of each group the rule makes from per-layer sizes."""
    out, first, held = [], 0, 0
    for layer, n in enumerate(sizes):
        held += n
        if held >= group_bytes or layer == len(sizes) - 1:
            out.append((first, layer))
            first, held = layer + 1, 0
    return out


def forward_groups(ctx: Any) -> list[tuple[int, int]]:
    return [(g.layer, g.top) for g in ctx.engine.step.groups.values()]


@pytest.mark.parametrize("n, k", [(8, 7), (6, 3), (5, 4)])
@pytest.mark.parametrize("factor", [0, 1.5, 2.5, 100])
def test_groups_follow_the_rule_and_gradients_stay_bitwise(n: int, k: int, factor: float) -> None:
    layers = make_gpt_layers(n)
    x = torch.randn(2, 16, 64)
    expected = train_step(layers, x)
    assert_bitwise(expected, train_step(layers, x))
    sizes = layer_bytes(layers, x, k)
    group_bytes = int(factor * max(sizes))
    alone, alone_sync = cpu_context(k, n, group_bytes=0)
    train_step(layers, x, alone, alone_sync)
    moved = alone.stats["offloaded_bytes"]
    ctx, sync = cpu_context(k, n, group_bytes=group_bytes)
    log: list[tuple[int, int]] = []
    offload_group = ctx.engine.start_offload

    def logged(group):
        log.append((group.layer, group.top))
        return offload_group(group)

    ctx.engine.start_offload = logged
    for _ in range(2):  # the second step reuses the first one's host blocks
        log.clear()
        assert_bitwise(expected, train_step(layers, x, ctx, sync))
        want = expected_groups(sizes, group_bytes) if group_bytes else [(i, i) for i in range(k)]
        assert log == want
        stats = ctx.stats
        assert stats["groups_offloaded"] == len(want) == stats["reloads"]
        assert stats["offloaded_bytes"] == moved
        assert stats["reloads_on_demand"] == 0


def test_one_copy_each_way_for_all_small_layers_and_every_layer_reaches_it() -> None:
    layers = make_mlp_layers(8)
    x = torch.randn(8, 64)
    expected = train_step(layers, x)
    ctx, sync = cpu_context(7, 8, group_bytes=1 << 30)
    engine = ctx.engine
    out = run_layers(layers, x.detach().requires_grad_(True), ctx, sync)
    groups = engine.step.groups
    shared = groups[0]
    # Found under each of its layers, listed once, and off the GPU after the forward.
    assert all(groups[layer] is shared for layer in range(7)) and groups.values() == [shared]
    assert (shared.layer, shared.top) == (0, 6) and shared.state.value == "offloaded"
    assert groups.holding_gpu_memory() == 0
    del out, shared, groups
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    assert ctx.stats["groups_offloaded"] == 1 and ctx.stats["reloads"] == 1


def test_offload_activations_with_layers_takes_group_bytes() -> None:
    layers = make_mlp_layers(6)
    x = torch.randn(8, 64, requires_grad=True)

    def grads(context: Any) -> list[torch.Tensor]:
        with context:
            y = x
            for layer in layers:
                y = layer(y)
        y.square().mean().backward()
        out = [p.grad.clone() for p in layers.parameters()] + [x.grad.clone()]
        for p in [*layers.parameters(), x]:
            p.grad = None
        return out

    expected = grads(torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t))
    ctx = offload.OffloadActivations(layers, num_offload_layers=5, group_bytes=1 << 30, device="cpu", min_offload_bytes=0)
    assert_bitwise(expected, grads(ctx))
    assert ctx.stats["groups_offloaded"] == 1 and ctx.stats["offloaded_tensors"] > 5


def test_a_forward_failing_inside_a_shared_group_leaks_nothing() -> None:
    layers = make_mlp_layers(6)
    x = torch.randn(8, 64)
    expected = train_step(layers, x)
    ctx, sync = cpu_context(5, 6, group_bytes=1 << 30)
    engine = ctx.engine

    class Boom(Exception):
        pass

    y = x.detach().requires_grad_(True)
    with pytest.raises(Boom):
        for i, layer in enumerate(layers):
            with ctx:
                y = layer(y)
                if i == 3:
                    raise Boom  # layers 0..3 share the open group
            y = sync(y)
    del y
    gc.collect()
    assert engine.arena.claimed == 0 and engine.arena.counters.bytes_in_use == 0
    assert engine.forward.pending_group is None and engine.forward.open_group is None
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    assert ctx.stats["groups_offloaded"] == 1


def test_backward_before_the_last_layer_keeps_the_open_shared_group_exactly() -> None:
    # Fewer layer contexts than model_layers: backward ends the forward with a shared group still
    # open (waiting for its next layer); it is kept on the GPU and handed back as it was.
    layers = make_mlp_layers(4)
    x = torch.randn(8, 64)
    expected = train_step(layers, x)
    ctx, sync = cpu_context(5, 6, group_bytes=1 << 30)
    with pytest.warns(UserWarning, match="backward began after 4 layer contexts"):
        assert_bitwise(expected, train_step(layers, x, ctx, sync))
    stats = ctx.stats
    assert stats["groups_offloaded"] == 0 and stats["kept"]


def test_micro_batches_in_flight_with_shared_groups() -> None:
    # Two forwards, then their backwards (a pipeline stage's 1F1B start): each micro-batch's
    # shared group is its own and comes back exactly.
    layers = make_mlp_layers(6)
    xs = [torch.randn(8, 64, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    expected = [train_step(layers, x) for x in xs]
    ctx, sync = cpu_context(5, 6, group_bytes=4096 * 3)
    inputs = [x.detach().requires_grad_(True) for x in xs]
    outs = [run_layers(layers, x, ctx, sync) for x in inputs]
    for x, out, want in zip(inputs, outs, expected):
        for p in layers.parameters():
            p.grad = None
        (out.float() ** 2).mean().backward()
        assert_bitwise(want, [p.grad.clone() for p in layers.parameters()] + [x.grad.clone()])


@pytest.mark.parametrize("kw, match", [
    ({"group_bytes": -1}, "group_bytes must be a number of bytes from 0 "),
    ({"group_bytes": 1.5}, "group_bytes .* got 1.5: not a whole number of bytes"),
    ({"group_bytes": True}, r"group_bytes must be a number of bytes .* got True \(bool\)"),
    ({"group_bytes": 4096, "mode": "v1"}, "this context runs the v1 schedule"),
    ({"group_bytes": 4096, "manual_synchronization": True}, "manual_synchronization=True"),
])
def test_bad_group_bytes_are_refused_with_the_reason(kw: dict, match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        offload.get_cpu_offload_context(True, num_layers=3, model_layers=4, device="cpu", **kw)


def test_group_bytes_with_a_plan_or_budget_is_refused() -> None:
    layers = make_mlp_layers(4)
    with pytest.raises(ValueError, match="group_bytes with layers"):
        offload.OffloadActivations(layers, group_bytes=4096, memory_budget_bytes=1 << 30, device="cpu")


def test_the_default_is_one_size_in_v2_and_off_where_layers_do_not_share() -> None:
    from offload.engine.schedules import DEFAULT_GROUP_BYTES

    assert DEFAULT_GROUP_BYTES == 32 << 20
    ctx, _ = offload.get_cpu_offload_context(True, num_layers=3, model_layers=4, device="cpu")
    assert ctx.engine.schedule.group_bytes == DEFAULT_GROUP_BYTES
    off, _ = offload.get_cpu_offload_context(True, num_layers=3, model_layers=4, device="cpu", group_bytes=0)
    assert off.engine.schedule.group_bytes == 0
    # v1 and manual mode take the default without complaint: their layers never share.
    for kw in ({"mode": "v1"}, {"manual_synchronization": True}):
        other = offload.get_cpu_offload_context(True, num_layers=3, model_layers=4, device="cpu", **kw)[0]
        assert not hasattr(other.engine.schedule, "group_bytes") or other.engine.schedule.group_bytes == 0
    layers = make_mlp_layers(4)
    fixed = offload.OffloadActivations(layers, num_offload_layers=3, device="cpu")
    assert fixed.engine.schedule.group_bytes == DEFAULT_GROUP_BYTES
    offload.OffloadActivations(layers, memory_budget_bytes=1 << 30, device="cpu")  # planned: no refusal


def test_by_default_small_layers_share_one_copy_and_gradients_stay_bitwise() -> None:
    layers = make_mlp_layers(8)
    x = torch.randn(8, 64)
    expected = train_step(layers, x)
    ctx, sync = cpu_context(7, 8, group_bytes=None)  # None: the engine's default
    for _ in range(2):
        assert_bitwise(expected, train_step(layers, x, ctx, sync))
        stats = ctx.stats
        assert stats["groups_offloaded"] == 1 == stats["reloads"] and stats["reloads_on_demand"] == 0


@pytest.mark.parametrize("per_group", [0, 2.5, None])
def test_only_a_shared_groups_top_layer_carries_a_backward_marker(per_group: Any) -> None:
    # The marker of a group's top layer reloads all of it and prefetches below its first layer,
    # so the inner layers get none; the non-offloaded last layer keeps its own.
    layers = make_mlp_layers(8)
    x = torch.randn(8, 64)
    expected = train_step(layers, x)
    sizes = layer_bytes(layers, x, 7)
    if per_group is None:  # the default: all seven small layers in one group
        kw, tops = {"group_bytes": None}, [6]
    else:  # per_group times the largest layer's bytes (0: every layer a group)
        group_bytes = int(per_group * max(sizes))
        kw = {"group_bytes": group_bytes}
        tops = [top for _, top in expected_groups(sizes, group_bytes)] if group_bytes else list(range(7))
    assert len(tops) == {0: 7, 2.5: 3, None: 1}[per_group]
    ctx, sync = cpu_context(7, 8, **kw)
    engine = ctx.engine
    reached: list[int] = []
    reach = engine.on_backward_reach

    def logged(step: int, layer: int) -> None:
        reached.append(layer)
        reach(step, layer)

    engine.on_backward_reach = logged
    reloads: list[tuple[int, int]] = []  # (the group's top layer, the layer backward had reached)
    start_reload = engine.start_reload

    def logged_reload(group: Any, into: Any = None) -> None:
        reloads.append((group.top, reached[-1]))
        start_reload(group, into)

    engine.start_reload = logged_reload
    for _ in range(2):
        reached.clear()
        reloads.clear()
        assert_bitwise(expected, train_step(layers, x, ctx, sync))
        assert reached == [7] + tops[::-1]
        assert ctx.stats["reloads_on_demand"] == 0
        # Every group came back ahead of its layers: prefetched while backward was still above
        # its top layer (the group below a shared one is found below that one's first layer).
        assert sorted(top for top, _ in reloads) == sorted(tops)
        assert all(at > top for top, at in reloads), reloads


def test_the_arenas_forecast_counts_shared_groups_not_layers() -> None:
    # The arena pins this many blocks ahead on its first miss: one per layer would pin in vain
    # for layers that share groups.
    from offload.engine.group import Group
    from offload.engine.schedules import Schedule, ScheduleV2

    def group(first: int, top: int, nbytes: int) -> Group:
        g = Group(first, step=1)
        g.top, g.nbytes = top, nbytes
        return g

    shared = ScheduleV2(15, 16, group_bytes=4 << 20)
    # Layers 0..3 of 1 MiB each: the 11 offloaded layers after it make two full groups of 4
    # layers, and the last one of 3, too small for a block of this group's size (not forecast).
    assert shared.groups_after(group(0, 3, 4 << 20)) == 2
    assert shared.groups_after(group(0, 1, 2 << 20)) == 3  # 13 after it: 3 groups of 4, and 1 layer
    assert shared.groups_after(group(0, 13, 14 << 20)) == 0  # the last offloaded layer alone
    assert shared.groups_after(group(0, 14, 15 << 20)) == 0
    # Layers as large as group_bytes, or sharing off: one group per later offloaded layer.
    assert shared.groups_after(group(2, 2, 8 << 20)) == 12
    assert ScheduleV2(15, 16, group_bytes=0).groups_after(group(0, 0, 1 << 20)) == 14
    assert Schedule(15, 16).groups_after(group(4, 4, 1 << 20)) == 10


def test_layers_joining_a_shared_group_do_not_reach_the_schedule() -> None:
    # Nothing changes for the schedule between a layer whose group joins the next and that next
    # layer: it hears of the group's first layer starting and of its top layer ending only.
    layers = make_mlp_layers(8)
    x = torch.randn(8, 64)
    expected = train_step(layers, x)
    sizes = layer_bytes(layers, x, 7)
    group_bytes = int(2.5 * max(sizes))
    groups = expected_groups(sizes, group_bytes)
    ctx, sync = cpu_context(7, 8, group_bytes=group_bytes)
    schedule = ctx.engine.schedule
    started: list[int] = []
    ended: list[int] = []
    on_start, on_end = schedule.on_layer_start, schedule.on_layer_end
    schedule.on_layer_start = lambda engine, layer: (started.append(layer), on_start(engine, layer))[1]
    schedule.on_layer_end = lambda engine, layer, group: (ended.append(layer), on_end(engine, layer, group))[1]
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    assert started == [first for first, _ in groups] + [7]
    assert ended == [top for _, top in groups] + [7]


def test_layers_share_groups_under_capture_as_they_do_eagerly() -> None:
    # A captured step must make the groups its eager warm-up made: it finds their host blocks.
    from offload.engine.group import Group
    from offload.engine.schedules import ScheduleV2

    schedule = ScheduleV2(7, 8, group_bytes=1 << 20)
    eager, captured = Group(0, step=1), Group(0, step=1)
    captured.captured = True
    assert schedule.joins_next(eager, 0) and schedule.joins_next(captured, 0)
    assert not schedule.joins_next(captured, 6)  # the last offloaded layer always closes its group
