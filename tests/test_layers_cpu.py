"""Layer boundaries on CPU: checkpointing inside offloaded layers, passive layers, step resync,
atomic entry, weight-shared layers, ``enabled=False`` and copying a model inside the ``with``."""

from __future__ import annotations

import copy
import pickle
import warnings
from functools import partial

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload
from offload.models import run_layers

from _util import assert_bitwise, cpu_context, llama_grads, make_gpt_layers, oa_step, tiny_llama, train_step


def hooks_installed() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


class ForwardCheckpointed(nn.Module):
    """Checkpoints ``forward`` (module hooks stay outside the checkpoint: transformers >= 5.23)."""

    def __init__(self, inner: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=self.reentrant)


class CallCheckpointed(nn.Module):
    """Checkpoints ``__call__``, so module hooks run inside the checkpoint (transformers 5.17)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)

    def __call__(self, *args, **kwargs):  # type: ignore[override]
        return checkpoint(partial(super().__call__, **kwargs), *args, use_reentrant=False)



@pytest.fixture
def gpt() -> tuple[nn.ModuleList, torch.Tensor]:
    return make_gpt_layers(n=4), torch.randn(2, 16, 64)


# -- checkpointing composes with offloading --------------------------------------------------------
@pytest.mark.parametrize("wrap", ["forward-nonreentrant", "forward-reentrant", "call-nonreentrant"])
def test_checkpointed_layers_offload_only_their_inputs(gpt, wrap: str) -> None:
    layers, x = gpt
    if wrap == "call-nonreentrant":
        wrapped = nn.ModuleList(CallCheckpointed(layer) for layer in layers)
    else:
        reentrant = wrap == "forward-reentrant"
        wrapped = nn.ModuleList(ForwardCheckpointed(layer, reentrant) for layer in layers)
    expected = train_step(layers, x)
    assert_bitwise(expected, train_step(wrapped, x))  # checkpointing alone is exact here
    oa = offload.OffloadActivations(wrapped, device="cpu", min_offload_bytes=0, group_bytes=0)
    for _ in range(2):
        assert_bitwise(expected, oa_step(wrapped, x, oa))
        stats = oa.stats
        # Offloaded layers 1 and 2 saved their input and nothing else (layer 0's input is the
        # leaf x, kept): checkpoint's own hooks stayed innermost. Without that, every
        # activation of the layer (about 20 tensors each) was offloaded.
        assert stats["offloaded_tensors"] == 2, stats
        assert stats["offloaded_bytes"] == 2 * x.numel() * x.element_size()
        assert stats["groups_offloaded"] == 2 and stats["reloads"] == 2
    # The recompute inside backward did not count as layers of a new step.
    assert oa.engine.forward.step_index == 2 and not hooks_installed()


def test_recompute_in_backward_is_passive_in_te_call_shape(gpt) -> None:
    layers, x = gpt
    expected = train_step(layers, x)
    ctx, sync = cpu_context(3, 4)

    def in_context(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        with ctx:
            return layer(h)

    for p in layers.parameters():
        p.grad = None
    xin = x.detach().requires_grad_(True)
    h = xin
    for layer in layers:
        h = sync(checkpoint(partial(in_context, layer), h, use_reentrant=False))
    (h.float() ** 2).mean().backward()
    assert_bitwise(expected, [p.grad for p in layers.parameters()] + [xin.grad])
    assert ctx.engine.forward.step_index == 1  # the recomputed `with ctx` blocks started no step


def test_hf_llama_gradient_checkpointing_offloads_layer_inputs() -> None:
    pytest.importorskip("transformers")
    model, ids = tiny_llama(3)

    def step(oa: object = None) -> list[torch.Tensor]:
        return llama_grads(model, ids, oa)

    expected = step()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    assert_bitwise(expected, step())
    oa = offload.OffloadActivations(model.model.layers, device="cpu", min_offload_bytes=0)
    assert_bitwise(expected, step(oa))
    # Only the two offloaded layers' inputs (hidden states, 2 x 32 x 64 floats) left, plus the
    # token ids the embedding saved before layer 0 (they join layer 0's group).
    assert oa.stats["offloaded_tensors"] == 3
    assert oa.stats["offloaded_bytes"] == 2 * (2 * 32 * 64 * 4) + 2 * 32 * 8


# -- passive layers and step resync ----------------------------------------------------------------
def test_no_grad_pass_between_steps_does_not_shift_layer_count(gpt) -> None:
    layers, x = gpt
    expected = train_step(layers, x)
    ctx, sync = cpu_context(3, 4)
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    with torch.no_grad():  # an eval pass over part of the layers
        run_layers(layers[:2], x, ctx, sync)
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    # The last layer stayed on the GPU: 3 groups, layers 0..2 (a shifted count offloads layer 3).
    assert ctx.stats["groups_offloaded"] == 3 and ctx.stats["step"] == 2


def test_too_few_layer_contexts_resync_at_backward_with_a_warning(gpt) -> None:
    layers, x = gpt
    ctx, sync = cpu_context(2, 5)  # says 5 layers; the model runs 4
    expected = train_step(layers, x)
    with pytest.warns(UserWarning, match="after 4 layer contexts, but model_layers=5"):
        assert_bitwise(expected, train_step(layers, x, ctx, sync))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        assert_bitwise(expected, train_step(layers, x, ctx, sync))
    # Each forward started its own step at layer 0 (no straddling).
    assert ctx.stats["step"] == 2 and ctx.stats["groups_offloaded"] == 2


def test_exception_between_layers_starts_the_next_forward_at_layer_zero(gpt) -> None:
    layers, x = gpt
    expected = train_step(layers, x)
    ctx, sync = cpu_context(3, 4)

    def failing_forward() -> None:
        h = x.detach().requires_grad_(True)
        for i, layer in enumerate(layers):
            with ctx:
                h = layer(h)
            h = sync(h)
            if i == 1:
                raise ValueError("between layers")

    with pytest.raises(ValueError):
        failing_forward()
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    stats = ctx.stats
    assert stats["groups_offloaded"] == 3 and stats["reloads"] == 3, stats


# -- entry is atomic ---------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", ["te", "oa"])
def test_failed_entry_leaves_the_engine_usable(gpt, shape: str) -> None:
    layers, x = gpt
    expected = train_step(layers, x)
    if shape == "te":
        ctx, sync = cpu_context(3, 4)
        with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
            with pytest.raises(RuntimeError, match="no hooks here"):
                with ctx:
                    pass
        assert not ctx.engine.forward.in_layer and ctx.engine.step is None
        assert_bitwise(expected, train_step(layers, x, ctx, sync))
    else:
        oa = offload.OffloadActivations(layers, device="cpu", min_offload_bytes=0)
        with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
            with pytest.raises(RuntimeError, match="no hooks here"):
                with oa:
                    pass
        assert not oa.active and oa.engine.step is None
        assert_bitwise(expected, oa_step(layers, x, oa))
    assert not hooks_installed()


# -- OffloadActivations options ------------------------------------------------------------------
def test_weight_shared_layers(gpt) -> None:
    layers, x = gpt
    block = layers[0]
    shared = nn.ModuleList([block, block, block])
    expected = train_step(shared, x)
    oa = offload.OffloadActivations([block, block, block], device="cpu", min_offload_bytes=0, group_bytes=0)
    for _ in range(2):
        got = oa_step(shared, x, oa)
        assert_bitwise(expected, got)
    assert oa.stats["groups_offloaded"] == 2 and oa.stats["reloads"] == 2


def test_enabled_false_turns_offloading_off(gpt) -> None:
    layers, x = gpt
    expected = train_step(layers, x)
    oa = offload.OffloadActivations(layers, enabled=False, device="cpu", min_offload_bytes=0)
    assert oa.engine is None
    assert_bitwise(expected, oa_step(layers, x, oa))
    assert oa.stats["mode"] == "disabled" and oa.stats["offloaded_bytes"] == 0
    assert "disabled" in oa.report()
    assert all(not m._forward_pre_hooks for m in layers)


def test_model_can_be_deep_copied_and_pickled_inside_the_with(gpt) -> None:
    layers, x = gpt
    expected = train_step(layers, x)
    oa = offload.OffloadActivations(layers, device="cpu", min_offload_bytes=0)
    for p in layers.parameters():
        p.grad = None
    xin = x.detach().requires_grad_(True)
    with oa:
        twin = copy.deepcopy(layers)
        pickle.loads(pickle.dumps(layers))
        out = run_layers(layers, xin)
        # The copy's hooks are inert: running it here is not counted as layers.
        with torch.no_grad():
            run_layers(twin, xin.detach())
        assert oa.engine.step.layers_started == 4
    (out.float() ** 2).mean().backward()
    assert_bitwise(expected, [p.grad for p in layers.parameters()] + [xin.grad])
    assert_bitwise(expected, train_step(twin, x))


def test_no_grad_with_is_a_no_op(gpt) -> None:
    layers, x = gpt
    oa = offload.OffloadActivations(layers, device="cpu", min_offload_bytes=0)
    with torch.no_grad(), oa:
        run_layers(layers, x)
    assert oa.engine.step is None and not hooks_installed()
