"""The engine's lifetimes on CPU (``device="cpu"``): failed and abandoned steps give every
activation and host block back without the cyclic GC, and in-place changes to saved tensors
raise autograd's error. Split from ``test_engine_cpu.py``."""

from __future__ import annotations

import gc
import weakref
from typing import Optional

import pytest
import torch

import offload
from offload.engine.group import GroupState

from _util import Boom, assert_bitwise, cpu_context, make_mlp_layers, train_step

# -- failed and abandoned steps give everything back, without the cyclic GC -------------------------
class ExpLayer(torch.nn.Module):
    """``exp`` saves its own output, which autograd hands the pack hook with the saving node as its
    grad_fn. Weak references to the saved storages tell what outlives its step."""

    storages: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.exp(x * 0.5)
        ExpLayer.storages.append(weakref.ref(y.untyped_storage()))
        return y


@pytest.fixture
def no_gc():
    """Reference counting only: what is still alive is really held, not waiting for a GC pass."""
    gc.collect()
    gc.disable()
    ExpLayer.storages = []
    yield
    gc.enable()


def alive_storages() -> int:
    return sum(r() is not None for r in ExpLayer.storages)


KEEP_OPTIONS = {
    "offloaded": {},
    "kept_small": {"min_offload_bytes": 1 << 30},   # every tensor kept by the policy
    "kept_budget": {"host_budget_bytes": 0},         # every tensor kept for the host budget
}


@pytest.mark.parametrize("how", sorted(KEEP_OPTIONS))
@pytest.mark.parametrize("api", ["context", "offload_activations"])
def test_failed_steps_leave_no_activation_or_host_block_behind(no_gc, how: str, api: str) -> None:
    stack = torch.nn.ModuleList([ExpLayer(), ExpLayer(), ExpLayer(), Boom()])
    if api == "context":
        ctx, sync = cpu_context(3, 4, **KEEP_OPTIONS[how])
        engine = ctx.engine
    else:
        oa = offload.OffloadActivations(stack, device="cpu", **{"min_offload_bytes": 0, **KEEP_OPTIONS[how]})
        engine = oa.engine
    for _ in range(3):
        x = torch.randn(64, 64, requires_grad=True)
        try:
            if api == "context":
                offload.models.run_layers(stack, x, ctx, sync)
            else:
                with oa:
                    offload.models.run_layers(stack, x)
        except RuntimeError as exc:
            assert "boom" in str(exc)
    assert len(ExpLayer.storages) == 9
    assert alive_storages() == 0, f"{alive_storages()} of 9 saved activations outlived their failed step"
    assert engine.arena.counters.bytes_in_use == 0, "host regions of failed steps were not given back"


@pytest.mark.parametrize("how", sorted(KEEP_OPTIONS))
def test_step_without_backward_is_freed_when_the_next_step_starts(no_gc, how: str) -> None:
    # A skipped backward (NaN loss): the step's graph is dropped; the engine's hold on the step's
    # groups ends with the next step, and nothing else may keep them.
    layers = torch.nn.ModuleList(ExpLayer() for _ in range(4))
    ctx, sync = cpu_context(3, 4, **KEEP_OPTIONS[how])
    x = torch.randn(64, 64)
    train_step(layers, x, ctx, sync)
    loss = offload.models.run_layers(layers, x.requires_grad_(True) * 1.0, ctx, sync).sum()
    del loss
    skipped = list(ExpLayer.storages[4:])
    train_step(layers, x, ctx, sync)
    assert sum(r() is not None for r in skipped) == 0, "the skipped step's activations are still alive"
    stats = ctx.stats
    assert stats["pinned_allocations"] == 0
    if how == "offloaded":
        assert stats["groups_offloaded"] == 3 and "budget" not in stats["kept"]


def test_host_block_of_a_step_without_backward_is_reused(no_gc) -> None:
    # The budget holds one 64 KiB block: each step offloads one group into it. A step without
    # backward must give it back, or offloading stops for good.
    layers = torch.nn.ModuleList(ExpLayer() for _ in range(4))
    ctx, sync = cpu_context(3, 4, host_budget_bytes=64 * 1024)
    x = torch.randn(64, 64)
    offloaded = []
    for skip_backward in (False, True, False, False, True, False):
        if skip_backward:
            loss = offload.models.run_layers(layers, x.requires_grad_(True) * 1.0, ctx, sync).sum()
            del loss
        else:
            train_step(layers, x, ctx, sync)
            offloaded.append(ctx.stats["groups_offloaded"])
    assert offloaded == [1, 1, 1, 1]
    assert ctx.engine.arena.counters.pinned_allocations == 1


