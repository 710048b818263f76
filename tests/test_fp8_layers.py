"""fp8.LayerNormLinear and fp8.GELU: accuracy against a high-precision reference, bitwise
repeatability, exactly what autograd saves (the bf16 LayerNorm input and its mean/rstd; FP8 data
and one scale), the recomputed wgrad operand being forward's, state dict keys and clear errors.
Runs on CPU (torch's CPU ``_scaled_mm``); the ``cuda`` variants run the same checks on a GPU with
FP8 support and skip cleanly elsewhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from offload import fp8

from offload.engine import marks
from offload import quantized as q
from offload.fp8 import cast
from offload.fp8 import layernorm_linear as lnl_module

from _util import record_saved, rel_err

CUDA_FP8 = torch.cuda.is_available() and fp8.scaled_mm_supported("cuda")
CUDA_ONLY = [pytest.mark.cuda, pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 (sm_89+)")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_ONLY)]
CONFIGS = [
    ("tensorwise", torch.float8_e4m3fn),
    ("tensorwise", torch.float8_e5m2),
    ("rowwise", torch.float8_e4m3fn),
]
K, N = 128, 64


@pytest.fixture(autouse=True)
def _skip_rowwise_where_unsupported(request):
    # torch 2.11's CPU _scaled_mm is per-tensor only; fp8.Linear refuses rowwise there.
    name = request.node.name
    if "rowwise" in name and "cpu" in name and not fp8.rowwise_supported("cpu"):
        pytest.skip(f"rowwise _scaled_mm is not available on CPU in torch {torch.__version__}")


def make_x(shape, device, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)


def make_lnl(device, dtype=torch.bfloat16, scaling="tensorwise", fp8_dtype=torch.float8_e4m3fn, seed=0, **kw):
    """A LayerNormLinear with non-trivial LayerNorm parameters (ones and zeros would hide a
    gamma/beta mix-up)."""
    torch.manual_seed(seed)
    layer = fp8.LayerNormLinear(K, N, scaling=scaling, fp8_dtype=fp8_dtype, device=device, dtype=dtype, **kw)
    if layer.layer_norm_weight is not None:
        with torch.no_grad():
            layer.layer_norm_weight.copy_(1 + 0.3 * make_x((K,), device, dtype, seed=7))
            layer.layer_norm_bias.copy_(0.2 * make_x((K,), device, dtype, seed=8))
    return layer


def run(module, x, dy, retain_graph=False):
    """Output, input gradient and every parameter's gradient (in parameter order)."""
    x = x.detach().clone().requires_grad_(True)
    for p in module.parameters():
        p.grad = None
    y = module(x)
    y.backward(dy, retain_graph=retain_graph)
    return [y.detach(), x.grad] + [p.grad for p in module.parameters()]


def assert_all_equal(a, b, what):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u, v), f"{what}: result {i} differs (max abs diff {(u.double() - v.double()).abs().max().item()})"


