"""RMSNorm in one pass each way (Triton, CUDA only): forward, the output remade from a saved
rstd, and backward.

HF's ``LlamaRMSNorm`` runs as seven elementwise and reduction kernels in float32, and autograd's
backward of it as about a dozen more: at the LLAMA-2B shape (8192 x 4096, bf16) about 1.2 GB of
memory traffic forward and 4 GB backward per norm, where one read of the inputs and one write of
the result move 0.13 and 0.2 GB. These kernels do one pass each:

* forward: one program per row computes ``rstd = rsqrt(mean(float32(x)**2) + eps)`` and writes
  ``weight * (float32(x) * rstd).to(x.dtype)`` (HF's arithmetic and roundings, see below) and the
  float32 rstd;
* remake: the same kernel with the rstd read instead of computed, so the output is bitwise the
  forward's (what :class:`~offload.fp8.RMSNorm`'s consumers rely on in backward);
* backward: each program takes a band of :data:`ROWS_PER_PROGRAM` rows, writes their ``dx`` and
  one float32 partial sum of ``dweight`` over its rows; torch sums the partials. A fixed band
  (not one per SM) keeps the summation order, so the bits, the same on every GPU.

Numerics. The products, casts and the backward's closed form are those of
:func:`offload.fp8.rmsnorm.rms_norm_backward`. The mean square is summed in a tree order of the
kernel's own, and ``rsqrt`` is the hardware's, so rstd (and through it the output) can differ
from torch's in the last bits: the output within two roundings (the normalized x's and the
product's; tested). Deterministic:
no atomics, so repeated runs, and runs with and without offload, are bitwise equal.

Rows up to :data:`MAX_WIDTH` elements wide fit one program's registers; wider rows take the torch
path. Offsets are 32-bit: callers send tensors of 2**31 elements or more to torch.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_cast import _cdiv, _current_stream, _Launcher

__all__ = ["MAX_WIDTH", "ROWS_PER_PROGRAM", "rms_norm_forward", "rms_norm_backward"]

MAX_WIDTH = 16384
ROWS_PER_PROGRAM = 32


@triton.jit
def _rms_norm_fwd_kernel(
    X, W, Y, RSTD, N, stride_x, eps,
    BLOCK_N: tl.constexpr, HAVE_RSTD: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAVE_RSTD:
        rstd = tl.load(RSTD + row)
    else:
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        tl.store(RSTD + row, rstd)
    # HF: weight * (x_f32 * rstd).to(x.dtype); the product in the promoted dtype (Y's), computed
    # in float32 and rounded once, as torch's elementwise multiply does.
    xn = (x * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * N + cols, (w * xn).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW_PART, M, N, stride_dy, stride_x,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, NEED_DW: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r in range(ROWS):
        row = pid * ROWS + r
        if row < M:
            x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + row)
            xhat = x * rstd
            if NEED_DW:
                # dweight sums dy * xhat rounded to x's dtype: the output's normalized factor.
                dw += dy * xhat.to(X.dtype.element_ty).to(tl.float32)
            g = dy * w
            projection = tl.sum(g * xhat, axis=0) / N
            dx = (g - xhat * projection) * rstd
            tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=mask)
    if NEED_DW:
        tl.store(DW_PART + pid * N + cols, dw, mask=mask)


_launch_fwd = _Launcher(_rms_norm_fwd_kernel)
_launch_bwd = _Launcher(_rms_norm_bwd_kernel)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``(M, N)`` rows with unit column stride (a view where the layout allows)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _block(n: int) -> tuple[int, int]:
    """The row tile (the next power of two) and warps for a row of ``n`` elements: about 16
    elements per thread, so a row stays in registers."""
    block = triton.next_power_of_2(n)
    return block, max(1, min(16, block // 512))


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, rstd: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)`` of ``x`` (``(..., N)``, CUDA, its device current): ``y`` in the promoted dtype
    of ``x`` and ``weight``, ``rstd`` float32 ``(..., 1)``. Given ``rstd`` (forward's), ``y`` is
    remade bitwise as forward made it."""
    n = x.shape[-1]
    x2 = _rows(x)
    m = x2.shape[0]
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    # Allocated in x's shape, not viewed into it afterwards: autograd forbids changing in place a
    # view made inside a custom Function, and callers may change the output in place.
    y = torch.empty((*x.shape[:-1], n), dtype=out_dtype, device=x.device)
    have_rstd = rstd is not None
    rstd_out = rstd.contiguous() if have_rstd else torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    if m:
        block, warps = _block(n)
        w = weight if weight.is_contiguous() else weight.contiguous()
        # A saved rstd may come back from offload as a view at any 4-byte offset: its alignment,
        # which Triton specializes on, is part of the key too.
        key = (x.device.index, n, x2.stride(0), x.dtype, w.dtype, out_dtype, have_rstd,
               x2.data_ptr() & 15 == 0, w.data_ptr() & 15 == 0, rstd_out.data_ptr() & 15 == 0)
        _launch_fwd(key, _current_stream(x), (m, 1), (x2, w, y, rstd_out, n, x2.stride(0), float(eps)),
                    {"BLOCK_N": block, "HAVE_RSTD": have_rstd}, num_warps=warps)
    return y, rstd_out


def rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, need_dweight: bool
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(dx, dweight)`` of :func:`rms_norm_forward` (CUDA, the device current); ``dweight`` is
    None unless ``need_dweight``."""
    n = x.shape[-1]
    x2, dy2 = _rows(x), _rows(dy)
    m = x2.shape[0]
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device)
    programs = _cdiv(m, ROWS_PER_PROGRAM)
    parts = torch.empty((programs, n) if need_dweight else (1,), dtype=torch.float32, device=x.device)
    if m:
        block, warps = _block(n)
        w = weight if weight.is_contiguous() else weight.contiguous()
        # m is a kernel argument (Triton specializes on it), so it is part of the key.
        rstd = rstd.contiguous()
        key = (x.device.index, m, n, x2.stride(0), dy2.stride(0), x.dtype, dy.dtype, w.dtype, need_dweight,
               x2.data_ptr() & 15 == 0, dy2.data_ptr() & 15 == 0, w.data_ptr() & 15 == 0, rstd.data_ptr() & 15 == 0)
        _launch_bwd(key, _current_stream(x), (programs, 1),
                    (dy2, x2, w, rstd, dx, parts, m, n, dy2.stride(0), x2.stride(0)),
                    {"ROWS": ROWS_PER_PROGRAM, "BLOCK_N": block, "NEED_DW": need_dweight}, num_warps=warps)
    dweight = None
    if need_dweight:
        dweight = (parts.sum(0) if m else torch.zeros(n, dtype=torch.float32, device=x.device)).to(weight.dtype)
    return dx.view(x.shape), dweight
