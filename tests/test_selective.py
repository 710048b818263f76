"""Selective recompute (offload.selective_recompute): bitwise gradients, fewer bytes saved, with
and without offloading, plain inside whole-layer checkpoints, and clear errors. CPU tests run in
CI; the ``cuda`` ones check the memory claim with the allocator."""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import offload
from offload.models import MLPBlock, run_layers
from offload.forwards.selective import SelectiveForward

from _util import (
    assert_bitwise, cpu_context, hooks_installed, llama_grads, oa_step, plain_reference, tiny_llama, train_step,
)


def mlp_stack(n: int, hidden: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(MLPBlock(hidden, device=device, dtype=dtype) for _ in range(n))


def saved_bytes(layers: torch.nn.ModuleList, x: torch.Tensor) -> int:
    """Bytes autograd hands to the saved-tensor hooks in one forward (distinct storages)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run_layers(layers, x.detach().requires_grad_(True))
    return sum(seen.values())


def test_gradients_are_bitwise_and_the_saved_bytes_drop() -> None:
    layers, x = mlp_stack(3, 32), torch.randn(4, 16, 32)
    expected = plain_reference(layers, x)
    plain_bytes = saved_bytes(layers, x)
    with offload.selective_recompute(list(layers)) as wrapped:
        assert all(isinstance(m.__dict__["forward"], SelectiveForward) for m in wrapped.modules)
        assert_bitwise(expected, train_step(layers, x))
        assert_bitwise(expected, train_step(layers, x))  # and again: nothing cached across steps
        # What reaches the hooks is each block's input (checkpoint saves it); the GEMM outputs
        # are held by the selective cache, and the LayerNorm and GELU outputs are gone.
        assert saved_bytes(layers, x) <= 3 * x.nbytes < plain_bytes
    assert all("forward" not in m.__dict__ for m in layers)
    assert_bitwise(expected, train_step(layers, x))


@pytest.mark.parametrize("shape", ["te", "oa"])
def test_composes_with_offloading_bitwise(shape: str) -> None:
    layers, x = mlp_stack(4, 32), torch.randn(4, 16, 32)
    expected = plain_reference(layers, x)
    with offload.selective_recompute(list(layers)):
        if shape == "te":
            ctx, sync = cpu_context(3, 4)
            got = train_step(layers, x, ctx, sync)
            stats = ctx.stats
        else:
            oa = offload.OffloadActivations(layers, 3, device="cpu", min_offload_bytes=0, group_bytes=0)
            got = oa_step(layers, x, oa)
            stats = oa.stats
    assert_bitwise(expected, got)
    # The block inputs that checkpoint saves are what gets offloaded (layer 0's is the leaf
    # input, which stays).
    assert stats["offloaded_tensors"] >= 2 and stats["reloads"] >= 2
    assert not hooks_installed()


@pytest.mark.parametrize("reentrant", [False, True])
def test_inside_a_whole_layer_checkpoint_it_runs_plainly(monkeypatch: pytest.MonkeyPatch, reentrant: bool) -> None:
    layers, x = mlp_stack(2, 32), torch.randn(4, 16, 32)
    expected = plain_reference(layers, x)
    calls: list[Any] = []
    real = offload.forwards.selective.checkpoint
    monkeypatch.setattr(offload.forwards.selective, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    with offload.selective_recompute(list(layers)):
        for p in layers.parameters():
            p.grad = None
        z = x.detach().requires_grad_(True)
        out = z
        for layer in layers:
            out = checkpoint(layer, out, use_reentrant=reentrant)
        (out.float() ** 2).mean().backward()
        got = [p.grad.clone() for p in layers.parameters()] + [z.grad.clone()]
    assert_bitwise(expected, got)
    assert calls == []  # neither the forward nor the recompute used the selective cache


def test_no_grad_runs_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    layers, x = mlp_stack(2, 32), torch.randn(4, 16, 32)
    want = run_layers(layers, x)
    monkeypatch.setattr(offload.forwards.selective, "checkpoint", lambda *a, **k: pytest.fail("checkpoint under no_grad"))
    with offload.selective_recompute(list(layers)), torch.no_grad():
        assert torch.equal(run_layers(layers, x), want)


def test_bad_input_says_what_was_wrong() -> None:
    layers = mlp_stack(2, 8)
    with pytest.raises(TypeError, match="module or an iterable of modules"):
        offload.selective_recompute(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="item 1 is a str"):
        offload.selective_recompute([layers[0], "fc1"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="listed twice"):
        offload.selective_recompute([layers[0], layers[0]])
    handle = offload.selective_recompute(layers[0])
    with pytest.raises(ValueError, match="wrapped already"):
        offload.selective_recompute(layers[0])
    handle.remove()
    handle.remove()  # idempotent
    layers[1].forward = lambda x: x  # somebody else's override
    with pytest.raises(ValueError, match="forward set on the instance"):
        offload.selective_recompute(layers[1])
    assert "forward" not in layers[0].__dict__


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_hf_llama_mlps_bitwise_on_cpu() -> None:
    model, ids = tiny_llama(2)
    expected = llama_grads(model, ids)
    assert_bitwise(expected, llama_grads(model, ids))
    with offload.selective_recompute([layer.mlp for layer in model.model.layers]):
        assert_bitwise(expected, llama_grads(model, ids))
        oa = offload.OffloadActivations(model.model.layers, 1, device="cpu", min_offload_bytes=0)
        assert_bitwise(expected, llama_grads(model, ids, oa))
        assert oa.stats["offloaded_tensors"] > 0


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_under_torch_compile_bitwise_against_the_same_compiled_plain_model(backend: str) -> None:
    layers, x = mlp_stack(3, 32), torch.randn(4, 16, 32)

    def compiled_grads() -> list[torch.Tensor]:
        torch._dynamo.reset()
        return oa_step(layers, x, contextlib.nullcontext(), run=torch.compile(lambda z: run_layers(layers, z), backend=backend))

    expected = compiled_grads()
    assert_bitwise(expected, compiled_grads())
    with offload.selective_recompute(list(layers)):
        assert_bitwise(expected, compiled_grads())


# -- plans count the selective caches -----------------------------------------------------------------
def test_the_probe_measures_each_layers_cache_and_the_model_holds_it() -> None:
    from offload.planner import Action, LayerPlan
    from offload.planner.model import held_bytes, resident_bytes

    n, hidden, tokens = 3, 32, 4 * 16
    layers, x = mlp_stack(n, hidden), torch.randn(4, 16, hidden)
    plain = offload.planner.profile_step(layers, lambda: train_step(layers, x), device="cpu", min_offload_bytes=0)
    assert all(layer.cached_bytes == 0 for layer in plain.layers)
    with offload.selective_recompute(list(layers)):
        profile = offload.planner.profile_step(layers, lambda: train_step(layers, x), device="cpu", min_offload_bytes=0)
    # Each block's cache holds its two GEMM outputs (fc1: 4h wide, fc2: h wide), float32.
    assert [layer.cached_bytes for layer in profile.layers] == [tokens * 5 * hidden * 4] * n
    # The hooks see less, and the model holds the cache unless the layer is recomputed.
    layer = profile.layers[1]
    assert layer.saved_bytes < plain.layers[1].saved_bytes
    assert held_bytes(layer, LayerPlan(Action.KEEP)) == layer.saved_bytes + layer.cached_bytes
    assert resident_bytes(layer, LayerPlan(Action.OFFLOAD)) == layer.cached_bytes
    assert held_bytes(layer, LayerPlan(Action.RECOMPUTE)) == layer.input_bytes


def test_plans_with_selective_modules_are_bitwise_exact() -> None:
    from offload.planner import Action, LayerPlan, plan_for

    layers, x = mlp_stack(4, 32), torch.randn(4, 16, 32)
    expected = plain_reference(layers, x)
    with offload.selective_recompute(list(layers)):
        profile = offload.planner.profile_step(layers, lambda: train_step(layers, x), device="cpu", min_offload_bytes=0)
        actions = [LayerPlan(Action.OFFLOAD), LayerPlan(Action.RECOMPUTE), LayerPlan(Action.OFFLOAD), LayerPlan(Action.KEEP)]
        oa = offload.OffloadActivations(layers, plan=plan_for(profile, actions), device="cpu", min_offload_bytes=0)
        for _ in range(2):
            assert_bitwise(expected, oa_step(layers, x, oa))
        assert oa.stats["offloaded_tensors"] > 0
        oa.close()  # its recompute wrapper goes, the selective one under it stays
        assert all(isinstance(m.__dict__.get("forward"), SelectiveForward) for m in layers)


def test_a_budget_planned_on_the_fly_counts_the_caches_and_stays_exact() -> None:
    layers, x = mlp_stack(4, 32), torch.randn(4, 16, 32)
    expected = plain_reference(layers, x)
    with offload.selective_recompute(list(layers)):
        profile = offload.planner.profile_step(layers, lambda: train_step(layers, x), device="cpu", min_offload_bytes=0)
        budget = profile.plain_peak_bytes // 2
        oa = offload.OffloadActivations(layers, memory_budget_bytes=budget, device="cpu", min_offload_bytes=0)
        for _ in range(5):  # warm-up, calibration, probe, then two planned steps
            assert_bitwise(expected, oa_step(layers, x, oa))
        assert oa.plan is not None and oa.plan.profile is not None
        assert all(layer.cached_bytes > 0 for layer in oa.plan.profile.layers)
        assert oa.plan.prediction.peak_bytes <= budget
        assert oa.stats["offloaded_bytes"] > 0 or oa.plan.recomputes()
        oa.close()


# -- GPU ---------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("with_offload", [False, True])
def test_gpu_bitwise_and_the_intermediate_activations_are_freed(with_offload: bool) -> None:
    n, hidden, tokens = 4, 1024, 8 * 512
    layers = mlp_stack(n, hidden, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8, 512, hidden, device="cuda", dtype=torch.bfloat16)
    expected = plain_reference(layers, x)

    def held_after_forward(context: Any = None, sync: Any = None) -> int:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = run_layers(layers, x.detach().requires_grad_(True), context, sync)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before - out.nbytes
        del out
        return held

    plain_held = held_after_forward()
    with offload.selective_recompute(list(layers)):
        if with_offload:
            ctx, sync = offload.get_cpu_offload_context(True, num_layers=n - 1, model_layers=n, min_offload_bytes=0)
            assert_bitwise(expected, train_step(layers, x, ctx, sync))  # step 1 pins
            assert_bitwise(expected, train_step(layers, x, ctx, sync))
            assert ctx.stats["offloaded_tensors"] > 0
            held = held_after_forward(ctx, sync)
        else:
            assert_bitwise(expected, train_step(layers, x))
            held = held_after_forward()
    # Per block the GELU output (4h) and the LayerNorm output (h) are no longer held, and the
    # second GEMM's output (h) is, in the selective cache: 4h x tokens x 2 bytes less, at least.
    freed = n * 4 * hidden * tokens * 2
    assert plain_held - held >= 0.95 * freed, (plain_held, held, freed)
