"""Fused FP8 quantization kernels (Triton, CUDA only): amax, scale, cast and transpose.

The torch path in :mod:`offload.quantized` takes about ten passes over the input (a float32 copy,
``abs``, ``amax``, multiply, ``clamp``, cast, a transposed copy...). Here a quantization is:

* **tensorwise**: one kernel writes one partial amax per program, and one kernel reduces those
  partials, computes the scale and writes the rowwise and the transposed (columnwise) FP8 data
  from a single read of each tile. Tensors of up to :data:`SMALL_NUMEL` elements take one kernel
  of one program instead: at that size a launch costs more host time than the GPU work.
* **rowwise** (one scale per row of each layout): one kernel reduces each tile's rows and columns
  into per-row and per-column amaxes with ``atomic_max``, one kernel casts both layouts. Max is
  exact and order-free, so the atomics are deterministic.

The arithmetic is the torch path's, bit for bit (tested): the scale is ``fp8_max / amax`` rounded
to nearest (``div_rn``; Triton's ``/`` is an approximate division), capped at the float32 maximum
for subnormal amaxes, and 1 where no finite non-zero value exists; values are multiplied in
float32, clamped to the format's range and cast with round-to-nearest-even. Non-finite inputs do
not set the scale: ``inf`` saturates to the largest FP8 value and NaN stays NaN (see
:func:`offload.quantized.finite_amax`).

Offsets are 32-bit: callers send tensors of 2**31 elements or more to the torch path.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["SMALL_NUMEL", "quantize_tensorwise_fused", "quantize_rowwise_fused"]

# Up to this many elements, one program does the whole tensorwise quantization (one launch).
SMALL_NUMEL = 1 << 16
# Programs of the partial-amax kernel: few enough that every cast program can re-reduce them
# (1 KiB read from L2) instead of paying a separate launch for the final reduction.
_MAX_PARTS = 256
_AMAX_BLOCK = 2048
_TILE_M = 64
_TILE_K = 64


@triton.jit
def _finite_abs(x):
    a = tl.abs(x.to(tl.float32))
    # NaN < inf is False, so NaN and inf both drop out of the amax.
    return tl.where(a < float("inf"), a, 0.0)


@triton.jit
def _scale_from_amax(amax, FP8_MAX: tl.constexpr):
    safe = tl.where(amax > 0.0, amax, 1.0)
    scale = tl.math.div_rn(safe * 0.0 + FP8_MAX, safe)
    scale = tl.minimum(scale, 3.4028234663852886e38)
    return tl.where(amax > 0.0, scale, 1.0)


@triton.jit
def _cast(x, scale, FP8_MAX: tl.constexpr, out_ty):
    v = tl.clamp(x.to(tl.float32) * scale, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return v.to(out_ty)


@triton.jit
def _amax_partials_kernel(X, PART, n, per_prog, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    start = pid * per_prog
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in tl.range(start, start + per_prog, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < n, other=0.0)
        acc = tl.maximum(acc, _finite_abs(x))
    tl.store(PART + pid, tl.max(acc, axis=0))


@triton.jit
def _cast_tensorwise_kernel(
    X, ROW, COL, PART, n_parts, SCALE_INV, AMAX, M, K, stride_xm,
    FP8_MAX: tl.constexpr, MAX_PARTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    WRITE_ROW: tl.constexpr, WRITE_COL: tl.constexpr,
):
    parts = tl.load(PART + tl.arange(0, MAX_PARTS), mask=tl.arange(0, MAX_PARTS) < n_parts, other=0.0)
    amax = tl.max(parts, axis=0)
    scale = _scale_from_amax(amax, FP8_MAX)
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    if WRITE_ROW:
        q = _cast(x, scale, FP8_MAX, ROW.dtype.element_ty)
        tl.store(ROW + rows[:, None] * K + cols[None, :], q, mask=mask)
    if WRITE_COL:
        qt = _cast(tl.trans(x), scale, FP8_MAX, COL.dtype.element_ty)
        tl.store(COL + cols[:, None] * M + rows[None, :], qt, mask=tl.trans(mask))
    if (pid_m == 0) & (pid_k == 0):
        tl.store(SCALE_INV, tl.math.div_rn(scale * 0.0 + 1.0, scale))
        tl.store(AMAX, amax)


@triton.jit
def _small_tensorwise_kernel(
    X, ROW, COL, SCALE_INV, AMAX, M, K, stride_xm,
    FP8_MAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    WRITE_ROW: tl.constexpr, WRITE_COL: tl.constexpr,
):
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for m0 in tl.range(0, M, BLOCK_M):
        for k0 in tl.range(0, K, BLOCK_K):
            rows = m0 + tl.arange(0, BLOCK_M)
            cols = k0 + tl.arange(0, BLOCK_K)
            mask = (rows[:, None] < M) & (cols[None, :] < K)
            x = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
            acc = tl.maximum(acc, _finite_abs(x))
    amax = tl.max(tl.max(acc, axis=1), axis=0)
    scale = _scale_from_amax(amax, FP8_MAX)
    for m0 in tl.range(0, M, BLOCK_M):
        for k0 in tl.range(0, K, BLOCK_K):
            rows = m0 + tl.arange(0, BLOCK_M)
            cols = k0 + tl.arange(0, BLOCK_K)
            mask = (rows[:, None] < M) & (cols[None, :] < K)
            x = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
            if WRITE_ROW:
                tl.store(ROW + rows[:, None] * K + cols[None, :], _cast(x, scale, FP8_MAX, ROW.dtype.element_ty), mask=mask)
            if WRITE_COL:
                qt = _cast(tl.trans(x), scale, FP8_MAX, COL.dtype.element_ty)
                tl.store(COL + cols[:, None] * M + rows[None, :], qt, mask=tl.trans(mask))
    tl.store(SCALE_INV, tl.math.div_rn(scale * 0.0 + 1.0, scale))
    tl.store(AMAX, amax)


@triton.jit
def _amax_rows_cols_kernel(
    X, ROW_AMAX, COL_AMAX, M, K, stride_xm,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DO_ROW: tl.constexpr, DO_COL: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    a = _finite_abs(tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0))
    if DO_ROW:
        tl.atomic_max(ROW_AMAX + rows, tl.max(a, axis=1), mask=rows < M)
    if DO_COL:
        tl.atomic_max(COL_AMAX + cols, tl.max(a, axis=0), mask=cols < K)


@triton.jit
def _cast_rowwise_kernel(
    X, ROW, COL, ROW_AMAX, COL_AMAX, ROW_SINV, COL_SINV, M, K, stride_xm,
    FP8_MAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    WRITE_ROW: tl.constexpr, WRITE_COL: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    if WRITE_ROW:
        row_scale = _scale_from_amax(tl.load(ROW_AMAX + rows, mask=rows < M, other=0.0), FP8_MAX)
        q = _cast(x, row_scale[:, None], FP8_MAX, ROW.dtype.element_ty)
        tl.store(ROW + rows[:, None] * K + cols[None, :], q, mask=mask)
        if pid_k == 0:
            tl.store(ROW_SINV + rows, tl.math.div_rn(row_scale * 0.0 + 1.0, row_scale), mask=rows < M)
    if WRITE_COL:
        col_scale = _scale_from_amax(tl.load(COL_AMAX + cols, mask=cols < K, other=0.0), FP8_MAX)
        qt = _cast(tl.trans(x), col_scale[:, None], FP8_MAX, COL.dtype.element_ty)
        tl.store(COL + cols[:, None] * M + rows[None, :], qt, mask=tl.trans(mask))
        if pid_m == 0:
            tl.store(COL_SINV + cols, tl.math.div_rn(col_scale * 0.0 + 1.0, col_scale), mask=cols < K)


def _fp8_max(fp8_dtype: torch.dtype) -> float:
    return float(torch.finfo(fp8_dtype).max)


def quantize_tensorwise_fused(
    x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """``(rowwise (M, K), columnwise (K, M), scale_inv (1,), amax (1,))`` of a row-major 2-D CUDA
    tensor (``x.stride(1) == 1``) with one current scale; absent layouts are None."""
    m, k = x.shape
    dev = x.device
    row = torch.empty((m, k), dtype=fp8_dtype, device=dev) if rowwise else None
    col = torch.empty((k, m), dtype=fp8_dtype, device=dev) if columnwise else None
    # One allocation for scale_inv and amax: a caching-allocator call costs more host time than
    # the 8 bytes are worth.
    scalars = torch.empty(2, dtype=torch.float32, device=dev)
    scale_inv, amax = scalars[0:1], scalars[1:2]
    # Triton wants a pointer even for a layout it does not write; the kernel never touches it.
    row_arg = row if row is not None else col
    col_arg = col if col is not None else row
    fmax = _fp8_max(fp8_dtype)
    n = m * k
    if n <= SMALL_NUMEL:
        _small_tensorwise_kernel[(1,)](
            x, row_arg, col_arg, scale_inv, amax, m, k, x.stride(0),
            FP8_MAX=fmax, BLOCK_M=32, BLOCK_K=64, WRITE_ROW=rowwise, WRITE_COL=columnwise,
            num_warps=4,
        )
        return row, col, scale_inv, amax
    if not x.is_contiguous():
        x = x.contiguous()
    per_prog = triton.cdiv(triton.cdiv(n, _MAX_PARTS), _AMAX_BLOCK) * _AMAX_BLOCK
    n_parts = triton.cdiv(n, per_prog)
    parts = torch.empty(n_parts, dtype=torch.float32, device=dev)
    _amax_partials_kernel[(n_parts,)](x, parts, n, per_prog, BLOCK=_AMAX_BLOCK, num_warps=8)
    grid = (triton.cdiv(m, _TILE_M), triton.cdiv(k, _TILE_K))
    _cast_tensorwise_kernel[grid](
        x, row_arg, col_arg, parts, n_parts, scale_inv, amax, m, k, x.stride(0),
        FP8_MAX=fmax, MAX_PARTS=_MAX_PARTS, BLOCK_M=_TILE_M, BLOCK_K=_TILE_K,
        WRITE_ROW=rowwise, WRITE_COL=columnwise, num_warps=4,
    )
    return row, col, scale_inv, amax


def quantize_rowwise_fused(
    x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(rowwise (M, K), row scale_inv (M, 1), columnwise (K, M), its scale_inv (K, 1))`` of a
    row-major 2-D CUDA tensor, one scale per row of each layout; absent layouts are None."""
    m, k = x.shape
    dev = x.device
    # The atomics start from zero: one memset for both amax vectors.
    amaxes = torch.zeros(m + k, dtype=torch.float32, device=dev)
    row_amax, col_amax = amaxes[:m], amaxes[m:]
    row = torch.empty((m, k), dtype=fp8_dtype, device=dev) if rowwise else None
    col = torch.empty((k, m), dtype=fp8_dtype, device=dev) if columnwise else None
    sinv = torch.empty(m + k, dtype=torch.float32, device=dev)
    row_sinv, col_sinv = sinv[:m], sinv[m:]
    grid = (triton.cdiv(m, _TILE_M), triton.cdiv(k, _TILE_K))
    _amax_rows_cols_kernel[grid](
        x, row_amax, col_amax, m, k, x.stride(0),
        BLOCK_M=_TILE_M, BLOCK_K=_TILE_K, DO_ROW=rowwise, DO_COL=columnwise, num_warps=4,
    )
    _cast_rowwise_kernel[grid](
        x, row if row is not None else col, col if col is not None else row,
        row_amax, col_amax, row_sinv, col_sinv, m, k, x.stride(0),
        FP8_MAX=_fp8_max(fp8_dtype), BLOCK_M=_TILE_M, BLOCK_K=_TILE_K,
        WRITE_ROW=rowwise, WRITE_COL=columnwise, num_warps=4,
    )
    return (
        row,
        row_sinv.view(m, 1) if rowwise else None,
        col,
        col_sinv.view(k, 1) if columnwise else None,
    )
