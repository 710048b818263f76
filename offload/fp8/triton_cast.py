"""Fused FP8 quantization kernels (Triton, CUDA only): amax, scale, cast and transpose, and the
tensorwise dequantization back to high precision.

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

import os
from typing import Any, Optional

import torch
import triton
import triton.language as tl

try:
    from triton import knobs
except ImportError:  # older Triton: every launch goes through Triton's own dispatch
    knobs = None

__all__ = [
    "SMALL_NUMEL", "MAX_PARTS", "amax_partials", "scale_from_parts", "quantize_tensorwise_fused",
    "quantize_rowwise_fused", "dequantize_tensorwise_fused",
]

# Up to this many elements, one program does the whole tensorwise quantization (one launch).
SMALL_NUMEL = 1 << 16
# Programs of the partial-amax kernel: few enough that every cast program can re-reduce them
# (1 KiB read from L2) instead of paying a separate launch for the final reduction.
MAX_PARTS = 256
_AMAX_ROWS = 8
_AMAX_COLS = 256
_TILE_M = 64
_TILE_K = 64


class _Launcher:
    """Launches one Triton kernel without Triton's per-call Python dispatch.

    ``kernel[grid](...)`` binds and specializes every argument in Python on each call: about
    25 us of host time on the H100's host, more than the kernel itself for a small tensor, and
    the reason a small FP8 Linear was host-bound. The first launch of each specialization goes
    through Triton (which compiles it) and keeps the compiled kernel; later launches call its C
    launcher directly.

    The caller names the specialization with ``key``: a tuple that must hold every fact Triton
    specializes on for this launch, so that equal keys mean equal compiled kernels. For the
    kernels below that is the input's shape, strides, dtype and 16-byte alignment, the output
    format (and layouts), and the device (every other argument is a fresh allocation, always
    aligned, or an int derived from the shape). One key per quantization, computed once, serves
    all of its launches: computing Triton's own key per argument is what costs the time.
    """

    __slots__ = ("_kernel", "_compiled")

    def __init__(self, kernel: Any) -> None:
        self._kernel = kernel
        self._compiled: dict[tuple[Any, ...], Any] = {}

    def __call__(
        self, key: tuple[Any, ...], stream: int, grid: tuple[int, int],
        args: tuple[Any, ...], constexprs: dict[str, Any], num_warps: int,
    ) -> None:
        compiled = self._compiled.get(key) if _DIRECT else None
        if compiled is None or _hooked():
            kernel = self._kernel[grid](*args, **constexprs, num_warps=num_warps)
            if _DIRECT:
                self._compiled[key] = kernel
            return
        compiled.run(
            grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata,
            None, None, None, *args, *constexprs.values(),
        )


# The direct call is the CompiledKernel.run ABI of the Triton releases tested here. (The
# interpreter, TRITON_INTERPRET=1, runs kernels in Python: no compiled kernel to call.)
_DIRECT = (
    knobs is not None
    and triton.__version__.split(".")[:2] in (["3", "5"], ["3", "6"])
    and os.environ.get("TRITON_INTERPRET", "0") != "1"
)


def _hooked() -> bool:
    """Whether a launch hook (a profiler such as proton) is installed: those need Triton's own
    launch path, which builds the metadata they read. Triton 3.6 holds hooks in a HookChain that
    is never None, so an empty chain counts as none."""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


def _launch_key(x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool) -> tuple[Any, ...]:
    """What every launch of one quantization of ``x`` specializes on (see :class:`_Launcher`)."""
    return (x.device.index, x.shape, x.stride(), x.dtype, x.data_ptr() & 15 == 0, fp8_dtype, rowwise, columnwise)


@triton.jit
def _finite_abs(x):
    a = tl.abs(x.to(tl.float32))
    # NaN < inf is False, so NaN and inf both drop out of the amax.
    return tl.where(a < float("inf"), a, 0.0)


@triton.jit
def _scale_from_amax(amax, FP8_MAX: tl.constexpr):
    safe = tl.where(amax > 0.0, amax, 1.0)
    # torch computes ``fp8_max / amax`` as ``amax.reciprocal() * fp8_max`` (Tensor.__rtruediv__):
    # the same two correctly rounded steps here, so both paths give the same scale bits.
    scale = tl.math.div_rn(safe * 0.0 + 1.0, safe) * FP8_MAX
    scale = tl.minimum(scale, 3.4028234663852886e38)
    return tl.where(amax > 0.0, scale, 1.0)


@triton.jit
def scale_from_parts(PART, n_parts, FP8_MAX: tl.constexpr, MAX_PARTS: tl.constexpr):
    """The current tensorwise scale from :func:`amax_partials`' partials: every program reduces
    them again (at most 1 KiB from L2) instead of paying a launch for the final reduction."""
    parts = tl.load(PART + tl.arange(0, MAX_PARTS), mask=tl.arange(0, MAX_PARTS) < n_parts, other=0.0)
    return _scale_from_amax(tl.max(parts, axis=0), FP8_MAX)


@triton.jit
def _cast(x, scale, FP8_MAX: tl.constexpr, out_ty):
    v = x.to(tl.float32) * scale
    # Saturate by comparison: NaN compares false both ways and passes through as NaN.
    v = tl.where(v > FP8_MAX, FP8_MAX, v)
    v = tl.where(v < -FP8_MAX, -FP8_MAX, v)
    return v.to(out_ty)


@triton.jit
def _store_rowwise(X, ROW, rows, cols, M, K, stride_xm, stride_xk, scale, FP8_MAX: tl.constexpr):
    """Quantize the (rows, cols) tile of X into ROW (M, K)."""
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(X + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
    tl.store(ROW + rows[:, None] * K + cols[None, :], _cast(x, scale, FP8_MAX, ROW.dtype.element_ty), mask=mask)


@triton.jit
def _store_columnwise(X, COL, rows, cols, M, K, stride_xm, stride_xk, scale, FP8_MAX: tl.constexpr):
    """Quantize the (rows, cols) tile of X into COL (K, M), its transpose. The tile is loaded
    already transposed, (cols, rows), and Triton moves it between the load's and the store's
    layouts through shared memory. (``tl.trans`` of a tile that is also stored row-major gave
    wrong bytes for some shapes and for float32 inputs on Triton 3.6, sm_90.)"""
    mask = (cols[:, None] < K) & (rows[None, :] < M)
    xt = tl.load(X + rows[None, :] * stride_xm + cols[:, None] * stride_xk, mask=mask, other=0.0)
    tl.store(COL + cols[:, None] * M + rows[None, :], _cast(xt, scale, FP8_MAX, COL.dtype.element_ty), mask=mask)


@triton.jit
def _amax_partials_kernel(
    X, PART, M, K, stride_xm, stride_xk, rows_per_prog,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for m0 in tl.range(pid * rows_per_prog, (pid + 1) * rows_per_prog, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        for k0 in tl.range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            mask = (rows[:, None] < M) & (cols[None, :] < K)
            x = tl.load(X + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
            acc = tl.maximum(acc, _finite_abs(x))
    tl.store(PART + pid, tl.max(tl.max(acc, axis=1), axis=0))


@triton.jit
def _cast_tensorwise_kernel(
    X, ROW, COL, PART, n_parts, SCALE_INV, M, K, stride_xm, stride_xk,
    FP8_MAX: tl.constexpr, MAX_PARTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    WRITE_ROW: tl.constexpr, WRITE_COL: tl.constexpr,
):
    scale = scale_from_parts(PART, n_parts, FP8_MAX, MAX_PARTS)
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    if WRITE_ROW:
        _store_rowwise(X, ROW, rows, cols, M, K, stride_xm, stride_xk, scale, FP8_MAX)
    if WRITE_COL:
        _store_columnwise(X, COL, rows, cols, M, K, stride_xm, stride_xk, scale, FP8_MAX)
    if (pid_m == 0) & (pid_k == 0):
        tl.store(SCALE_INV, tl.math.div_rn(scale * 0.0 + 1.0, scale))


@triton.jit
def _small_tensorwise_kernel(
    X, ROW, COL, SCALE_INV, M, K, stride_xm, stride_xk,
    FP8_MAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    WRITE_ROW: tl.constexpr, WRITE_COL: tl.constexpr,
):
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for m0 in tl.range(0, M, BLOCK_M):
        for k0 in tl.range(0, K, BLOCK_K):
            rows = m0 + tl.arange(0, BLOCK_M)
            cols = k0 + tl.arange(0, BLOCK_K)
            mask = (rows[:, None] < M) & (cols[None, :] < K)
            x = tl.load(X + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
            acc = tl.maximum(acc, _finite_abs(x))
    amax = tl.max(tl.max(acc, axis=1), axis=0)
    scale = _scale_from_amax(amax, FP8_MAX)
    for m0 in tl.range(0, M, BLOCK_M):
        for k0 in tl.range(0, K, BLOCK_K):
            rows = m0 + tl.arange(0, BLOCK_M)
            cols = k0 + tl.arange(0, BLOCK_K)
            if WRITE_ROW:
                _store_rowwise(X, ROW, rows, cols, M, K, stride_xm, stride_xk, scale, FP8_MAX)
            if WRITE_COL:
                _store_columnwise(X, COL, rows, cols, M, K, stride_xm, stride_xk, scale, FP8_MAX)
    tl.store(SCALE_INV, tl.math.div_rn(scale * 0.0 + 1.0, scale))


@triton.jit
def _amax_rows_cols_kernel(
    X, ROW_AMAX, COL_AMAX, M, K, stride_xm, stride_xk,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DO_ROW: tl.constexpr, DO_COL: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    a = _finite_abs(tl.load(X + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0))
    if DO_ROW:
        tl.atomic_max(ROW_AMAX + rows, tl.max(a, axis=1), mask=rows < M)
    if DO_COL:
        tl.atomic_max(COL_AMAX + cols, tl.max(a, axis=0), mask=cols < K)


@triton.jit
def _cast_rowwise_kernel(
    X, ROW, COL, ROW_AMAX, COL_AMAX, ROW_SINV, COL_SINV, M, K, stride_xm, stride_xk,
    FP8_MAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    WRITE_ROW: tl.constexpr, WRITE_COL: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    if WRITE_ROW:
        row_scale = _scale_from_amax(tl.load(ROW_AMAX + rows, mask=rows < M, other=0.0), FP8_MAX)
        _store_rowwise(X, ROW, rows, cols, M, K, stride_xm, stride_xk, row_scale[:, None], FP8_MAX)
        if pid_k == 0:
            tl.store(ROW_SINV + rows, tl.math.div_rn(row_scale * 0.0 + 1.0, row_scale), mask=rows < M)
    if WRITE_COL:
        col_scale = _scale_from_amax(tl.load(COL_AMAX + cols, mask=cols < K, other=0.0), FP8_MAX)
        _store_columnwise(X, COL, rows, cols, M, K, stride_xm, stride_xk, col_scale[:, None], FP8_MAX)
        if pid_m == 0:
            tl.store(COL_SINV + cols, tl.math.div_rn(col_scale * 0.0 + 1.0, col_scale), mask=cols < K)


@triton.jit
def _dequantize_tensorwise_kernel(DATA, SCALE_INV, OUT, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    # float32 product, rounded once to the output dtype (round to nearest even): the torch
    # path's arithmetic (offload.quantized.scaling.dequantize_tensorwise).
    v = tl.load(DATA + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(SCALE_INV)
    tl.store(OUT + offs, v.to(OUT.dtype.element_ty), mask=mask)


# One launcher per kernel: each keeps its compiled specializations.
_launch_small_tensorwise = _Launcher(_small_tensorwise_kernel)
_launch_amax_partials = _Launcher(_amax_partials_kernel)
_launch_cast_tensorwise = _Launcher(_cast_tensorwise_kernel)
_launch_amax_rows_cols = _Launcher(_amax_rows_cols_kernel)
_launch_cast_rowwise = _Launcher(_cast_rowwise_kernel)
_launch_dequantize_tensorwise = _Launcher(_dequantize_tensorwise_kernel)
_DEQUANTIZE_BLOCK = 2048


def _fp8_max(fp8_dtype: torch.dtype) -> float:
    return float(torch.finfo(fp8_dtype).max)


_FP8_MAX = {dt: _fp8_max(dt) for dt in (torch.float8_e4m3fn, torch.float8_e5m2)}


def _cdiv(a: int, b: int) -> int:
    """Ceiling division. (``triton.cdiv`` is a constexpr function in Triton 3.6: a call from
    Python goes through its dispatch, about 3 us of host time each, four per quantization.)"""
    return -(-a // b)


def _current_stream(x: torch.Tensor) -> int:
    """The raw current stream of ``x``'s device. A compiled kernel launches into the current CUDA
    context, as Triton's own launcher does, so callers make ``x``'s device current first."""
    return torch._C._cuda_getCurrentRawStream(x.device.index)


def amax_partials(x: torch.Tensor, key: tuple[Any, ...], stream: int) -> tuple[torch.Tensor, int]:
    """``(partials, count)``: the finite amax of each band of rows of the 2-D CUDA tensor ``x``, at
    most :data:`MAX_PARTS` of them, for a kernel that reduces them again (:func:`scale_from_parts`).
    ``key`` names ``x``'s specialization (see :class:`_Launcher`)."""
    m, k = x.shape
    # One band of rows per program, rows a multiple of the tile.
    rows_per_prog = _cdiv(_cdiv(m, MAX_PARTS), _AMAX_ROWS) * _AMAX_ROWS
    n_parts = _cdiv(m, rows_per_prog)
    parts = torch.empty(n_parts, dtype=torch.float32, device=x.device)
    _launch_amax_partials(
        key, stream, (n_parts, 1),
        (x, parts, m, k, x.stride(0), x.stride(1), rows_per_prog),
        {"BLOCK_M": _AMAX_ROWS, "BLOCK_K": _AMAX_COLS},
        num_warps=8,
    )
    return parts, n_parts


