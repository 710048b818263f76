"""fp8.Linear: accuracy against a high-precision reference, bitwise repeatability, what autograd
saves (only the marked columnwise FP8 input + the weight Parameter), GEMMs on restored views, and
clear errors. Runs on CPU (torch's CPU ``_scaled_mm``); the ``cuda`` variants run the same checks on
a GPU with FP8 support and skip cleanly elsewhere."""

from __future__ import annotations

import pytest
import torch

from offload import fp8

from offload.engine import marks
from offload import quantized as q
from offload.host.layout import plan_layout_py

CUDA_FP8 = torch.cuda.is_available() and fp8.scaled_mm_supported("cuda")
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 (sm_89+)"),
        ],
    ),
]
CONFIGS = [
    ("tensorwise", torch.float8_e4m3fn),
    ("tensorwise", torch.float8_e5m2),
    ("rowwise", torch.float8_e4m3fn),
]


@pytest.fixture(autouse=True)
def _skip_rowwise_where_unsupported(request):
    # torch 2.11's CPU _scaled_mm is per-tensor only; fp8.Linear refuses rowwise there (tested below).
    name = request.node.name
    if "rowwise" in name and "cpu" in name and not fp8.rowwise_supported("cpu"):
        pytest.skip(f"rowwise _scaled_mm is not available on CPU in torch {torch.__version__}")


def test_rowwise_refused_clearly_where_unsupported() -> None:
    if fp8.rowwise_supported("cpu"):
        pytest.skip("this torch's CPU _scaled_mm supports rowwise scales")
    layer = fp8.Linear(32, 32, scaling="rowwise")
    with pytest.raises(ValueError, match="rowwise' is not supported by torch._scaled_mm on cpu"):
        layer(torch.randn(16, 32))


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach().float(), ref.detach().float()
    return float((a - ref).norm() / ref.norm())


def make_layer(scaling, fp8_dtype, device, dtype, k=128, n=64, bias=True, seed=0):
    torch.manual_seed(seed)
    return fp8.Linear(
        k, n, bias=bias, scaling=scaling, fp8_dtype=fp8_dtype, device=device, dtype=dtype
    )


def make_x(shape, device, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)


def run(layer, x, dy):
    x = x.detach().clone().requires_grad_(True)
    for p in layer.parameters():
        p.grad = None
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad


