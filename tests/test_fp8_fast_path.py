"""The fast FP8 path: fused Triton quantization bit-equal to the torch path, FP8 weight copies
cached per weight version, non-finite inputs saturating, no host syncs, CUDA-graph capture.

CPU tests exercise the torch path and the cache; ``cuda`` tests compare the Triton kernels with
the torch path on the GPU and skip cleanly without an FP8 GPU."""

from __future__ import annotations

import pytest
import torch

from offload import fp8
from offload import quantized as q
from offload.fp8 import cast

CUDA_FP8 = torch.cuda.is_available() and fp8.scaled_mm_supported("cuda")
needs_fp8_gpu = [
    pytest.mark.cuda,
    pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 (sm_89+)"),
]
DEVICES = ["cpu", pytest.param("cuda", marks=needs_fp8_gpu)]
FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _same_with_nans(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal where not NaN, and NaN at the same places (a NaN's sign bit may differ)."""
    fa, fb = a.float(), b.float()
    nan = torch.isnan(fa)
    return torch.equal(nan, torch.isnan(fb)) and torch.equal(_bits(a)[~nan], _bits(b)[~nan])


def _layer(device: str, scaling: str = "tensorwise", k: int = 64, n: int = 32, weight_layouts: str = "one") -> fp8.Linear:
    torch.manual_seed(0)
    return fp8.Linear(k, n, scaling=scaling, device=device, dtype=torch.bfloat16, weight_layouts=weight_layouts)


# ---------------------------------------------------------------------------------------------
# non-finite inputs: documented saturation, never a garbage scale
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_non_finite_values_saturate_and_do_not_set_the_scale(device: str, fp8_dtype: torch.dtype) -> None:
    x = torch.tensor([[1.0, -2.0, float("inf"), float("-inf")], [0.5, float("nan"), 4.0, -1.0]] * 8, device=device)
    op = cast.quantize(x, fp8_dtype, "tensorwise", rowwise=True, columnwise=True)
    fmax = q.fp8_max(fp8_dtype)
    # The scale comes from the finite values only: 4.0 maps to the FP8 max.
    assert torch.equal(op.row_scale_inv.cpu(), torch.tensor([4.0 / fmax]))
    row = op.row.float().cpu()
    assert row[0, 2] == fmax and row[0, 3] == -fmax  # inf saturates
    assert torch.isnan(row[1, 1])  # NaN stays NaN: it shows in the result, as without FP8
    assert row[1, 2] == fmax and row[0, 0] == fmax / 4
    assert torch.equal(op.col.float().cpu().nan_to_num(7.0), row.t().nan_to_num(7.0))


@pytest.mark.parametrize("device", DEVICES)
def test_all_non_finite_or_zero_rows_get_scale_one(device: str) -> None:
    x = torch.zeros(16, 32, device=device)
    x[3] = float("inf")
    op = cast.quantize(x, torch.float8_e4m3fn, "tensorwise", rowwise=True, columnwise=False)
    assert op.row_scale_inv.item() == 1.0
    assert op.row.float()[3].eq(448.0).all() and op.row.float()[0].eq(0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_subnormal_amax_caps_the_scale_instead_of_producing_nan(device: str) -> None:
    # 448 / 1e-40 overflows float32: an uncapped scale is inf, and 0 * inf is NaN.
    x = torch.zeros(16, 16, device=device)
    x[0, 0] = 1e-40
    x[0, 1] = -5e-41
    op = cast.quantize(x, torch.float8_e4m3fn, "tensorwise", rowwise=True, columnwise=False)
    row = op.row.float()
    assert not torch.isnan(row).any()
    assert row[0, 0] > 0 and row[0, 1] < 0 and row[1:].eq(0).all()
    assert torch.isfinite(op.row_scale_inv).all() and op.row_scale_inv.item() > 0


# ---------------------------------------------------------------------------------------------
# Triton kernels against the torch path (GPU)
# ---------------------------------------------------------------------------------------------

SHAPES = [(16, 64), (48, 80), (256, 256), (300, 1040), (1024, 4096), (4096, 1024)]


def _torch_path(x: torch.Tensor, fp8_dtype: torch.dtype, scaling: str) -> cast.Operand:
    if scaling == "tensorwise":
        s = q.quantize_tensorwise(x, fp8_dtype, rowwise=True, columnwise=True)
        return cast.Operand(s.rowwise_data, s.scale_inv, s.columnwise_data, s.scale_inv)
    b = q.quantize_blockwise(x, fp8_dtype, rowwise=True, columnwise=True)
    return cast.Operand(b.rowwise_data, b.rowwise_scale_inv, b.columnwise_data, b.columnwise_scale_inv)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 (sm_89+)")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scaling,fp8_dtype", [("tensorwise", torch.float8_e4m3fn), ("tensorwise", torch.float8_e5m2), ("rowwise", torch.float8_e4m3fn)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("special", [False, True])
def test_triton_kernels_match_the_torch_path_bitwise(shape, scaling, fp8_dtype, dtype, special) -> None:
    assert cast.triton_available()
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    x = (torch.randn(shape, device="cuda", generator=g) * 3).to(dtype)
    if special:
        x[0, 0], x[-1, -1], x[1, 2] = float("inf"), float("nan"), float("-inf")
        x[2] = 0  # an all-zero row: scale 1 in rowwise scaling
    got = cast.quantize(x, fp8_dtype, scaling, rowwise=True, columnwise=True)
    ref = _torch_path(x, fp8_dtype, scaling)
    for name, a, b in zip(cast.Operand._fields, got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert a.is_contiguous(), name
        assert _same_with_nans(a, b), name
    # One layout alone gives the same bits as that layout of both.
    only_col = cast.quantize(x, fp8_dtype, scaling, rowwise=False, columnwise=True)
    assert only_col.row is None and _same_with_nans(only_col.col, ref.col)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 (sm_89+)")
def test_triton_kernels_take_a_strided_input() -> None:
    base = torch.randn(64, 192, device="cuda", dtype=torch.bfloat16)
    x = base[:, 32:160]  # row stride 192, unit column stride: no copy needed
    got = cast.quantize(x, torch.float8_e4m3fn, "tensorwise", rowwise=True, columnwise=True)
    ref = _torch_path(x.contiguous(), torch.float8_e4m3fn, "tensorwise")
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, ref))


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 (sm_89+)")
@pytest.mark.parametrize("m", [16, 1024])  # one fused kernel, and the two-kernel path
def test_direct_launch_reuses_compiled_kernels_and_keys_on_alignment(m: int, monkeypatch) -> None:
    from offload.fp8 import triton_cast as tc

    if not tc._DIRECT:
        pytest.skip(f"Triton {tc.triton.__version__}: launches go through Triton's own dispatch")
    base = torch.randn(m * 64 + 8, device="cuda", dtype=torch.bfloat16)
    aligned = base[: m * 64].view(m, 64)
    shifted = base[1 : m * 64 + 1].view(m, 64)  # 2 bytes off: not 16-byte aligned
    launchers = [tc._launch_small_tensorwise, tc._launch_amax_partials, tc._launch_cast_tensorwise]
    for x in (aligned, shifted):
        first = cast.quantize(x, torch.float8_e4m3fn, "tensorwise", rowwise=True, columnwise=True)
        ref = _torch_path(x.contiguous(), torch.float8_e4m3fn, "tensorwise")
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(first, ref))

    class NoDispatch:
        def __getitem__(self, grid):
            raise AssertionError("went through Triton's dispatch")

    for launcher in launchers:
        monkeypatch.setattr(launcher, "_kernel", NoDispatch())
    # Known specializations launch directly, with the same bits as the first (compiling) call.
    for x in (aligned, shifted):
        again = cast.quantize(x, torch.float8_e4m3fn, "tensorwise", rowwise=True, columnwise=True)
        ref = _torch_path(x.contiguous(), torch.float8_e4m3fn, "tensorwise")
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(again, ref))
    # A new fact Triton specializes on (here the row stride) is a new key: it must compile.
    wide = torch.randn(m, 80, device="cuda", dtype=torch.bfloat16)[:, :64]
    with pytest.raises(AssertionError, match="dispatch"):
        cast.quantize(wide, torch.float8_e4m3fn, "tensorwise", rowwise=True, columnwise=True)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 (sm_89+)")
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 16), (300, 1040), (1024, 4096)])
def test_triton_dequantize_matches_the_torch_path_bitwise(fp8_dtype, dtype, shape) -> None:
    assert cast.triton_available()
    g = torch.Generator(device="cuda").manual_seed(shape[0])
    bits = torch.randint(0, 256, shape, device="cuda", dtype=torch.uint8, generator=g)  # every FP8 value, NaNs too
    scale_inv = torch.tensor([3.0e-3], device="cuda")
    ref = q.scaling.dequantize_tensorwise(bits, scale_inv, fp8_dtype, dtype)
    for data in (bits.view(fp8_dtype), bits):  # typed, and the raw bits the engine may hand back
        got = cast.dequantize(data, scale_inv, fp8_dtype, dtype)
        assert got.dtype == dtype and got.shape == shape
        assert _same_with_nans(got, ref)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 (sm_89+)")