# ---------------------------------------------------------------------------------------------
# LayerNormLinear: numerics
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaling,fp8_dtype", CONFIGS)
def test_layernorm_linear_close_to_float64_layernorm_then_linear(scaling, fp8_dtype, dtype, device):
    layer = make_lnl(device, dtype, scaling, fp8_dtype)
    x = make_x((4, 32, K), device, dtype)
    dy = make_x((4, 32, N), device, dtype, seed=2)
    y, dx, dw, db, dgamma, dbeta = run(layer, x, dy)

    # The float64 pair LayerNorm -> Linear, loaded from the FP8 module's state dict (renamed as
    # the module docstring says), on the same rounded inputs.
    ref = torch.nn.Sequential(torch.nn.LayerNorm(K), torch.nn.Linear(K, N)).to(device=device, dtype=torch.float64)
    sd = layer.state_dict()
    ref.load_state_dict({"0.weight": sd["layer_norm_weight"], "0.bias": sd["layer_norm_bias"],
                         "1.weight": sd["weight"], "1.bias": sd["bias"]})
    y_ref, dx_ref, dgamma_ref, dbeta_ref, dw_ref, db_ref = run(ref, x.double(), dy.double())

    assert y.shape == (4, 32, N) and y.dtype == dtype and dx.dtype == dtype
    tol = 0.08 if fp8_dtype == torch.float8_e4m3fn else 0.12
    assert rel_err(y, y_ref) < tol, "forward output too far from LayerNorm -> Linear"
    assert rel_err(dx, dx_ref) < 0.08, "input gradient too far from the reference"  # dgrad: e4m3 dY and W
    assert rel_err(dw, dw_ref) < tol, "weight gradient too far from the reference"
    assert rel_err(dgamma, dgamma_ref) < 0.08 and rel_err(dbeta, dbeta_ref) < 0.08, "LayerNorm gradients too far off"
    assert rel_err(db, db_ref) < 0.01


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling,fp8_dtype", CONFIGS)
@pytest.mark.parametrize("affine", [True, False])
def test_layernorm_linear_is_bitwise_layernorm_then_fp8_linear(scaling, fp8_dtype, affine, device):
    """Fusing changes what is saved, not one bit of the result: forward and every gradient equal
    those of an unfused ``nn.LayerNorm`` -> ``fp8.Linear`` (which saves the FP8 LN output)."""
    layer = make_lnl(device, torch.bfloat16, scaling, fp8_dtype, elementwise_affine=affine)
    ln = torch.nn.LayerNorm(K, elementwise_affine=affine, device=device, dtype=torch.bfloat16)
    lin = fp8.Linear(K, N, scaling=scaling, fp8_dtype=fp8_dtype, device=device, dtype=torch.bfloat16)
    lin.load_state_dict({"weight": layer.weight.detach(), "bias": layer.bias.detach()})
    if affine:
        ln.load_state_dict({"weight": layer.layer_norm_weight.detach(), "bias": layer.layer_norm_bias.detach()})
    x = make_x((64, K), device, torch.bfloat16)
    dy = make_x((64, N), device, torch.bfloat16, seed=2)
    fused = run(layer, x, dy)
    unfused = run(torch.nn.Sequential(ln, lin), x, dy)
    # Parameter order: fused (weight, bias, ln weight, ln bias), unfused (ln weight, ln bias, weight, bias).
    reorder = unfused[:2] + unfused[-2:] + unfused[2:-2]
    assert_all_equal(fused, reorder, "LayerNormLinear vs LayerNorm -> fp8.Linear")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling,fp8_dtype", CONFIGS)
def test_layernorm_linear_bitwise_repeatable(scaling, fp8_dtype, device):
    layer = make_lnl(device, torch.bfloat16, scaling, fp8_dtype)
    x = make_x((2, 32, K), device, torch.bfloat16)
    dy = make_x((2, 32, N), device, torch.bfloat16, seed=2)
    first = run(layer, x, dy)
    for _ in range(2):
        assert_all_equal(first, run(layer, x, dy), "a second identical step")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling,fp8_dtype", CONFIGS)
def test_wgrad_uses_forwards_quantized_layernorm_output(scaling, fp8_dtype, device, monkeypatch):
    """Backward recomputes the LN output for wgrad; the weight gradient must be bitwise the one
    from the LN output quantized in forward (the recompute is exact)."""
    layer = make_lnl(device, torch.bfloat16, scaling, fp8_dtype)
    calls = []

    def recording_quantize(t, *args, **kw):
        calls.append(t.detach().clone())
        return cast.quantize(t, *args, **kw)

    monkeypatch.setattr(lnl_module, "quantize", recording_quantize)
    x = make_x((64, K), device, torch.bfloat16).requires_grad_(True)
    dy = make_x((64, N), device, torch.bfloat16, seed=2)
    y = layer(x)
    forward_ln_out = calls[0]  # forward quantizes exactly one tensor: the LN output
    assert len(calls) == 1
    y.backward(dy)

    assert torch.equal(forward_ln_out, F.layer_norm(x.detach(), (K,), layer.layer_norm_weight, layer.layer_norm_bias))
    dyq = cast.quantize(dy, torch.float8_e4m3fn, scaling, rowwise=False, columnwise=True)
    lnq = cast.quantize(forward_ln_out, fp8_dtype, scaling, rowwise=False, columnwise=True)
    ln_scale = lnq.col_scale_inv if scaling == "tensorwise" else lnq.col_scale_inv.view(1, -1)
    expected = fp8.fp8_gemm(dyq.col, lnq.col.t(), dyq.col_scale_inv, ln_scale, layer.weight.dtype)
    assert torch.equal(layer.weight.grad, expected), "wgrad differs from the one on forward's quantized LN output"


