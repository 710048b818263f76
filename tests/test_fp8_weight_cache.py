"""The FP8 weight cache in one layout or two: half the bytes with one, bitwise the same results,
the backward's operand made from the copy its forward used (never a second cached copy), the
version check still invalidating, and the bytes in ``stats``. CPU tests on torch's CPU
``_scaled_mm``; ``cuda`` variants (Triton quantization) skip cleanly without an FP8 GPU."""

from __future__ import annotations

import pytest
import torch

import offload
from offload import fp8
from offload.fp8 import cast, weights

from _util import assert_bitwise, cpu_context, oa_step, train_step

CUDA_FP8 = torch.cuda.is_available() and fp8.scaled_mm_supported("cuda")
CUDA_ONLY = [pytest.mark.cuda, pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 (sm_89+)")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_ONLY)]
CONFIGS = [("tensorwise", torch.float8_e4m3fn), ("tensorwise", torch.float8_e5m2), ("rowwise", torch.float8_e4m3fn)]
K, N = 128, 64


def layer(device: str, weight_layouts: str, scaling: str = "tensorwise", fp8_dtype: torch.dtype = torch.float8_e4m3fn,
          cls: type = fp8.Linear) -> fp8.Linear:
    torch.manual_seed(0)
    return cls(K, N, scaling=scaling, fp8_dtype=fp8_dtype, weight_layouts=weight_layouts, device=device, dtype=torch.bfloat16)


def run(module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    y = module(x)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad for p in module.parameters()]


def skip_unsupported_rowwise(scaling: str, device: str) -> None:
    if scaling == "rowwise" and not fp8.rowwise_supported(device):
        pytest.skip(f"rowwise _scaled_mm is not available on {device} in torch {torch.__version__}")


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_one_layout_caches_half_the_bytes(scaling: str) -> None:
    skip_unsupported_rowwise(scaling, "cpu")
    x = torch.randn(32, K, dtype=torch.bfloat16)
    sizes = {}
    for layouts in ("one", "both"):
        lin = layer("cpu", layouts, scaling)
        assert lin.weight_cache.nbytes == 0 and fp8.weight_cache_bytes(lin) == 0  # nothing before a forward
        lin(x)
        sizes[layouts] = lin.weight_cache.nbytes
        assert fp8.weight_cache_bytes(torch.nn.Sequential(lin, lin)) == sizes[layouts]  # a shared module once
    scales = 4 if scaling == "tensorwise" else 4 * N  # float32 scale(s) of the forward's layout
    assert sizes["one"] == N * K + scales
    assert sizes["both"] == 2 * N * K + (8 if scaling == "tensorwise" else 4 * (N + K))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling,fp8_dtype", CONFIGS)
@pytest.mark.parametrize("cls", [fp8.Linear, fp8.LayerNormLinear], ids=["Linear", "LayerNormLinear"])
def test_one_layout_gives_bitwise_the_results_of_both(device: str, scaling: str, fp8_dtype: torch.dtype, cls: type) -> None:
    skip_unsupported_rowwise(scaling, device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, K, generator=g).to(device, torch.bfloat16)
    dy = torch.randn(64, N, generator=g).to(device, torch.bfloat16)
    both = run(layer(device, "both", scaling, fp8_dtype, cls), x, dy)
    assert_bitwise(both, run(layer(device, "both", scaling, fp8_dtype, cls), x, dy))  # repeats itself
    one = layer(device, "one", scaling, fp8_dtype, cls)
    for _ in range(2):  # the second from the cache
        assert_bitwise(both, run(one, x, dy))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_dgrad_operand_made_in_backward_is_the_cached_one_bit_for_bit(device: str, scaling: str) -> None:
    skip_unsupported_rowwise(scaling, device)
    w = torch.randn(N, K, device=device, dtype=torch.bfloat16) * 3
    made = weights.dgrad_operand(weights.quantize_weight(w, scaling, "one"))
    cached = weights.dgrad_operand(weights.quantize_weight(w, scaling, "both"))
    for a, b in zip(made, cached):
        assert a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, b.view(torch.uint8) if b.element_size() == 1 else b)


@pytest.mark.parametrize("weight_layouts", ["one", "both"])
def test_backward_keeps_the_forwards_cached_copy_and_no_other(weight_layouts: str) -> None:
    lin = layer("cpu", weight_layouts)
    y = lin(torch.randn(32, K, dtype=torch.bfloat16, requires_grad=True))
    saved = y.grad_fn.gemm_weight  # what the backward holds: the cache's own object, not a copy
    assert saved is lin.weight_cache.get(lin.weight, "tensorwise")
    assert (saved.dgrad is None) == (weight_layouts == "one")
    assert saved.nbytes == lin.weight_cache.nbytes