def test_manual_step_neither_released_nor_run_backward_is_freed(no_gc) -> None:
    layers = torch.nn.ModuleList(ExpLayer() for _ in range(3))
    ctx, sync, control = cpu_context(2, 3, manual_synchronization=True)
    for _ in range(3):
        h = torch.randn(64, 64, requires_grad=True)
        for i, layer in enumerate(layers):
            with ctx:
                h = layer(h)
            if i < 2:
                control.start_offload_layer(i)  # copied, never released
        del h
    # The step holds its groups weakly: with its graph dropped, even the last step's are gone.
    assert alive_storages() == 0
    train_step(layers, torch.randn(64, 64), ctx, sync)
    assert sum(r() is not None for r in ExpLayer.storages[:9]) == 0


# -- in-place changes to saved tensors -------------------------------------------------------------
class ChangeSaved(torch.nn.Module):
    """``exp`` saves its output; ``own`` changes it in place right after, ``input`` changes this
    layer's input (the previous layer's saved output) in place."""

    def __init__(self, change: Optional[str] = None) -> None:
        super().__init__()
        self.change = change
        self.last: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.change == "input":
            x.mul_(2.0)
        y = torch.exp(x * 0.5)
        if self.change == "own":
            y.mul_(2.0)
        self.last = y
        return y


INPLACE_CASES = {
    # name: (layer that changes, change, options); what is changed is layer 0's saved output
    "before_d2h": (0, "own", {}),
    "after_d2h_before_release": (1, "input", {}),
    "kept_small": (0, "own", {"min_offload_bytes": 1 << 30}),
    "kept_budget": (0, "own", {"host_budget_bytes": 0}),
}


@pytest.mark.parametrize("case", sorted(INPLACE_CASES))
def test_in_place_change_of_a_saved_tensor_raises_like_autograd(case: str) -> None:
    at, change, options = INPLACE_CASES[case]
    layers = torch.nn.ModuleList(ChangeSaved(change if i == at else None) for i in range(4))
    x = torch.randn(32, 16)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        train_step(layers, x)  # autograd's own check, without offload
    ctx, sync = cpu_context(3, 4, **options)
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: a tensor of shape \[32, 16\] and dtype torch.float32 saved for backward in offloaded layer 0 is at version 1; expected version 0"):
        train_step(layers, x, ctx, sync)


@pytest.mark.parametrize("when", ["released", "held"])
def test_in_place_change_after_forward_raises_like_autograd(when: str) -> None:
    # After the forward, through the caller's own reference: after release the group only has a
    # weak reference to it; a group that was never released still holds the original.
    layers = torch.nn.ModuleList(ChangeSaved() for _ in range(3))
    if when == "released":
        ctx, sync = cpu_context(2, 3)
    else:
        ctx, sync, control = cpu_context(2, 3, manual_synchronization=True)
    h = torch.randn(32, 16, requires_grad=True)
    for i, layer in enumerate(layers):
        with ctx:
            h = layer(h)
        h = sync(h)
    assert ctx.engine.step.groups[0].state is (GroupState.OFFLOADED if when == "released" else GroupState.RESIDENT)
    with torch.no_grad():
        layers[0].last.add_(1.0)
    with pytest.raises(RuntimeError, match=r"shape \[32, 16\] .* offloaded layer 0 is at version 1; expected version 0"):
        h.sum().backward()


def test_in_place_change_of_a_kept_parameter_raises_like_autograd() -> None:
    # An optimizer step between forward and backward: parameters are kept, and checked too.
    layers = make_mlp_layers(3)
    ctx, sync = cpu_context(2, 3)
    h = offload.models.run_layers(layers, torch.randn(8, 64, requires_grad=True), ctx, sync)
    with torch.no_grad():
        layers[0].fc.weight.mul_(1.0)
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: a tensor of shape \[64, 64\]"):
        h.sum().backward()


def test_unchanged_saved_tensors_pass_the_version_check() -> None:
    # A change made before the save does not count, exactly as in autograd.
    x = torch.randn(32, 16)

    class Bump(torch.nn.Module):
        def forward(self, t):
            t = t * 1.0
            t.add_(1.0)  # before anything saves it
            return torch.exp(t)

    stack = torch.nn.ModuleList([Bump(), ChangeSaved(), ChangeSaved(), ChangeSaved()])
    expected = train_step(stack, x)
    ctx, sync = cpu_context(3, 4)
    assert_bitwise(expected, train_step(stack, x, ctx, sync))
