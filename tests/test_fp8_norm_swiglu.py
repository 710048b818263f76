"""fp8.RMSNorm and fp8.SwiGLU with the fp8.Linears they feed: outputs bit for bit those of HF's
ops, gradients within their stated tolerance of a float64 reference, exactly what autograd saves
(the norm's input and rstd; FP8 copies of gate and up), one quantization of a norm output shared
by its Linears in forward and in backward, and the wgrad operands remade in backward. Runs on CPU
(torch's CPU ``_scaled_mm``); the ``cuda`` variants run the same checks on an FP8 GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from offload import fp8
from offload.fp8 import cast
from offload.fp8 import input_source as source_module
from offload.fp8 import rmsnorm as rmsnorm_module
from offload.fp8 import swiglu as swiglu_module

from _util import record_saved, rel_err

CUDA_FP8 = torch.cuda.is_available() and fp8.scaled_mm_supported("cuda")
CUDA_ONLY = [pytest.mark.cuda, pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 (sm_89+)")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_ONLY)]
CONFIGS = [("tensorwise", torch.float8_e4m3fn), ("tensorwise", torch.float8_e5m2), ("rowwise", torch.float8_e4m3fn)]
K, I = 64, 128  # hidden and intermediate widths
OUTS = (128, 32, 32)  # q, k, v widths: distinct from K, so a quantization of the norm output is recognisable
# Tolerances (relative L2 error against float64 on the same rounded inputs):
NORM_TOL = 0.01  # RMSNorm's gradients: bf16 rounding of x, dy and the results
SWIGLU_TOL = 0.08  # SwiGLU's gradients at e4m3-rounded gate and up


@pytest.fixture(autouse=True)
def _skip_rowwise_where_unsupported(request):
    name = request.node.name
    if "rowwise" in name and "cpu" in name and not fp8.rowwise_supported("cpu"):
        pytest.skip(f"rowwise _scaled_mm is not available on CPU in torch {torch.__version__}")


class ReferenceRMSNorm(nn.Module):
    """HF ``LlamaRMSNorm``'s forward as its source states it (checked against HF's class below
    where transformers is installed), run by plain autograd."""

    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * xf.to(x.dtype)


def rand(shape, device, dtype, seed=1, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=g)).to(device=device, dtype=dtype)


def reference_norm(device, dtype=torch.bfloat16) -> ReferenceRMSNorm:
    norm = ReferenceRMSNorm(K).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * rand((K,), device, dtype, seed=7))  # ones would hide a weight mix-up
    return norm


def linears(device, scaling="tensorwise", fp8_dtype=torch.float8_e4m3fn, outs=OUTS, k=K, seed=0):
    torch.manual_seed(seed)
    return nn.ModuleList(fp8.Linear(k, n, bias=False, scaling=scaling, fp8_dtype=fp8_dtype, device=device, dtype=torch.bfloat16) for n in outs)


def norm_step(norm, lins, x, retain_graph=False):
    """The norm feeding every Linear, as in a Llama layer: outputs, input grad, norm weight grad,
    Linear weight grads."""
    for p in list(norm.parameters()) + list(lins.parameters()):
        p.grad = None
    xin = x.detach().clone().requires_grad_(True)
    y = norm(xin * 1)  # a non-leaf input, as inside a model
    outs = [lin(y) for lin in lins]
    sum((o.float() ** 2).sum() for o in outs).backward(retain_graph=retain_graph)
    return [o.detach() for o in outs], xin.grad, norm.weight.grad, [lin.weight.grad for lin in lins]


# ---------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------


def assert_hfs_output(device, got, expected):
    """Bit for bit on the torch path (CPU). From the fused CUDA kernel, whose mean square sums in
    its own order (see offload.fp8.rmsnorm), within two roundings of the output's dtype: a last-bit
    change in rstd can move the normalized x by one rounding and the weight's product by another."""
    if device == "cpu":
        assert torch.equal(got, expected)
        return
    assert got.dtype == expected.dtype and got.shape == expected.shape
    rtol = 2.0 ** -6 if got.dtype == torch.bfloat16 else 2.0 ** -20
    assert torch.allclose(got.float(), expected.float(), rtol=rtol, atol=0.0), (got.float() - expected.float()).abs().max()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rmsnorm_output_is_hf_llama_rmsnorms(device, dtype):
    transformers = pytest.importorskip("transformers")
    hf = transformers.models.llama.modeling_llama.LlamaRMSNorm(K, eps=1e-5).to(device=device, dtype=dtype)
    ours_ref = reference_norm(device, dtype)
    ours_ref.variance_epsilon = 1e-5
    hf.load_state_dict(ours_ref.state_dict())
    ours = fp8.RMSNorm.from_module(hf)
    assert ours.weight is hf.weight and ours.variance_epsilon == 1e-5
    assert list(ours.state_dict()) == list(hf.state_dict())
    x = rand((2, 32, K), device, dtype, scale=3.0)
    with torch.no_grad():
        assert torch.equal(ours_ref(x), hf(x))
        assert torch.equal(rmsnorm_module.rms_norm_torch(x, hf.weight, 1e-5)[0], hf(x))
        assert_hfs_output(device, ours(x), hf(x))
    # With autograd on too (the autograd Function's path).
    assert_hfs_output(device, ours(x.requires_grad_(True)), hf(x))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rmsnorm_gradients_close_to_float64(device, dtype):
    ref = reference_norm(device, dtype)
    ours = fp8.RMSNorm.from_module(ref)
    x = rand((4, 32, K), device, dtype, scale=3.0)
    dy = rand((4, 32, K), device, dtype, seed=2)

    def grads(norm, x, dy):
        x = x.detach().clone().requires_grad_(True)
        norm.weight.grad = None
        norm(x).backward(dy)
        return x.grad, norm.weight.grad

    dx, dw = grads(ours, x, dy)
    ref64 = ReferenceRMSNorm(K).to(device=device, dtype=torch.float64)
    ref64.load_state_dict(ref.state_dict())
    dx64, dw64 = grads(ref64, x.double(), dy.double())
    tol = NORM_TOL if dtype == torch.bfloat16 else 1e-5
    assert dx.dtype == dtype and dw.dtype == dtype
    assert rel_err(dx, dx64) < tol, f"input gradient off by {rel_err(dx, dx64):.2e}"
    assert rel_err(dw, dw64) < tol, f"weight gradient off by {rel_err(dw, dw64):.2e}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling,fp8_dtype", CONFIGS)