def test_gelu_backward_makes_no_float32_copy_of_its_input() -> None:
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    y = fp8.GELU()(x)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y.backward(dy)
    torch.cuda.synchronize()
    # The dequantized input and the gradient: two bfloat16 tensors of x's size. A float32 copy
    # (and its product) would add two to four more.
    assert torch.cuda.max_memory_allocated() - base <= 2 * x.nbytes + (1 << 20)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA_FP8 or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs with FP8")
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_quantize_on_a_device_that_is_not_current(scaling: str) -> None:
    x = torch.randn(256, 512, device="cuda:1", dtype=torch.bfloat16)
    ref = _torch_path(x, torch.float8_e4m3fn, scaling)
    with torch.cuda.device(0):
        got = cast.quantize(x, torch.float8_e4m3fn, scaling, rowwise=True, columnwise=True)
        assert torch.cuda.current_device() == 0
    for a, b in zip(got, ref):
        assert a.device == x.device and _same_with_nans(a, b)


# ---------------------------------------------------------------------------------------------
# the weight cache
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_weight_is_quantized_once_per_version(device: str) -> None:
    layer = _layer(device)
    x = torch.randn(32, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    layer(x).sum().backward()
    first = layer.weight_cache.get(layer.weight, "tensorwise")
    layer(x).sum().backward()
    again = layer.weight_cache.get(layer.weight, "tensorwise")
    assert again is first  # forward, dgrad and the next micro-batch all reuse one copy

    with torch.no_grad():
        layer.weight.mul_(0.5)  # what an optimizer step does: bumps the version counter
    y = layer(x)
    fresh = _layer(device)
    with torch.no_grad():
        fresh.weight.copy_(layer.weight)
    assert torch.equal(y, fresh(x))
    assert layer.weight_cache.get(layer.weight, "tensorwise") is not first


@pytest.mark.parametrize("device", DEVICES)
def test_is_first_microbatch_and_clear_requantize(device: str) -> None:
    layer = _layer(device)
    x = torch.randn(32, 64, device=device, dtype=torch.bfloat16)
    layer(x)
    cached = layer.weight_cache.get(layer.weight, "tensorwise")
    layer.weight.data.mul_(2.0)  # through .data: the version counter does not see it
    assert layer.weight_cache.get(layer.weight, "tensorwise") is cached  # documented hazard
    y = layer(x, is_first_microbatch=True)
    assert layer.weight_cache.get(layer.weight, "tensorwise") is not cached
    layer.weight_cache.clear()
    assert torch.equal(y, layer(x))


@pytest.mark.parametrize("device", DEVICES)
def test_backward_uses_the_forwards_weight_copy_without_a_cache_lookup(device: str) -> None:
    layer = _layer(device)
    lookups = []

    class CountingCache(type(layer.weight_cache)):
        def get(self, weight, scaling, refresh=False):
            lookups.append(refresh)
            return super().get(weight, scaling, refresh)

    layer.weight_cache = CountingCache()
    x = torch.randn(32, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    y1 = layer(x)
    copy_1 = layer.weight_cache.get(layer.weight, "tensorwise")
    y2 = layer(x, is_first_microbatch=True)  # a second micro-batch replaces the cached copy
    assert layer.weight_cache.get(layer.weight, "tensorwise") is not copy_1
    lookups.clear()
    (y1.sum() + y2.sum()).backward()
    assert lookups == []  # dgrad took each forward's own copy
    ref = _layer(device)
    xr = x.detach().clone().requires_grad_(True)
    (ref(xr).sum() * 2).backward()
    assert torch.equal(x.grad, xr.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_weight_changed_in_place_between_forward_and_backward_raises(device: str) -> None:
    layer = _layer(device)
    x = torch.randn(32, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    with torch.no_grad():
        layer.weight.mul_(0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


# ---------------------------------------------------------------------------------------------
# no host syncs, CUDA graphs
# ---------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 (sm_89+)")
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("m", [16, 4096])
@pytest.mark.parametrize("weight_layouts", ["one", "both"])
def test_forward_and_backward_never_sync(scaling: str, m: int, weight_layouts: str) -> None:
    layer = _layer("cuda", scaling, k=1024, n=512, weight_layouts=weight_layouts)
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x).sum().backward()  # first call: Triton compiles, the cache fills
    dy = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            layer(x).backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 (sm_89+)")
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("weight_layouts", ["one", "both"])
def test_captured_step_replays_bitwise_and_sees_weight_updates(scaling: str, weight_layouts: str) -> None:
    # With one layout the graph also records dgrad's transpose (or rowwise requantization).
    layer = _layer("cuda", scaling, k=256, n=128, weight_layouts=weight_layouts)
    static_x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    static_dy = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)

    def eager() -> list[torch.Tensor]:
        x = static_x.detach().clone().requires_grad_(True)
        layer.weight.grad = layer.bias.grad = None
        y = layer(x)
        y.backward(static_dy)
        return [y.detach().clone(), x.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone()]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm up on a side stream, as torch.cuda.graphs asks
            eager()
    torch.cuda.current_stream().wait_stream(side)
    layer.weight.grad = layer.bias.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = layer(static_x)
        static_y.backward(static_dy)
    # The gradients the graph writes on every replay (eager() below swaps in new .grad tensors).
    static_out = [static_y, static_x.grad, layer.weight.grad, layer.bias.grad]

    def replay() -> list[torch.Tensor]:
        graph.replay()
        return [t.detach().clone() for t in static_out]

    for _ in range(2):
        got = replay()
        for a, b in zip(got, eager()):
            assert torch.equal(a, b)
    # An optimizer step between replays: the graph quantizes the new weight (the cache is
    # bypassed while capturing, or the replay would use the old FP8 copy).
    with torch.no_grad():
        layer.weight.mul_(-0.75)
    got = replay()
    for a, b in zip(got, eager()):
        assert torch.equal(a, b)