# ---------------------------------------------------------------------------------------------
# numerics
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaling,fp8_dtype", CONFIGS)
def test_close_to_high_precision_reference(scaling, fp8_dtype, dtype, device):
    layer = make_layer(scaling, fp8_dtype, device, dtype)
    x = make_x((4, 32, 128), device, dtype)
    dy = make_x((4, 32, 64), device, dtype, seed=2)
    y, dx, dw, db = run(layer, x, dy)

    # float32 reference on the same (rounded) inputs and parameters.
    w32, b32 = layer.weight.detach().float(), layer.bias.detach().float()
    x32 = x.float().requires_grad_(True)
    w32.requires_grad_(True)
    y32 = torch.nn.functional.linear(x32, w32, b32)
    y32.backward(dy.float())

    assert y.shape == (4, 32, 64) and y.dtype == dtype
    assert dx.shape == x.shape and dx.dtype == dtype
    assert dw.dtype == layer.weight.dtype
    # Two FP8 operands: ~2-3 % each for e4m3 (3 mantissa bits), more for an e5m2 input.
    tol = 0.08 if fp8_dtype == torch.float8_e4m3fn else 0.12
    assert rel_err(y, y32) < tol
    assert rel_err(dx, x32.grad) < 0.08  # dgrad uses e4m3 dY and W whatever fp8_dtype
    assert rel_err(dw, w32.grad) < tol
    # Bias grad: dY summed over tokens in the gradient's dtype.
    assert torch.equal(db, dy.reshape(-1, 64).sum(0).to(layer.bias.dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling,fp8_dtype", CONFIGS)
def test_bitwise_repeatable(scaling, fp8_dtype, device):
    layer = make_layer(scaling, fp8_dtype, device, torch.bfloat16)
    x = make_x((64, 128), device, torch.bfloat16)
    dy = make_x((64, 64), device, torch.bfloat16, seed=2)
    first = run(layer, x, dy)
    for _ in range(2):
        again = run(layer, x, dy)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_matches_explicit_fp8_gemms(scaling, device):
    """The forward is exactly one _scaled_mm of the quantized operands, the bias added in its
    epilogue."""
    layer = make_layer(scaling, torch.float8_e4m3fn, device, torch.bfloat16)
    x = make_x((32, 128), device, torch.bfloat16)
    with torch.no_grad():
        y = layer(x)
    if scaling == "tensorwise":
        xq = q.quantize_tensorwise(x)
        wq = q.quantize_tensorwise(layer.weight.detach())
        ref = fp8.fp8_gemm(
            xq.rowwise_data, wq.rowwise_data.t(), xq.scale_inv, wq.scale_inv, torch.bfloat16,
            bias=layer.bias.detach(),
        )
    else:
        xq = q.quantize_blockwise(x)
        wq = q.quantize_blockwise(layer.weight.detach())
        ref = fp8.fp8_gemm(
            xq.rowwise_data,
            wq.rowwise_data.t(),
            xq.rowwise_scale_inv,
            wq.rowwise_scale_inv.reshape(1, -1),
            torch.bfloat16,
            bias=layer.bias.detach(),
        )
    assert torch.equal(y, ref)


# ---------------------------------------------------------------------------------------------
# what autograd saves
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling,fp8_dtype", CONFIGS)
def test_saves_only_marked_columnwise_input(scaling, fp8_dtype, device):
    layer = make_layer(scaling, fp8_dtype, device, torch.bfloat16)
    x = make_x((2, 32, 128), device, torch.bfloat16).requires_grad_(True)
    seen = []

    def pack(t):
        seen.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)

    params = [t for t in seen if isinstance(t, torch.nn.Parameter)]
    acts = [t for t in seen if not isinstance(t, torch.nn.Parameter)]
    assert len(params) == 1 and params[0] is layer.weight
    x2 = x.detach().reshape(-1, 128)
    if scaling == "tensorwise":
        ref = q.quantize_tensorwise(x2, fp8_dtype, rowwise=False, columnwise=True)
        expect = [ref.columnwise_data, ref.scale_inv]
    else:
        ref = q.quantize_blockwise(x2, fp8_dtype, rowwise=False, columnwise=True)
        expect = [ref.columnwise_data, ref.columnwise_scale_inv]
    # Exactly the columnwise data (K, M) and its scale, nothing else (no rowwise copy, no amax,
    # no bf16 input).
    assert len(acts) == len(expect)
    for got, exp in zip(acts, expect):
        assert got.dtype == exp.dtype and got.shape == exp.shape
        assert torch.equal(
            got.view(torch.uint8) if got.dtype != torch.float32 else got,
            exp.view(torch.uint8) if exp.dtype != torch.float32 else exp,
        )
        assert marks.is_marked_offload(got)
        assert not marks.is_marked_keep(got)
    assert acts[0].shape == (128, 64) and acts[0].is_contiguous()

    y.backward(torch.ones_like(y))
    assert x.grad is not None and layer.weight.grad is not None


def test_frozen_weight_saves_no_activation():
    layer = make_layer("tensorwise", torch.float8_e4m3fn, "cpu", torch.bfloat16)
    layer.weight.requires_grad_(False)
    x = make_x((20, 128), "cpu", torch.bfloat16).requires_grad_(True)  # M=20 is fine without wgrad
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        y = layer(x)
    assert len(seen) == 1 and seen[0] is layer.weight
    y.sum().backward()
    assert x.grad.shape == x.shape and layer.weight.grad is None


class _EngineSim:
    """Pack hook that moves every non-Parameter saved tensor to 'host' bytes; unpack hands it
    back as a typed view of ONE uint8 buffer (256-byte aligned offsets), like the offload engine."""

    def __init__(self):
        self.entries = []  # (host uint8 bytes, dtype, shape, stride)
        self.buf = None
        self.views = {}

    def pack(self, t):
        if isinstance(t, torch.nn.Parameter):
            return t
        assert t.is_contiguous()
        host = (
            t.detach().reshape(-1).view(torch.uint8).cpu().clone()
            if t.dtype != torch.uint8
            else t.detach().reshape(-1).cpu().clone()
        )
        self.entries.append((host, t.dtype, tuple(t.shape), tuple(t.stride()), t.device))
        return len(self.entries) - 1

    def unpack(self, h):
        if isinstance(h, torch.Tensor):
            return h
        if self.buf is None:
            offsets, total = plan_layout_py([e[0].numel() for e in self.entries])
            self.buf = torch.zeros(total + 256, dtype=torch.uint8, device=self.entries[0][4])
            for (host, dtype, shape, stride, _), off in zip(self.entries, offsets):
                self.buf[off : off + host.numel()].copy_(host)
                typed = self.buf[off : off + host.numel()].view(dtype)
                self.views[len(self.views)] = typed.as_strided(
                    shape, stride, typed.storage_offset()
                )
        return self.views[h]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling,fp8_dtype", CONFIGS)
def test_grads_bitwise_equal_through_restored_views(scaling, fp8_dtype, device):
    layer = make_layer(scaling, fp8_dtype, device, torch.bfloat16)
    x = make_x((64, 128), device, torch.bfloat16)
    dy = make_x((64, 64), device, torch.bfloat16, seed=2)
    plain = run(layer, x, dy)

    sim = _EngineSim()
    xr = x.detach().clone().requires_grad_(True)
    for p in layer.parameters():
        p.grad = None
    with torch.autograd.graph.saved_tensors_hooks(sim.pack, sim.unpack):
        y = layer(xr)
    y.backward(dy)
    assert sim.buf is not None and len(sim.entries) == 2
    for a, b in zip(plain, (y.detach(), xr.grad, layer.weight.grad, layer.bias.grad)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_gemm_on_restored_views_equals_original(scaling, device):
    """The wgrad GEMM on storage components restored as uint8-buffer views is bitwise the GEMM
    on the originals."""
    x = make_x((64, 128), device, torch.bfloat16)
    dy = make_x((64, 48), device, torch.bfloat16, seed=2)
    if scaling == "tensorwise":
        xs = q.quantize_tensorwise(x, rowwise=False, columnwise=True, as_uint8=True)
        ds = q.quantize_tensorwise(dy, rowwise=False, columnwise=True)

        def wgrad(s):
            return fp8.fp8_gemm(
                ds.columnwise_data,
                s.columnwise_data.view(s.fp8_dtype).t(),
                ds.scale_inv,
                s.scale_inv,
                torch.float32,
            )

    else:
        xs = q.quantize_blockwise(x, rowwise=False, columnwise=True, as_uint8=True)
        ds = q.quantize_blockwise(dy, rowwise=False, columnwise=True)

        def wgrad(s):
            return fp8.fp8_gemm(
                ds.columnwise_data,
                s.columnwise_data.view(s.fp8_dtype).t(),
                ds.columnwise_scale_inv,
                s.columnwise_scale_inv.reshape(1, -1),
                torch.float32,
            )

    ref = wgrad(xs)
    tensors, r = xs.prepare_for_saving()
    sim = _EngineSim()
    handles = [None if t is None else sim.pack(t) for t in tensors]
    views = [None if h is None else sim.unpack(h) for h in handles]
    r.restore_from_saved(views)
    for t in xs.components():
        assert t.untyped_storage().data_ptr() == sim.buf.untyped_storage().data_ptr()
    assert xs.columnwise_data.dtype == torch.uint8
    assert torch.equal(wgrad(xs), ref)


def test_retain_graph_second_backward_is_identical():
    layer = make_layer("tensorwise", torch.float8_e4m3fn, "cpu", torch.bfloat16)
    x = make_x((32, 128), "cpu", torch.bfloat16).requires_grad_(True)
    y = layer(x)
    y.sum().backward(retain_graph=True)
    g1 = (x.grad.clone(), layer.weight.grad.clone())
    x.grad = None
    layer.weight.grad = None
    y.sum().backward()
    assert torch.equal(g1[0], x.grad) and torch.equal(g1[1], layer.weight.grad)


# ---------------------------------------------------------------------------------------------
# drop-in behaviour and errors
# ---------------------------------------------------------------------------------------------


def test_drop_in_for_nn_linear():
    layer = fp8.Linear(32, 16, bias=False)
    assert isinstance(layer, torch.nn.Linear)
    assert layer.weight.shape == (16, 32) and layer.bias is None
    assert set(layer.state_dict()) == set(torch.nn.Linear(32, 16, bias=False).state_dict())
    ref = torch.nn.Linear(32, 16)
    layer2 = fp8.Linear(32, 16)
    layer2.load_state_dict(ref.state_dict())
    x = make_x((3, 5, 32), "cpu", torch.float32)
    with torch.no_grad():  # M=15 is allowed without a weight gradient
        out = layer2(x)
    assert out.shape == (3, 5, 16)
    assert rel_err(out, ref(x)) < 0.08
    assert "scaling=tensorwise" in repr(layer2)


def test_clear_errors():
    with pytest.raises(ValueError, match="in_features=20 must be a positive multiple of 16"):
        fp8.Linear(20, 32)
    with pytest.raises(ValueError, match="out_features=24 must be a positive multiple of 16"):
        fp8.Linear(32, 24)
    with pytest.raises(ValueError, match="fp8_dtype"):
        fp8.Linear(32, 32, fp8_dtype=torch.float16)
    with pytest.raises(ValueError, match="scaling must be one of"):
        fp8.Linear(32, 32, scaling="blockwise")
    with pytest.raises(ValueError, match="rowwise.*e4m3fn only"):
        fp8.Linear(32, 32, scaling="rowwise", fp8_dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="dtype must be"):
        fp8.Linear(32, 32, dtype=torch.float64)
    layer = fp8.Linear(32, 32)
    with pytest.raises(ValueError, match="does not end in in_features=32"):
        layer(torch.randn(16, 48))
    with pytest.raises(ValueError, match="input dtype"):
        layer(torch.ones(16, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"M=10 rows.*multiple of 16"):
        layer(torch.randn(2, 5, 32))
    with torch.no_grad():
        assert layer(torch.randn(2, 5, 32)).shape == (2, 5, 32)
    assert fp8.scaled_mm_supported("cpu")


def test_fp8_gemm_rejects_non_fp8_operands():
    a = q.quantize_tensorwise(torch.randn(16, 32), as_uint8=True)
    one = torch.ones(1)
    with pytest.raises(ValueError, match=r"uint8 FP8 bits: pass t.view\(fp8_dtype\)"):
        fp8.fp8_gemm(a.rowwise_data, a.rowwise_data.t(), one, one, torch.float32)
    e5 = a.rowwise_data.view(torch.float8_e5m2)
    with pytest.raises(ValueError, match="e5m2 x e5m2"):
        fp8.fp8_gemm(e5, e5.t(), one, one, torch.float32)