def test_norm_then_fp8_linears_bitwise_those_of_plain_fp8_linears(device, scaling, fp8_dtype):
    """Outputs and every Linear's gradients bit for bit those of the same norm's output, copied
    (so without its input source), feeding plain fp8.Linears, which quantize and save their own
    copies: the shared quantization and the remade wgrad operand change what is saved, not one
    bit. The norm's own gradients come from its closed form: within NORM_TOL of autograd's graph
    of HF's ops."""
    ref = reference_norm(device)
    ours = fp8.RMSNorm.from_module(ref)
    lins = linears(device, scaling, fp8_dtype)
    x = rand((2, 32, K), device, torch.bfloat16, scale=3.0)
    out_copy, dx_copy, dw_copy, lin_copy = norm_step(CopiedOutput(ours), lins, x)
    out, dx, dw, lin = norm_step(ours, lins, x)
    for a, b in zip(out + lin, out_copy + lin_copy):
        assert torch.equal(a, b), "a Linear's output or weight gradient differs from plain fp8.Linears'"
    assert torch.equal(dx, dx_copy) and torch.equal(dw, dw_copy)
    _, dx_ref, dw_ref, _ = norm_step(ref, lins, x)
    assert rel_err(dx, dx_ref) < NORM_TOL and rel_err(dw, dw_ref) < NORM_TOL