# ---------------------------------------------------------------------------------------------
# LayerNormLinear: what autograd saves, backward variants
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling,fp8_dtype", CONFIGS)
def test_layernorm_linear_saves_only_ln_input_and_stats(scaling, fp8_dtype, device):
    layer = make_lnl(device, torch.bfloat16, scaling, fp8_dtype)
    x = make_x((2, 32, K), device, torch.bfloat16).requires_grad_(True)
    x_in = x * 1  # a non-leaf input, as inside a model
    seen, y = record_saved(lambda: layer(x_in))

    params = [t for t in seen if isinstance(t, torch.nn.Parameter)]
    acts = [t for t in seen if not isinstance(t, torch.nn.Parameter)]
    assert {id(p) for p in params} == {id(layer.weight), id(layer.layer_norm_weight), id(layer.layer_norm_bias)}
    assert len(params) == 3, "each parameter is saved once"
    _, mean_ref, rstd_ref = torch.native_layer_norm(x_in.detach().reshape(-1, K), (K,), layer.layer_norm_weight, layer.layer_norm_bias, layer.eps)
    assert [(a.dtype, tuple(a.shape)) for a in acts] == [
        (torch.bfloat16, (64, K)), (mean_ref.dtype, (64, 1)), (rstd_ref.dtype, (64, 1))
    ], "LayerNormLinear must save only its input, mean and rstd (no LN output, no FP8 copy)"
    saved_x, mean, rstd = acts
    # The input itself (a view of the caller's storage), not a copy; tagged for offloading.
    assert saved_x.untyped_storage().data_ptr() == x_in.untyped_storage().data_ptr()
    assert torch.equal(saved_x, x_in.detach().reshape(-1, K))
    assert marks.is_marked_offload(saved_x) and not marks.is_marked_offload(x_in)
    assert torch.equal(mean, mean_ref) and torch.equal(rstd, rstd_ref)
    activation_bytes = sum(a.nbytes for a in acts)
    assert activation_bytes == 64 * K * 2 + 2 * 64 * mean_ref.element_size()
    y.sum().backward()
    assert x.grad is not None and layer.weight.grad is not None and layer.layer_norm_weight.grad is not None


def test_frozen_weight_needs_no_multiple_of_16_rows_and_skips_the_recompute(monkeypatch):
    layer = make_lnl("cpu")
    layer.weight.requires_grad_(False)
    calls = []
    monkeypatch.setattr(lnl_module, "quantize", lambda t, *a, **k: calls.append(k) or cast.quantize(t, *a, **k))
    x = make_x((20, K), "cpu", torch.bfloat16).requires_grad_(True)  # M=20: fine without wgrad
    layer(x).sum().backward()
    # forward: the LN output rowwise; backward: dY rowwise for dgrad, no columnwise recompute.
    assert calls == [{"rowwise": True, "columnwise": False}, {"rowwise": True, "columnwise": False}]
    assert x.grad.shape == x.shape and layer.weight.grad is None
    assert layer.layer_norm_weight.grad is not None and layer.bias.grad is not None


@pytest.mark.parametrize("device", DEVICES)
def test_layernorm_linear_retain_graph_second_backward_identical(device):
    layer = make_lnl(device)
    x = make_x((32, K), device, torch.bfloat16)
    dy = make_x((32, N), device, torch.bfloat16, seed=2)
    xr = x.clone().requires_grad_(True)
    y = layer(xr)
    y.backward(dy, retain_graph=True)
    first = [xr.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    xr.grad = None
    for p in layer.parameters():
        p.grad = None
    y.backward(dy)
    assert_all_equal(first, [xr.grad] + [p.grad for p in layer.parameters()], "the second backward")


def test_layernorm_linear_state_dict_keys_and_loading_a_layernorm_linear_pair():
    assert list(fp8.LayerNormLinear(32, 16).state_dict()) == ["weight", "bias", "layer_norm_weight", "layer_norm_bias"]
    assert list(fp8.LayerNormLinear(32, 16, bias=False, elementwise_affine=False).state_dict()) == ["weight"]
    layer = fp8.LayerNormLinear(32, 16)
    assert torch.equal(layer.layer_norm_weight, torch.ones(32)) and torch.equal(layer.layer_norm_bias, torch.zeros(32))
    pair = torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 16))
    names = {"0.weight": "layer_norm_weight", "0.bias": "layer_norm_bias", "1.weight": "weight", "1.bias": "bias"}
    layer.load_state_dict({names[k]: v for k, v in pair.state_dict().items()})
    x = make_x((3, 5, 32), "cpu", torch.float32)
    with torch.no_grad():  # M=15 is allowed without a weight gradient
        out = layer(x)
        assert out.shape == (3, 5, 16) and rel_err(out, pair(x)) < 0.08
    assert "eps=1e-05" in repr(layer) and "scaling=tensorwise" in repr(layer)


