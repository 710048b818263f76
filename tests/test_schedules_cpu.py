"""Schedules on CPU: v2 and v1 timing, state transitions, selection, env switch, manual control."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import offload
from offload.engine.group import HOLDS_ORIGINALS
from offload.models import run_layers
from offload.engine.schedules.v1 import window_layers

from _util import assert_bitwise, cpu_context, make_gpt_layers, make_mlp_layers, train_step


def record(ctx: Any) -> list[tuple]:
    """Log (action, group layer, layer running, phase) for every schedule primitive."""
    engine = ctx.engine
    log: list[tuple] = []

    def wrap(name: str) -> None:
        original = getattr(engine, name)

        def logged(group, *args, **kwargs):
            phase = "bwd" if engine.step.forward_done else "fwd"
            log.append((name, group.layer, engine.forward.layer, phase))
            return original(group, *args, **kwargs)

        setattr(engine, name, logged)

    for name in ("start_offload", "release", "start_reload"):
        wrap(name)
    misses = engine.schedule.on_unpack_miss

    def miss(eng, group):
        log.append(("miss", group.layer, None, "bwd"))
        return misses(eng, group)

    engine.schedule.on_unpack_miss = miss
    reach = engine.on_backward_reach

    def reached(step, layer):
        log.append(("reach", None, layer, "bwd"))
        return reach(step, layer)

    engine.on_backward_reach = reached
    return log


def effective(log: list[tuple]) -> list[tuple]:
    return [(a, g, cur, ph) for a, g, cur, ph in log]


# -- v2 -----------------------------------------------------------------------------------------------
def test_v2_all_but_last_keeps_one_copy_in_flight() -> None:
    # k = N - 1: the budget is 2 layers (one computing, one finishing its copy), so layer L's
    # group is released when layer L + 2 starts, and the last one at the end of forward.
    layers = make_mlp_layers(4)
    x = torch.randn(8, 64)
    ctx, sync = cpu_context(3, 4)
    assert ctx.engine.schedule.budget == 2
    log = record(ctx)
    train_step(layers, x, ctx, sync)
    assert [(a, g, cur) for a, g, cur, _ in log if a in ("start_offload", "release")] == [
        ("start_offload", 0, 0),
        ("start_offload", 1, 1),
        ("release", 0, 2),
        ("start_offload", 2, 2),
        ("release", 1, 3),
        ("release", 2, 3),  # end of forward: every offloaded group leaves the GPU
    ]
    # Markers prefetch one layer ahead (the budget's second layer); nothing reloads on demand.
    assert [g for a, g, _, _ in log if a in ("start_reload", "miss")] == [2, 1, 0]


def test_v2_delays_release_as_long_as_the_resident_limit_allows() -> None:
    layers = make_mlp_layers(8)
    x = torch.randn(8, 64)
    ctx, sync = cpu_context(2, 8)
    engine = ctx.engine
    resident_seen = []
    original = engine.schedule.on_layer_start

    def check(eng, layer):
        original(eng, layer)
        holding = sum(1 for g in eng.step.groups.values() if g.state in HOLDS_ORIGINALS)
        non_offloaded_started = max(0, layer - 2 + 1)
        resident_seen.append(holding + non_offloaded_started + (1 if layer < 2 else 0))

    engine.schedule.on_layer_start = check
    log = record(ctx)
    train_step(layers, x, ctx, sync)
    releases = [(g, cur) for a, g, cur, ph in log if a == "release"]
    # At layer 6, five non-offloaded layers are resident, so one offloaded group may stay.
    assert releases == [(0, 6), (1, 7)]
    assert max(resident_seen) <= 8 - 2
    # Backward prefetches two layers ahead: group 1 when layer 3 is reached, group 0 at layer 2.
    backward = [(a, g if a != "reach" else cur) for a, g, cur, ph in log if a in ("reach", "start_reload", "miss")]
    assert backward == [("reach", 7), ("reach", 6), ("reach", 5), ("reach", 4), ("reach", 3), ("start_reload", 1),
                        ("reach", 2), ("start_reload", 0), ("reach", 1), ("reach", 0)]


@pytest.mark.parametrize("n, k", [(4, 1), (4, 3), (6, 2), (6, 5), (8, 4)])
def test_v2_resident_bound_and_exactness(n: int, k: int) -> None:
    layers = make_mlp_layers(n)
    x = torch.randn(8, 64)
    expected = train_step(layers, x)
    ctx, sync = cpu_context(k, n)
    log = record(ctx)
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    assert sum(1 for e in log if e[0] == "miss") == 0
    assert sorted(g for a, g, _, _ in log if a == "start_reload") == list(range(k))


def test_v2_forward_touches_only_the_groups_in_flight(monkeypatch) -> None:
    # A layer start looks at the groups whose D2H is in flight (a queue kept as they go), not
    # at every group of the step: that scan grew with the model's depth at every layer. The
    # releases are the same as the budget says (test above), and gradients stay exact.
    from offload.engine.step import StepGroups

    layers = make_mlp_layers(12)
    x = torch.randn(8, 64)
    expected = train_step(layers, x)
    ctx, sync = cpu_context(11, 12)
    engine = ctx.engine
    scans = []
    values = StepGroups.values

    def counted(self):
        scans.append(engine.step.forward_done)
        return values(self)

    monkeypatch.setattr(StepGroups, "values", counted)
    log = record(ctx)
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    assert not [done for done in scans if not done], "a forward layer boundary scanned the step's groups"
    releases = [(g, cur) for a, g, cur, ph in log if a == "release"]
    assert releases == [(g, g + 2) for g in range(9)] + [(9, 11), (10, 11)]


def test_v2_queue_of_copies_in_flight_holds_groups_weakly() -> None:
    # The schedule's queue must not keep a group alive: a forward whose graph is dropped has
    # to free its groups (and their host regions) right away.
    import gc
    import weakref

    layers = make_mlp_layers(6)
    x = torch.randn(8, 64, requires_grad=True)
    ctx, sync = cpu_context(5, 6)
    y = x
    for i, layer in enumerate(layers[:3]):
        with ctx:
            y = layer(y)
        y = sync(y)
    queued = [ref() for ref in ctx.engine.schedule._offloading]
    assert queued and all(g is not None for g in queued)
    refs = [weakref.ref(g) for g in queued]
    del queued, y
    gc.disable()  # freed by reference counting, not by a cycle collection
    try:
        assert [r() for r in refs] == [None] * len(refs)
    finally:
        gc.enable()
    assert ctx.engine.arena.counters.bytes_in_use == 0


def test_step_groups_count_what_holds_gpu_memory_as_the_group_says() -> None:
    # StepGroups.holding_gpu_memory counts by Group.holds_gpu_memory, for every state and both
    # consumed flags, with and without a top layer.
    from offload.engine.group import Group, GroupState
    from offload.engine.step import StepGroups

    groups, kept = StepGroups(), []
    layer = 0
    for state in GroupState:
        for consumed in (False, True):
            g = Group(layer, 1)
            g.state, g.consumed = state, consumed
            groups[layer] = g
            kept.append(g)
            layer += 1
    for top in (None, 0, 3, 6, layer):
        expect = sum(1 for g in kept if (top is None or g.layer <= top) and g.holds_gpu_memory)
        assert groups.holding_gpu_memory(top) == expect
    assert groups.holding_gpu_memory() == sum(1 for g in kept if g.holds_gpu_memory) > 0
    # A group that several small layers share (group_bytes) is found under each, counted once.
    shared = Group(layer, 1)
    shared.top = layer + 2
    for member in range(layer, layer + 3):
        groups[member] = shared
    assert all(groups.get(member) is shared for member in range(layer, layer + 3))
    assert groups.values().count(shared) == 1
    assert groups.holding_gpu_memory() == sum(1 for g in kept if g.holds_gpu_memory) + 1


def test_without_markers_reloads_happen_on_demand_and_stay_exact() -> None:
    layers = make_mlp_layers(4)
    x = torch.randn(8, 64)
    expected = train_step(layers, x)
    ctx, _ = cpu_context(3, 4)
    log = record(ctx)
    assert_bitwise(expected, train_step(layers, x, ctx, None))
    # The first unpack of layer 2 misses and prefetches layer 1 (budget 2); layer 0 misses again.
    assert [(a, g) for a, g, _, _ in log if a in ("miss", "start_reload")] == [
        ("miss", 2), ("start_reload", 2), ("start_reload", 1), ("miss", 0), ("start_reload", 0)
    ]


# -- v1 -----------------------------------------------------------------------------------------------
def test_window_layers_spread_evenly() -> None:
    assert window_layers(2, 4) == [1, 3]
    assert window_layers(2, 8) == [3, 7]
    assert window_layers(3, 9) == [2, 5, 8]
    assert window_layers(7, 8) == [0, 1, 2, 3, 4, 5, 7]
    for k in range(1, 12):
        w = window_layers(k, 12)
        assert all(w[i] >= i for i in range(k)) and w == sorted(set(w)) and w[-1] == 11


def test_v1_one_group_in_flight_released_at_its_window() -> None:
    layers = make_mlp_layers(4)
    x = torch.randn(8, 64)
    expected = train_step(layers, x)
    ctx, sync = cpu_context(2, 4, mode="v1", selection="auto")
    log = record(ctx)
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    fwd = [(a, g, cur) for a, g, cur, ph in log if ph == "fwd"]
    assert fwd == [("start_offload", 0, 0), ("release", 0, 1), ("start_offload", 1, 1), ("release", 1, 3)]
    assert [(a, g if a != "reach" else cur) for a, g, cur, ph in log if ph == "bwd"] == [
        ("reach", 3), ("start_reload", 1), ("reach", 2), ("reach", 1), ("start_reload", 0), ("reach", 0)
    ]
    assert ctx.stats["mode"] == "v1"


@pytest.mark.parametrize("mode", ["v1", "v2"])
def test_same_model_bitwise_in_both_modes(mode: str) -> None:
    layers = make_mlp_layers(6)
    x = torch.randn(8, 64)
    expected = train_step(layers, x)
    ctx, sync = cpu_context(4, 6, mode=mode, selection="auto")
    for _ in range(2):
        assert_bitwise(expected, train_step(layers, x, ctx, sync))
    assert ctx.stats["offloaded_tensors"] > 0


def test_v1_offloads_only_opted_in_tensors_by_default() -> None:
    layers = make_mlp_layers(4)
    x = torch.randn(8, 64)
    ctx, sync = cpu_context(2, 4, mode="v1")
    train_step(layers, x, ctx, sync)
    stats = ctx.stats
    assert stats["offloaded_tensors"] == 0
    assert stats["kept"]["not_selected"] > 0
    ctx, sync = cpu_context(2, 4, mode="v1", selection="auto")
    train_step(layers, x, ctx, sync)
    assert ctx.stats["offloaded_tensors"] > 0


class SaveMarked(torch.autograd.Function):
    """Saves one kept tensor (do-not-offload, optionally also opted in) and one opted-in tensor,
    and checks in backward that the kept one is the very same memory."""

    seen: list = []

    @staticmethod
    def forward(ctx, x, both: bool):
        keep = x * 2.0
        offloaded = x * 3.0
        offload.mark_activation_offload(offloaded)
        if both:
            offload.mark_activation_offload(keep)
        offload.mark_not_offload(keep)
        ctx.keep_ptr = keep.data_ptr()
        ctx.save_for_backward(keep, offloaded)
        return x + 1.0

    @staticmethod
    def backward(ctx, g):
        keep, offloaded = ctx.saved_tensors
        SaveMarked.seen.append((keep.data_ptr() == ctx.keep_ptr, offloaded.data_ptr()))
        return g * keep * offloaded, None


class MarkedLayer(torch.nn.Module):
    def __init__(self, both: bool) -> None:
        super().__init__()
        self.both = both

    def forward(self, x):
        return SaveMarked.apply(x, self.both)


@pytest.mark.parametrize("mode", ["v1", "v2"])
@pytest.mark.parametrize("both", [False, True])
def test_mark_not_offload_holds_in_both_modes(mode: str, both: bool) -> None:
    layers = torch.nn.ModuleList(MarkedLayer(both) for _ in range(3))
    x = torch.randn(4096)
    SaveMarked.seen = []
    expected = train_step(layers, x)
    SaveMarked.seen = []
    ctx, sync = cpu_context(2, 3, mode=mode)
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    assert len(SaveMarked.seen) == 3 and all(same for same, _ in SaveMarked.seen)
    stats = ctx.stats
    assert stats["kept"]["marked"] == 2
    assert stats["offloaded_tensors"] == 2  # the opted-in tensor of each offloaded layer


# -- v1 double buffering --------------------------------------------------------------------------------
class Scale(torch.nn.Module):
    """Saves nothing: makes the next layer's input a non-leaf, so every MLP group is alike."""

    def forward(self, x):
        return x * 1.0


