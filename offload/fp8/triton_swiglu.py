"""SwiGLU in one pass each way (Triton, CUDA only): forward with the FP8 copies it saves, the
product remade from those copies, and backward from them.

:class:`~offload.fp8.SwiGLU` saves ``gate`` and ``up`` as e4m3 with one current scale each. In
torch ops that is, forward, ``silu``, a multiply and two quantizations (20 bytes moved per element
of the intermediate width); backward, two dequantizations, ``silu``, the product for
``down_proj``'s wgrad operand, and three more elementwise kernels (32 bytes per element, and
three bf16 tensors held from ``down_proj``'s backward to the SwiGLU's). At LLAMA-2B's 8192 x 14336
that was 2.2 ms per layer. Here:

* forward: :func:`~offload.fp8.triton_cast.amax_partials` of ``gate`` and of ``up``, then one
  kernel that writes the product and both FP8 copies (12 bytes per element in all);
* remake: one kernel, the product from the FP8 copies (4 bytes per element);
* backward: one kernel, ``dgate`` and ``dup`` from ``dproduct`` and the FP8 copies (8 bytes per
  element), nothing held in between.

The arithmetic is the torch path's (:mod:`offload.fp8.swiglu`), op for op: ``silu`` as torch's
CUDA kernel computes it (``x / (1 + exp(-x))`` in float32 with an IEEE division and libdevice's
``expf``), each intermediate rounded to the inputs' dtype where torch's ops round it, and the
FP8 copies and their scales from the same scale and cast as :func:`offload.fp8.cast.quantize`'s
(shared jit helpers). Deterministic: no atomics.

Offsets are 32-bit: callers send tensors of 2**31 elements or more to torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra import libdevice
except ImportError:  # older Triton
    from triton.language.extra.cuda import libdevice

from .triton_cast import (
    MAX_PARTS, _cast, _cdiv, _current_stream, _FP8_MAX, _launch_key, _Launcher, amax_partials, scale_from_parts,
)

__all__ = ["swiglu_forward", "swiglu_remake", "swiglu_backward"]

_BLOCK = 4096
_SAVED_FP8 = torch.float8_e4m3fn


@triton.jit
def _silu(x):
    """torch's CUDA ``silu`` in float32: ``x / (1 + exp(-x))``, IEEE division, libdevice exp."""
    return tl.math.div_rn(x, 1.0 + libdevice.exp(-x))


@triton.jit
def _product(g, u, DT: tl.constexpr):
    """``F.silu(g) * u`` for ``g``, ``u`` already in dtype ``DT``, with torch's roundings: the
    activation rounded to ``DT``, then the product."""
    a = _silu(g.to(tl.float32)).to(DT).to(tl.float32)
    return (a * u.to(tl.float32)).to(DT)