def test_layernorm_linear_clear_errors():
    with pytest.raises(ValueError, match="in_features=20 must be a positive multiple of 16"):
        fp8.LayerNormLinear(20, 32)
    with pytest.raises(ValueError, match="scaling must be one of"):
        fp8.LayerNormLinear(32, 32, scaling="blockwise")
    with pytest.raises(ValueError, match="dtype must be"):
        fp8.LayerNormLinear(32, 32, dtype=torch.float64)
    layer = fp8.LayerNormLinear(32, 32)
    with pytest.raises(ValueError, match="does not end in in_features=32"):
        layer(torch.randn(16, 48))
    with pytest.raises(ValueError, match="input dtype"):
        layer(torch.ones(16, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"LayerNormLinear: the input has M=10 rows.*multiple of 16"):
        layer(torch.randn(2, 5, 32))
    with torch.no_grad():
        assert layer(torch.randn(2, 5, 32)).shape == (2, 5, 32)
    bf16 = fp8.LayerNormLinear(32, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="LayerNorm parameters are torch.bfloat16 but the input is torch.float32"):
        bf16(torch.randn(16, 32))
    # float32 parameters with a bf16 input are LayerNorm's mixed precision: accepted.
    assert layer(torch.randn(16, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# GELU
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_forward_is_exactly_f_gelu_and_backward_uses_the_fp8_input(approximate, dtype, device):
    act = fp8.GELU(approximate)
    x = make_x((2, 32, 96), device, dtype)
    dy = make_x((2, 32, 96), device, dtype, seed=2)
    y, dx = run(act, x, dy)
    assert torch.equal(y, F.gelu(x, approximate=approximate)), "fp8.GELU's output must be F.gelu's, bit for bit"
    # The documented gradient: gelu_backward at the dequantized FP8 (e4m3, tensorwise) input.
    xq = q.quantize_tensorwise(x.reshape(-1, 96), torch.float8_e4m3fn)
    x_fp8 = xq.dequantize(torch.float32).to(dtype).reshape(x.shape)
    assert torch.equal(dx, torch.ops.aten.gelu_backward(dy, x_fp8, approximate=approximate))
    # ... which approximates the exact one.
    x64 = x.double().requires_grad_(True)
    F.gelu(x64, approximate=approximate).backward(dy.double())
    assert rel_err(dx, x64.grad) < 0.05, "GELU gradient too far from the float64 one"


@pytest.mark.parametrize("device", DEVICES)
def test_gelu_saves_only_fp8_data_and_scale(device):
    act = fp8.GELU()
    x = (make_x((4, 16, 96), device, torch.bfloat16).requires_grad_(True)) * 1
    seen, y = record_saved(lambda: act(x))
    assert [(t.dtype, tuple(t.shape)) for t in seen] == [(torch.float8_e4m3fn, (64, 96)), (torch.float32, (1,))]
    data, scale_inv = seen
    ref = q.quantize_tensorwise(x.detach().reshape(-1, 96), torch.float8_e4m3fn)
    assert torch.equal(data.view(torch.uint8), ref.rowwise_data.view(torch.uint8)) and torch.equal(scale_inv, ref.scale_inv)
    assert all(marks.is_marked_offload(t) for t in seen)
    assert sum(t.nbytes for t in seen) == 64 * 96 + 4  # half of the bf16 input's 2 bytes per element
    y.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_gelu_bitwise_repeatable_and_retain_graph(device):
    act = fp8.GELU("tanh")
    x = make_x((64, 96), device, torch.bfloat16)
    dy = make_x((64, 96), device, torch.bfloat16, seed=2)
    first = run(act, x, dy, retain_graph=True)
    assert_all_equal(first, run(act, x, dy), "a second identical step")
    xr = x.clone().requires_grad_(True)
    y = act(xr)
    y.backward(dy, retain_graph=True)
    g1 = xr.grad.clone()
    xr.grad = None
    y.backward(dy)
    assert torch.equal(g1, xr.grad) and torch.equal(g1, first[1])


def test_gelu_without_grad_quantizes_nothing(monkeypatch):
    from offload.fp8 import gelu as gelu_module

    monkeypatch.setattr(gelu_module, "quantize", lambda *a, **k: pytest.fail("quantized without a gradient to compute"))
    act = fp8.GELU()
    x = make_x((8, 96), "cpu", torch.bfloat16)
    assert torch.equal(act(x), F.gelu(x))
    with torch.no_grad():
        assert torch.equal(act(x.requires_grad_(True)), F.gelu(x))
    assert act(torch.empty(0, 96, requires_grad=True)).shape == (0, 96)


def test_gelu_clear_errors():
    with pytest.raises(ValueError, match=r"approximate must be one of \('none', 'tanh'\), got 'fast'"):
        fp8.GELU("fast")
    act = fp8.GELU()
    with pytest.raises(ValueError, match="input dtype must be float32, bfloat16 or float16, got torch.float64"):
        act(torch.randn(4, 4, dtype=torch.float64, requires_grad=True))
    with pytest.raises(ValueError, match="input dtype"):
        act(torch.ones(4, 4, dtype=torch.int32))
    assert isinstance(act, torch.nn.GELU) and "approximate='none'" in repr(act)