class CopiedOutput(nn.Module):
    """``norm``'s output copied: the same values and gradients, and no input source on it."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.weight = norm.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x).clone()
        assert not hasattr(y, fp8.linear.INPUT_SOURCE_ATTR)
        return y


@pytest.mark.parametrize("device", DEVICES)
def test_norm_and_its_linears_save_only_the_norm_input_and_rstd(device):
    norm = fp8.RMSNorm.from_module(reference_norm(device))
    lins = linears(device)
    x = rand((2, 32, K), device, torch.bfloat16).requires_grad_(True)
    x_in = x * 1

    def run():
        y = norm(x_in)
        return [lin(y) for lin in lins]

    seen, _ = record_saved(run)
    acts = {id(t): t for t in seen if not isinstance(t, nn.Parameter)}
    assert len(acts) == 2, f"saved {[(t.dtype, tuple(t.shape)) for t in acts.values()]}"
    saved_x, rstd = acts.values()
    assert saved_x is x_in, "the norm input itself is saved (the residual stream, no copy)"
    assert rstd.dtype == torch.float32 and rstd.shape == (2, 32, 1)
    assert all(getattr(t, "_offload_activation", False) for t in acts.values()), "v1 moves only marked tensors"
    params = {id(t) for t in seen if isinstance(t, nn.Parameter)}
    assert params == {id(norm.weight)} | {id(lin.weight) for lin in lins}


@pytest.mark.parametrize("device", DEVICES)
def test_norm_output_is_quantized_once_for_all_its_linears(device, monkeypatch):
    calls = []

    def counting_quantize(t, *args, **kw):
        calls.append((tuple(t.shape), kw["rowwise"], kw["columnwise"]))
        return cast.quantize(t, *args, **kw)

    monkeypatch.setattr(source_module, "quantize", counting_quantize)
    norm = fp8.RMSNorm.from_module(reference_norm(device))
    lins = linears(device)
    x = rand((2, 32, K), device, torch.bfloat16).requires_grad_(True)
    y = norm(x * 1)
    outs = [lin(y) for lin in lins]
    assert calls == [((64, K), True, False)], f"forward quantized the norm output as {calls}"
    loss = sum((o.float() ** 2).sum() for o in outs)
    for _ in range(2):  # a retained graph's second backward shares it again
        calls.clear()
        loss.backward(retain_graph=True)
        remade = [c for c in calls if c[0] == (64, K)]
        assert remade == [((64, K), False, True)], f"backward remade the wgrad operand as {remade}"


@pytest.mark.parametrize("device", DEVICES)
def test_retained_graph_backward_twice_is_bitwise(device):
    norm = fp8.RMSNorm.from_module(reference_norm(device))
    lins = linears(device)
    x = rand((2, 32, K), device, torch.bfloat16)
    first = norm_step(norm, lins, x)
    xin = x.clone().requires_grad_(True)
    y = norm(xin * 1)
    loss = sum((lin(y).float() ** 2).sum() for lin in lins)
    for _ in range(2):
        for p in list(norm.parameters()) + list(lins.parameters()):
            p.grad = None
        xin.grad = None
        loss.backward(retain_graph=True)
        assert torch.equal(xin.grad, first[1]) and torch.equal(norm.weight.grad, first[2])
        assert all(torch.equal(lin.weight.grad, g) for lin, g in zip(lins, first[3]))


@pytest.mark.parametrize("device", DEVICES)
def test_norm_output_changed_in_place_falls_back_to_a_saved_copy(device):
    """A source whose output was changed in place would remake the wrong input: the Linear then
    quantizes and saves its own copy, and its weight gradient is that of the changed output."""
    norm = fp8.RMSNorm.from_module(reference_norm(device))
    (lin,) = linears(device, outs=(32,))
    x = rand((2, 32, K), device, torch.bfloat16).requires_grad_(True)

    def run():
        y = norm(x * 1)
        y.mul_(2.0)
        return lin(y), y

    seen, (out, y) = record_saved(run)
    assert any(t.dtype == torch.float8_e4m3fn and t.shape == (K, 64) for t in seen), "no FP8 copy saved"
    dy = rand((2, 32, 32), device, torch.bfloat16, seed=3)
    out.backward(dy)
    got = lin.weight.grad.clone()
    lin.weight.grad = None
    lin(y.detach()).backward(dy)  # plain fp8.Linear on the changed output
    assert torch.equal(got, lin.weight.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_norm_matches_and_saves_nothing(device):
    norm = fp8.RMSNorm.from_module(reference_norm(device))
    lins = linears(device)
    x = rand((2, 32, K), device, torch.bfloat16)
    with torch.no_grad():
        plain_output = fp8.rmsnorm.rms_norm(x, norm.weight, norm.variance_epsilon)[0]  # carries no source
        expected = [lin(plain_output) for lin in lins]
        seen, got = record_saved(lambda: [lin(norm(x)) for lin in lins])
    assert seen == [] and all(torch.equal(a, b) for a, b in zip(got, expected))


def test_rmsnorm_errors_say_what_to_do():
    norm = fp8.RMSNorm(K)
    with pytest.raises(ValueError, match=r"expects a tensor \(\.\.\., 64\)"):
        norm(torch.randn(2, 32))
    with pytest.raises(ValueError, match="dtype must be float32, bfloat16 or float16"):
        norm(torch.ones(2, K, dtype=torch.int32))
    with pytest.raises(ValueError, match="not an HF-style RMSNorm"):
        fp8.RMSNorm.from_module(nn.LayerNorm(K))


# ---------------------------------------------------------------------------------------------
# SwiGLU
# ---------------------------------------------------------------------------------------------


def gate_up(device, dtype=torch.bfloat16, rows=64):
    return rand((rows, I), device, dtype, seed=4, scale=2.0), rand((rows, I), device, dtype, seed=5)


@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_output_is_silu_times_up_and_saves_only_fp8_copies(device):
    gate, up = (t.requires_grad_(True) for t in gate_up(device))
    seen, out = record_saved(lambda: fp8.SwiGLU()(gate * 1, up * 1))
    assert torch.equal(out, F.silu(gate) * up)
    kinds = sorted((str(t.dtype), tuple(t.shape)) for t in seen)
    assert kinds == sorted([("torch.float8_e4m3fn", (64, I))] * 2 + [("torch.float32", (1,))] * 2), kinds
    assert all(getattr(t, "_offload_activation", False) for t in seen)


@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_gradients_close_to_float64(device):
    gate, up = gate_up(device)
    dp = rand((64, I), device, torch.bfloat16, seed=6)

    def grads(g, u, fn):
        g, u = g.detach().clone().requires_grad_(True), u.detach().clone().requires_grad_(True)
        fn(g, u).backward(dp.to(g.dtype))
        return g.grad, u.grad

    dg, du = grads(gate, up, fp8.SwiGLU())
    dg64, du64 = grads(gate.double(), up.double(), lambda g, u: F.silu(g) * u)
    assert dg.dtype == torch.bfloat16
    assert rel_err(dg, dg64) < SWIGLU_TOL and rel_err(du, du64) < SWIGLU_TOL, (rel_err(dg, dg64), rel_err(du, du64))


def swiglu_mlp(device, down_fp8=True, seed=0):
    torch.manual_seed(seed)
    kw = {"bias": False, "device": device, "dtype": torch.bfloat16}
    down = fp8.Linear(I, K, **kw) if down_fp8 else nn.Linear(I, K, **kw)
    return fp8.SwiGLUMLP(fp8.Linear(K, I, **kw), fp8.Linear(K, I, **kw), down)


@pytest.mark.parametrize("device", DEVICES)
def test_down_proj_saves_no_copy_and_its_wgrad_is_from_the_remade_product(device):
    mlp = swiglu_mlp(device)
    x = rand((64, K), device, torch.bfloat16).requires_grad_(True)
    seen, out = record_saved(lambda: mlp(x * 1))
    acts = [t for t in seen if not isinstance(t, nn.Parameter)]
    assert not any(t.shape == (I, 64) for t in acts), "down_proj saved a copy of its input"
    dy = rand((64, K), device, torch.bfloat16, seed=3)
    out.backward(dy)
    # The SwiGLU saves (g8, g_scale, u8, u_scale), in that order, after gate_proj's and up_proj's copies of x.
    first = next(i for i, t in enumerate(acts) if t.shape == (64, I))
    g8, g_scale, u8, u_scale = acts[first:first + 4]
    g = cast.dequantize(g8, g_scale, torch.float8_e4m3fn, torch.bfloat16)
    u = cast.dequantize(u8, u_scale, torch.float8_e4m3fn, torch.bfloat16)
    pq = cast.quantize(F.silu(g) * u, torch.float8_e4m3fn, "tensorwise", rowwise=False, columnwise=True)
    dyq = cast.quantize(dy, torch.float8_e4m3fn, "tensorwise", rowwise=False, columnwise=True)
    expected = fp8.fp8_gemm(dyq.col, pq.col.t(), dyq.col_scale_inv, pq.col_scale_inv, torch.bfloat16)
    assert torch.equal(mlp.down_proj.weight.grad, expected)


def torch_path(monkeypatch, module):
    """Send ``module``'s op (offload.fp8.rmsnorm or .swiglu) to its torch implementation."""
    monkeypatch.setattr(module, "_fused", lambda *tensors: None)