def test_v1_double_buffering_exact_and_reuses_two_buffers() -> None:
    layers = torch.nn.ModuleList([Scale(), *make_mlp_layers(6)])
    x = torch.randn(8, 64)
    expected = train_step(layers, x)
    ctx, sync = cpu_context(5, 7, mode="v1", selection="auto", double_buffering=True)
    for _ in range(2):
        assert_bitwise(expected, train_step(layers, x, ctx, sync))
    buffers = ctx.engine.schedule._buffers
    assert all(b is not None for b in buffers) and buffers[0].data_ptr() != buffers[1].data_ptr()


@pytest.mark.parametrize("model_layers, num_layers", [(8, 4), (9, 3), (12, 3), (12, 4)])
def test_v1_double_buffer_is_reused_only_after_its_last_reader_ran(model_layers: int, num_layers: int) -> None:
    # A group is consumed when its last tensor is unpacked, before the node that asked for it
    # runs; a deferred reload into the same buffer at that moment overwrote what the node read.
    layers = make_gpt_layers(model_layers, hidden=32, heads=2)
    x = torch.randn(2, 8, 32)
    expected = train_step(layers, x, scale_input=True)
    assert_bitwise(expected, train_step(layers, x, scale_input=True))
    ctx, sync = cpu_context(num_layers, model_layers, mode="v1", selection="auto", double_buffering=True)
    log = record(ctx)
    for _ in range(2):
        log.clear()
        assert_bitwise(expected, train_step(layers, x, ctx, sync, scale_input=True))
        assert sorted(g for a, g, _, _ in log if a == "start_reload") == list(range(num_layers))
    buffers = ctx.engine.schedule._buffers
    assert all(b is not None for b in buffers)