def quantize_tensorwise_fused(
    x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor]:
    """``(rowwise (M, K), columnwise (K, M), scale_inv (1,))`` of a 2-D CUDA tensor of any strides
    (an expanded gradient too) with one current scale; absent layouts are None."""
    m, k = x.shape
    dev = x.device
    stream = _current_stream(x)
    key = _launch_key(x, fp8_dtype, rowwise, columnwise)
    row = torch.empty((m, k), dtype=fp8_dtype, device=dev) if rowwise else None
    col = torch.empty((k, m), dtype=fp8_dtype, device=dev) if columnwise else None
    scale_inv = torch.empty(1, dtype=torch.float32, device=dev)
    # Triton wants a pointer even for a layout it does not write; the kernel never touches it.
    row_arg = row if row is not None else col
    col_arg = col if col is not None else row
    stride_m, stride_k = x.stride()
    fmax = _FP8_MAX[fp8_dtype]
    if m * k <= SMALL_NUMEL:
        _launch_small_tensorwise(
            key, stream, (1, 1),
            (x, row_arg, col_arg, scale_inv, m, k, stride_m, stride_k),
            {"FP8_MAX": fmax, "BLOCK_M": 32, "BLOCK_K": 64, "WRITE_ROW": rowwise, "WRITE_COL": columnwise},
            num_warps=4,
        )
        return row, col, scale_inv
    parts, n_parts = amax_partials(x, key, stream)
    _launch_cast_tensorwise(
        key, stream, (_cdiv(m, _TILE_M), _cdiv(k, _TILE_K)),
        (x, row_arg, col_arg, parts, n_parts, scale_inv, m, k, stride_m, stride_k),
        {"FP8_MAX": fmax, "MAX_PARTS": MAX_PARTS, "BLOCK_M": _TILE_M, "BLOCK_K": _TILE_K,
         "WRITE_ROW": rowwise, "WRITE_COL": columnwise},
        num_warps=4,
    )
    return row, col, scale_inv