@triton.jit
def _dequantize(D8, S, offs, mask, DT: tl.constexpr):
    """``D8 * scale_inv`` rounded once to ``DT`` (:func:`offload.fp8.cast.dequantize`'s)."""
    return (tl.load(D8 + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(S)).to(DT)


@triton.jit
def _swiglu_fwd_kernel(
    G, U, P, G8, U8, G_PART, U_PART, n_g_parts, n_u_parts, G_SINV, U_SINV, N,
    FP8_MAX: tl.constexpr, MAX_PARTS: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(G + offs, mask=mask, other=0.0)
    u = tl.load(U + offs, mask=mask, other=0.0)
    tl.store(P + offs, _product(g, u, P.dtype.element_ty), mask=mask)
    g_scale = scale_from_parts(G_PART, n_g_parts, FP8_MAX, MAX_PARTS)
    u_scale = scale_from_parts(U_PART, n_u_parts, FP8_MAX, MAX_PARTS)
    tl.store(G8 + offs, _cast(g, g_scale, FP8_MAX, G8.dtype.element_ty), mask=mask)
    tl.store(U8 + offs, _cast(u, u_scale, FP8_MAX, U8.dtype.element_ty), mask=mask)
    if tl.program_id(0) == 0:
        tl.store(G_SINV, tl.math.div_rn(g_scale * 0.0 + 1.0, g_scale))
        tl.store(U_SINV, tl.math.div_rn(u_scale * 0.0 + 1.0, u_scale))


@triton.jit
def _swiglu_remake_kernel(G8, G_SINV, U8, U_SINV, P, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    DT: tl.constexpr = P.dtype.element_ty
    g = _dequantize(G8, G_SINV, offs, mask, DT)
    u = _dequantize(U8, U_SINV, offs, mask, DT)
    tl.store(P + offs, _product(g, u, DT), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DP, G8, G_SINV, U8, U_SINV, DG, DU, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    DT: tl.constexpr = DG.dtype.element_ty
    dp = tl.load(DP + offs, mask=mask, other=0.0).to(tl.float32)
    g = _dequantize(G8, G_SINV, offs, mask, DT).to(tl.float32)
    u = _dequantize(U8, U_SINV, offs, mask, DT).to(tl.float32)
    # du = dp * silu(g), the activation rounded first (torch: dp * a, a = F.silu(g)).
    a = _silu(g).to(DT).to(tl.float32)
    tl.store(DU + offs, (dp * a).to(DT), mask=mask)
    # dg = silu_backward(dp * u, g), as torch's kernel: dy * s * (1 + x * (1 - s)).
    dy = (dp * u).to(DT).to(tl.float32)
    s = tl.math.div_rn(1.0 + 0.0 * g, 1.0 + libdevice.exp(-g))
    tl.store(DG + offs, (dy * s * (1.0 + g * (1.0 - s))).to(DT), mask=mask)


_launch_fwd = _Launcher(_swiglu_fwd_kernel)
_launch_remake = _Launcher(_swiglu_remake_kernel)
_launch_bwd = _Launcher(_swiglu_bwd_kernel)


def _aligned(*ts: torch.Tensor) -> tuple[bool, ...]:
    return tuple(t.data_ptr() & 15 == 0 for t in ts)


def swiglu_forward(
    gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(product, g8, g_scale_inv, u8, u_scale_inv)`` for contiguous CUDA ``gate`` and ``up`` of
    one shape and dtype (their device current): ``F.silu(gate) * up`` and e4m3 copies of both,
    flat, with their ``(1,)`` float32 dequantization scales."""
    n = gate.numel()
    dev = gate.device
    stream = _current_stream(gate)
    g2, u2 = gate.view(-1, gate.shape[-1]), up.view(-1, up.shape[-1])
    # The key the quantizer would use for a rowwise e4m3 cast of each: the same partials kernel.
    g_parts, n_g = amax_partials(g2, _launch_key(g2, _SAVED_FP8, True, False), stream)
    u_parts, n_u = amax_partials(u2, _launch_key(u2, _SAVED_FP8, True, False), stream)
    product = torch.empty_like(gate)
    g8 = torch.empty(n, dtype=_SAVED_FP8, device=dev)
    u8 = torch.empty(n, dtype=_SAVED_FP8, device=dev)
    g_sinv = torch.empty(1, dtype=torch.float32, device=dev)
    u_sinv = torch.empty(1, dtype=torch.float32, device=dev)
    key = (dev.index, n, gate.dtype, *_aligned(gate, up))
    _launch_fwd(key, stream, (_cdiv(n, _BLOCK), 1),
                (gate, up, product, g8, u8, g_parts, u_parts, n_g, n_u, g_sinv, u_sinv, n),
                {"FP8_MAX": _FP8_MAX[_SAVED_FP8], "MAX_PARTS": MAX_PARTS, "BLOCK": _BLOCK}, num_warps=8)
    return product, g8, g_sinv, u8, u_sinv


def swiglu_remake(
    g8: torch.Tensor, g_sinv: torch.Tensor, u8: torch.Tensor, u_sinv: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The forward's product, flat, as ``dtype``, from the saved FP8 copies (contiguous, CUDA,
    their device current) dequantized: ``F.silu(g~) * u~``."""
    n = g8.numel()
    out = torch.empty(n, dtype=dtype, device=g8.device)
    # Saved tensors may come back from offload as views at any offset: every pointer's alignment
    # is in the key (Triton specializes on it).
    key = (g8.device.index, n, dtype, *_aligned(g8, g_sinv, u8, u_sinv))
    _launch_remake(key, _current_stream(g8), (_cdiv(n, _BLOCK), 1),
                   (g8.view(_SAVED_FP8), g_sinv, u8.view(_SAVED_FP8), u_sinv, out, n), {"BLOCK": _BLOCK}, num_warps=8)
    return out


def swiglu_backward(
    dp: torch.Tensor, g8: torch.Tensor, g_sinv: torch.Tensor, u8: torch.Tensor, u_sinv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dgate, dup)``, flat, in ``dp``'s dtype, of the SwiGLU at the dequantized saved copies,
    for a contiguous CUDA ``dp`` (its device current)."""
    n = dp.numel()
    dg = torch.empty(n, dtype=dp.dtype, device=dp.device)
    du = torch.empty(n, dtype=dp.dtype, device=dp.device)
    key = (dp.device.index, n, dp.dtype, *_aligned(dp, g8, g_sinv, u8, u_sinv))
    _launch_bwd(key, _current_stream(dp), (_cdiv(n, _BLOCK), 1),
                (dp, g8.view(_SAVED_FP8), g_sinv, u8.view(_SAVED_FP8), u_sinv, dg, du, n), {"BLOCK": _BLOCK}, num_warps=8)
    return dg, du