def test_v1_double_buffering_with_create_graph_keeps_the_views_it_gave_out() -> None:
    # With create_graph=True the first backward saves the restored views for the second one; a
    # persistent buffer reused under them would change what the double backward reads.
    layers = make_mlp_layers(4)
    x = torch.randn(8, 64)

    def penalty_step(ctx=None, sync=None) -> list[torch.Tensor]:
        params = list(layers.parameters())
        for p in params:
            p.grad = None
        xin = x.detach().requires_grad_(True)
        loss = (run_layers(layers, xin * 1.0, ctx, sync) ** 2).mean()
        grads = torch.autograd.grad(loss, params + [xin], create_graph=True)
        sum((g ** 2).sum() for g in grads).backward()
        return [g.detach() for g in grads] + [p.grad for p in params] + [xin.grad]

    expected = penalty_step()
    assert_bitwise(expected, penalty_step())
    ctx, sync = cpu_context(3, 4, mode="v1", selection="auto", double_buffering=True)
    for _ in range(2):
        assert_bitwise(expected, penalty_step(ctx, sync))
    assert ctx.stats["reloads"] >= 3


class SaveSized(torch.nn.Module):
    def __init__(self, copies: int) -> None:
        super().__init__()
        self.copies = copies

    def forward(self, x):
        return x * 1.5 + x.repeat(self.copies).sin().sum() * 0