def quantize_rowwise_fused(
    x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(rowwise (M, K), row scale_inv (M, 1), columnwise (K, M), its scale_inv (K, 1))`` of a
    2-D CUDA tensor of any strides, one scale per row of each layout; absent layouts are None."""
    m, k = x.shape
    dev = x.device
    stream = _current_stream(x)
    key = _launch_key(x, fp8_dtype, rowwise, columnwise)
    # The atomics start from zero: one memset for both amax vectors.
    amaxes = torch.zeros(m + k, dtype=torch.float32, device=dev)
    row_amax, col_amax = amaxes[:m], amaxes[m:]
    row = torch.empty((m, k), dtype=fp8_dtype, device=dev) if rowwise else None
    col = torch.empty((k, m), dtype=fp8_dtype, device=dev) if columnwise else None
    sinv = torch.empty(m + k, dtype=torch.float32, device=dev)
    row_sinv, col_sinv = sinv[:m], sinv[m:]
    grid = (_cdiv(m, _TILE_M), _cdiv(k, _TILE_K))
    stride_m, stride_k = x.stride()
    _launch_amax_rows_cols(
        key, stream, grid,
        (x, row_amax, col_amax, m, k, stride_m, stride_k),
        {"BLOCK_M": _TILE_M, "BLOCK_K": _TILE_K, "DO_ROW": rowwise, "DO_COL": columnwise},
        num_warps=4,
    )
    _launch_cast_rowwise(
        key, stream, grid,
        (x, row if row is not None else col, col if col is not None else row,
         row_amax, col_amax, row_sinv, col_sinv, m, k, stride_m, stride_k),
        {"FP8_MAX": _FP8_MAX[fp8_dtype], "BLOCK_M": _TILE_M, "BLOCK_K": _TILE_K,
         "WRITE_ROW": rowwise, "WRITE_COL": columnwise},
        num_warps=4,
    )
    return (
        row,
        row_sinv.view(m, 1) if rowwise else None,
        col,
        col_sinv.view(k, 1) if columnwise else None,
    )


def dequantize_tensorwise_fused(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``data * scale_inv`` as ``dtype`` for contiguous FP8 CUDA ``data`` and a one-element float32
    ``scale_inv``: one pass, no float32 copy (the torch path's transient is 4 bytes per element,
    twice a bfloat16 result)."""
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    n = data.numel()
    if n == 0:
        return out
    key = (data.device.index, n, data.dtype, data.data_ptr() & 15 == 0, scale_inv.data_ptr() & 15 == 0, dtype)
    _launch_dequantize_tensorwise(
        key, _current_stream(data), (_cdiv(n, _DEQUANTIZE_BLOCK), 1),
        (data, scale_inv, out, n), {"BLOCK": _DEQUANTIZE_BLOCK}, num_warps=8,
    )
    return out