@pytest.mark.cuda
@pytest.mark.skipif(not (CUDA_FP8 and cast.triton_available()), reason="needs an FP8 GPU and Triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [64, 1000])
def test_fused_swiglu_gives_the_torch_ops_bits(monkeypatch, dtype, rows):
    """The Triton kernels (forward with its FP8 copies, the remade product, backward) against the
    torch ops they replace: the same bits."""
    gate, up = gate_up("cuda", dtype, rows)
    gate[0, :3] = torch.tensor([30.0, -30.0, -100.0])  # exp's far range: 1 + exp(100) is inf
    dp = rand((rows, I), "cuda", dtype, seed=6)
    fused = swiglu_module.swiglu_forward(gate, up)
    remade = swiglu_module.remake_product(fused[1], dtype)
    grads = swiglu_module.swiglu_grads(dp, fused[1])
    torch_path(monkeypatch, swiglu_module)
    plain = swiglu_module.swiglu_forward(gate, up)
    assert torch.equal(fused[0], plain[0]) and torch.equal(fused[0], F.silu(gate) * up), "forward product"
    for a, b in zip(fused[1], plain[1]):
        assert a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                                                  b.view(torch.uint8) if b.dtype != torch.float32 else b)
    assert torch.equal(remade, swiglu_module.remake_product(plain[1], dtype)), "remade product"
    for a, b in zip(grads, swiglu_module.swiglu_grads(dp, plain[1])):
        assert torch.equal(a, b), "backward"