def test_v1_double_buffering_refuses_unequal_groups() -> None:
    layers = torch.nn.ModuleList(SaveSized(c) for c in (1, 2, 1))
    ctx, sync = cpu_context(2, 3, mode="v1", selection="auto", double_buffering=True)
    x = torch.randn(1024, requires_grad=True)
    with pytest.raises(ValueError, match=r"differ in size \(layer 0: \d+ bytes, layer 1: \d+ bytes\)"):
        run_layers(layers, x, ctx, sync)


# -- mode switch -------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["1", "true", "TRUE", "Yes", " yes "])
def test_env_selects_v1(monkeypatch, value: str) -> None:
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", value)
    assert offload.resolve_mode(None) == "v1"
    ctx, _ = cpu_context(1, 2)
    assert ctx.stats["mode"] == "v1"


@pytest.mark.parametrize("value", ["0", "false", "False", "no", "NO", ""])
def test_env_selects_v2(monkeypatch, value: str) -> None:
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", value)
    assert offload.resolve_mode(None) == "v2"


def test_unset_env_means_v2(monkeypatch) -> None:
    monkeypatch.delenv("NVTE_CPU_OFFLOAD_V1", raising=False)
    assert offload.resolve_mode(None) == "v2"


@pytest.mark.parametrize("value", ["2", "on", "maybe", "v1", "ye s"])
def test_env_rejects_other_values(monkeypatch, value: str) -> None:
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", value)
    with pytest.raises(ValueError, match="NVTE_CPU_OFFLOAD_V1=.*1, true or yes.*0, false, no or empty"):
        offload.resolve_mode(None)


def test_explicit_mode_wins_over_env(monkeypatch) -> None:
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    assert offload.resolve_mode("v2") == "v2"
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "garbage")
    assert offload.resolve_mode("v1") == "v1"


# -- manual synchronization ------------------------------------------------------------------------------
def test_manual_controller() -> None:
    layers = make_mlp_layers(3)
    x = torch.randn(8, 64)
    expected = train_step(layers, x)
    ctx, sync, control = cpu_context(2, 3, manual_synchronization=True)
    for p in layers.parameters():
        p.grad = None
    xin = x.clone().requires_grad_(True)
    h = xin
    for i, layer in enumerate(layers):
        with ctx:
            h = layer(h)
        if i < 2:
            with pytest.raises(ValueError, match="not offloaded yet"):
                control.release_activation_forward_gpu_memory(i)
            control.start_offload_layer(i)
            control.release_activation_forward_gpu_memory(i)
    with pytest.raises(ValueError, match="cannot reload layer 2"):
        control.start_reload_layer(2)
    control.start_reload_layer(1)
    (h.float() ** 2).mean().backward()  # layer 0 is reloaded on demand
    assert_bitwise(expected, [p.grad for p in layers.parameters()] + [xin.grad])
    assert ctx.stats["reloads"] == 2 and ctx.stats["mode"] == "v2 (manual)"