def test_one_layout_dgrad_uses_the_forwards_copy_after_the_cache_moved_on() -> None:
    # Forward 1, then the weight changes behind autograd's back (.data) and a second micro-batch
    # forces a new copy: backward 1 must transpose forward 1's copy, not the cache's new one.
    lin = layer("cpu", "one")
    ref = layer("cpu", "one")
    x = torch.randn(32, K, dtype=torch.bfloat16)
    dy = torch.randn(32, N, dtype=torch.bfloat16)
    expected = run(ref, x, dy)[1]
    xg = x.clone().requires_grad_(True)
    y1 = lin(xg)
    lin.weight.data.mul_(2.0)
    lin(x, is_first_microbatch=True)
    y1.backward(dy)
    assert torch.equal(xg.grad, expected)


@pytest.mark.parametrize("weight_layouts", ["one", "both"])
def test_a_weight_update_still_invalidates_the_cache(weight_layouts: str) -> None:
    lin = layer("cpu", weight_layouts)
    x = torch.randn(32, K, dtype=torch.bfloat16)
    dy = torch.randn(32, N, dtype=torch.bfloat16)
    run(lin, x, dy)
    old = lin.weight_cache.get(lin.weight, "tensorwise")
    with torch.no_grad():
        lin.weight.mul_(-0.5)  # an optimizer step: the version counter moves
    got = run(lin, x, dy)
    assert lin.weight_cache.get(lin.weight, "tensorwise") is not old
    fresh = layer("cpu", weight_layouts)
    with torch.no_grad():
        fresh.weight.copy_(lin.weight)
    assert_bitwise(run(fresh, x, dy), got)


def test_changing_weight_layouts_on_a_cache_requantizes() -> None:
    lin = layer("cpu", "both")
    x = torch.randn(32, K, dtype=torch.bfloat16)
    lin(x)
    lin.weight_cache.weight_layouts = "one"
    lin(x)
    assert lin.weight_cache.nbytes == N * K + 4


def test_bad_weight_layouts_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match=r"fp8.Linear: weight_layouts must be 'one'.*got 'two'"):
        fp8.Linear(K, N, weight_layouts="two")
    with pytest.raises(ValueError, match="fp8.LayerNormLinear: weight_layouts must be"):
        fp8.LayerNormLinear(K, N, weight_layouts=None)


# ---------------------------------------------------------------------------------------------
# the bytes in stats
# ---------------------------------------------------------------------------------------------


def fp8_layers(n: int = 3) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(
        torch.nn.Sequential(fp8.Linear(K, K, dtype=torch.bfloat16), torch.nn.GELU()) for _ in range(n)
    )


def test_offload_activations_stats_report_the_weight_cache_bytes() -> None:
    layers = fp8_layers()
    oa = offload.OffloadActivations(layers, num_offload_layers=2, device="cpu", min_offload_bytes=0)
    assert oa.stats["weight_cache_bytes"] == 0  # no forward yet
    oa_step(layers, torch.randn(32, K, dtype=torch.bfloat16), oa)
    assert oa.stats["weight_cache_bytes"] == fp8.weight_cache_bytes(layers) == 3 * (K * K + 4)
    assert "FP8 weight copies" in oa.report()
    oa.close()


def test_layer_contexts_report_the_bytes_of_params_from_and_none_without() -> None:
    layers = fp8_layers()
    x = torch.randn(32, K, dtype=torch.bfloat16)
    ctx, sync = cpu_context(2, 3, params_from=layers)
    train_step(layers, x, ctx, sync)
    assert ctx.stats["weight_cache_bytes"] == 3 * (K * K + 4)
    bare, bare_sync = cpu_context(2, 3)
    train_step(layers, x, bare, bare_sync)
    assert bare.stats["weight_cache_bytes"] is None
    assert "FP8 weight copies" not in bare.report()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(16, 48), (4112, 112), (64, 14336), (3, 5), (0, 16)])
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_transpose_moves_every_byte(device: str, shape: tuple[int, int], fp8_dtype: torch.dtype) -> None:
    # Every byte pattern, NaNs included: the transpose copies bits, it never converts.
    bits = torch.arange(shape[0] * shape[1], dtype=torch.int64).remainder(256).to(torch.uint8).view(shape)
    data = bits.to(device).view(fp8_dtype)
    got = cast.transpose(data)
    assert got.dtype == fp8_dtype and got.shape == shape[::-1] and got.is_contiguous()
    assert torch.equal(got.view(torch.uint8).cpu(), bits.t())
    if device == "cuda" and cast.triton_available():
        assert cast.triton_module("triton_transpose") is not None, "the Triton transpose did not load where Triton runs"