@pytest.mark.cuda
@pytest.mark.skipif(not (CUDA_FP8 and cast.triton_available()), reason="needs an FP8 GPU and Triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [K, 4096, 5000])
def test_fused_rmsnorm_against_the_torch_ops(monkeypatch, dtype, width):
    """The Triton norm: its rstd within float32 roundings of torch's, its output within two
    roundings, the remade output bit for bit the forward's, and its gradients within float32
    summation order of the torch closed form's (given the same rstd)."""
    x = rand((3, 333, width), "cuda", dtype, scale=3.0)
    weight = (1 + 0.3 * rand((width,), "cuda", dtype, seed=7))
    dy = rand((3, 333, width), "cuda", dtype, seed=2)
    y, rstd = rmsnorm_module.rms_norm(x, weight, 1e-6)
    assert rstd.shape == (3, 333, 1) and rstd.dtype == torch.float32
    assert torch.equal(rmsnorm_module.normalize(x, rstd, weight), y), "the remade output is not forward's"
    dx, dw = rmsnorm_module.rms_norm_backward(dy, x, rstd, weight, True, True)
    torch_path(monkeypatch, rmsnorm_module)
    y_t, rstd_t = rmsnorm_module.rms_norm(x, weight, 1e-6)
    assert torch.allclose(rstd, rstd_t, rtol=2e-6, atol=0)
    assert_hfs_output("cuda", y, y_t)
    dx_t, dw_t = rmsnorm_module.rms_norm_backward(dy, x, rstd, weight, True, True)
    assert dx.dtype == dx_t.dtype == dtype and dw.dtype == dw_t.dtype == dtype
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel_err(dx, dx_t) < tol and rel_err(dw, dw_t) < tol, (rel_err(dx, dx_t), rel_err(dw, dw_t))


@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_mlp_forward_is_llama_mlps(device):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=K, intermediate_size=I)
    hf = transformers.models.llama.modeling_llama.LlamaMLP(config).to(device=device, dtype=torch.bfloat16)
    ours = fp8.SwiGLUMLP.from_module(hf)
    assert ours.gate_proj is hf.gate_proj and list(ours.state_dict()) == list(hf.state_dict())
    x = rand((2, 32, K), device, torch.bfloat16).requires_grad_(True)
    assert torch.equal(ours(x), hf(x))


def test_swiglu_errors_say_what_to_do():
    with pytest.raises(ValueError, match="must match in shape"):
        fp8.SwiGLU()(torch.randn(4, 16), torch.randn(4, 32))
    with pytest.raises(ValueError, match="expects tensors"):
        fp8.SwiGLU()(torch.randn(4, 16), 1.0)
