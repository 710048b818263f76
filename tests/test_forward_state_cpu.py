"""The step state object (offload.engine.forward.ForwardState): named states, one transition per
event, each checked; and the engine moving through them in both call shapes."""

from __future__ import annotations

import pytest
import torch

import offload
from offload.engine.forward import ForwardState, LifecycleError, Phase
from offload.engine.group import Group
from offload.engine.stats import StepCounters
from offload.engine.step import StepState


def _step(index: int = 1) -> StepState:
    return StepState(index=index, counters=StepCounters(step=index, mode="v2"))


def test_a_step_goes_idle_between_in_layer_and_back() -> None:
    state = ForwardState()
    assert state.phase is Phase.IDLE and not state.forward_open()
    step = _step()
    state.start_step(step, thread=1)
    assert state.phase is Phase.BETWEEN and state.forward_open() and state.step_index == 1
    step.layers_started += 1
    group = Group(0, 1)
    state.enter_layer(0, group, hooks=True)
    assert state.in_layer and state.open_group is group and state.layer == 0
    assert state.exit_layer() is group
    assert state.phase is Phase.BETWEEN and state.open_group is None and state.last_closed == 0
    assert state.end_forward() is None and state.phase is Phase.IDLE and state.step is step


def test_wrong_transitions_raise_naming_the_state() -> None:
    state = ForwardState()
    with pytest.raises(LifecycleError, match="cannot enter layer 0 idle"):
        state.enter_layer(0, None, hooks=False)
    with pytest.raises(LifecycleError, match="cannot exit a layer idle"):
        state.exit_layer()
    state.start_step(_step(), thread=1)
    with pytest.raises(LifecycleError, match="cannot start a step between layers"):
        state.start_step(_step(2), thread=1)
    state.step.layers_started += 1  # type: ignore[union-attr]
    state.enter_layer(0, None, hooks=False)
    with pytest.raises(LifecycleError, match="cannot enter layer 1 in a layer"):
        state.enter_layer(1, None, hooks=False)
    with pytest.raises(LifecycleError, match="cannot let go of the step in a layer"):
        state.let_go()


def test_invariants_are_checked_at_each_transition() -> None:
    state = ForwardState()
    state.start_step(_step(), thread=1)
    # The open group must be the layer's own.
    with pytest.raises(LifecycleError, match="open group is layer 3's, in layer 0"):
        state.enter_layer(0, Group(3, 1), hooks=False)
    state = ForwardState()
    step = _step()
    state.start_step(step, thread=1)
    # A pending group is the next layer's (layers_started), nothing else.
    with pytest.raises(LifecycleError, match="pending group is not the next layer's"):
        state.open_pending(Group(5, 1))
    state = ForwardState()
    state.start_step(_step(), thread=1)
    state.open_pending(Group(0, 1))
    with pytest.raises(LifecycleError, match="pending group taken"):
        state.enter_layer(0, None, hooks=False)  # the caller must take it first


def test_abort_forgets_everything_from_any_state() -> None:
    state = ForwardState()
    step = _step()
    state.start_step(step, thread=1)
    step.layers_started += 1
    state.enter_layer(0, Group(0, 1), hooks=True)
    state.passive_depth = 2
    assert state.abort() is step
    assert state.phase is Phase.IDLE and state.step is None and state.open_group is None
    assert state.passive_depth == 0 and not state.layer_hooks and state.abort() is None


def _layers(n: int = 3) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()) for _ in range(n))


def test_te_call_shape_walks_the_states() -> None:
    layers = _layers()
    ctx, sync = offload.get_cpu_offload_context(enabled=True, num_layers=2, model_layers=3, min_offload_bytes=0, group_bytes=0)
    state = ctx.engine.forward
    seen = []
    h = torch.randn(4, 16, requires_grad=True)
    for layer in layers:
        with ctx:
            seen.append((state.phase, state.layer, state.open_group is not None))
            h = layer(h)
        h = sync(h)
        seen.append((state.phase, state.last_closed))
    assert seen == [
        (Phase.IN_LAYER, 0, True), (Phase.BETWEEN, 0),
        (Phase.IN_LAYER, 1, True), (Phase.BETWEEN, 1),
        (Phase.IN_LAYER, 2, False), (Phase.IDLE, 2),  # model_layers reached: the forward ended
    ]
    h.sum().backward()
    assert state.phase is Phase.IDLE and ctx.stats["groups_offloaded"] == 2


def test_one_with_form_holds_between_until_the_with_ends() -> None:
    layers = _layers()
    oa = offload.OffloadActivations(layers, min_offload_bytes=0)
    state = oa.engine.forward
    h = torch.randn(4, 16, requires_grad=True)
    with oa:
        assert state.phase is Phase.BETWEEN and state.forward_hooks
        for layer in layers:
            h = layer(h)
        assert state.phase is Phase.BETWEEN
    assert state.phase is Phase.IDLE and not state.forward_hooks
    h.sum().backward()


def test_a_failed_layer_leaves_the_state_idle_and_usable() -> None:
    layers = _layers()
    ctx, sync = offload.get_cpu_offload_context(enabled=True, num_layers=2, model_layers=3, min_offload_bytes=0, group_bytes=0)
    state = ctx.engine.forward
    h = torch.randn(4, 16, requires_grad=True)
    with pytest.raises(ValueError):
        with ctx:
            layers[0](h)
            raise ValueError("inside a layer")
    assert state.phase is Phase.IDLE and state.step is None and not state.layer_hooks
    for layer in layers:
        with ctx:
            h = layer(h)
        h = sync(h)
    h.sum().backward()
    assert ctx.stats["groups_offloaded"] == 2


def test_a_pending_group_for_a_layer_that_does_not_offload_is_kept_and_its_claim_returned() -> None:
    # A tensor saved between layers joins the next layer's group early; when that layer then
    # runs under no_grad (a frozen layer), the group is kept on the device and the host bytes
    # claimed for it go back: a claim left behind would shrink the host budget step after step.
    layers = _layers(3)
    weight = torch.randn(16, 16, requires_grad=True)
    oa = offload.OffloadActivations(layers, num_offload_layers=2, min_offload_bytes=0)

    claims_after_frozen = []

    def step(context) -> tuple[torch.Tensor, ...]:
        h = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
        with context:
            h = layers[0](h)
            h = h @ weight  # saved between layers 0 and 1: layer 1's pending group
            with torch.no_grad():
                frozen = layers[1](h)
            claims_after_frozen.append(oa.engine.arena.claimed)
            h = layers[2](h + frozen)
        h.sum().backward()
        grads = (weight.grad.clone(),) + tuple(p.grad.clone() for p in layers.parameters() if p.grad is not None)
        weight.grad = None
        layers.zero_grad(set_to_none=True)
        return grads

    import contextlib

    expected = step(contextlib.nullcontext())
    for _ in range(3):
        got = step(oa)
        assert all(torch.equal(a, b) for a, b in zip(expected, got))
        assert oa.engine.arena.claimed == 0
    assert claims_after_frozen == [0, 0, 0, 0]
    assert oa.engine.forward.phase is Phase.IDLE
