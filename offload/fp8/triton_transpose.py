"""The transpose of FP8 data (Triton, CUDA only): dgrad's weight operand made in backward.

With one cached weight layout (:mod:`offload.fp8.weights`), every backward transposes each
weight's FP8 data. torch's copy of a transposed view reads one byte per thread from rows far
apart; this kernel moves 64 x 64 tiles instead. As in :mod:`.triton_cast`'s columnwise store,
each tile is loaded already transposed and Triton moves it between the load's and the store's
layouts through shared memory (``tl.trans`` of a tile stored row-major gave wrong bytes on
Triton 3.6, sm_90). The bytes are the same as torch's by construction: nothing is computed.

Offsets are 32-bit: callers send tensors of 2**31 elements or more to torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_cast import _cdiv, _current_stream, _Launcher

__all__ = ["transpose_bytes"]

_TILE = 64


@triton.jit
def _transpose_kernel(X, Y, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Y (N, M) = X (M, N) transposed, both contiguous, one-byte elements."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (cols[:, None] < N) & (rows[None, :] < M)
    xt = tl.load(X + rows[None, :] * N + cols[:, None], mask=mask, other=0)
    tl.store(Y + cols[:, None] * M + rows[None, :], xt, mask=mask)


_launch_transpose = _Launcher(_transpose_kernel)


def transpose_bytes(x: torch.Tensor) -> torch.Tensor:
    """The contiguous ``(N, M)`` transpose of a contiguous 2-D CUDA tensor ``(M, N)`` of one-byte
    elements (FP8 data), in ``x``'s dtype. ``x``'s device must be current."""
    m, n = x.shape
    src = x.view(torch.uint8)  # Triton loads and stores bytes; the format does not matter
    out = torch.empty((n, m), dtype=torch.uint8, device=x.device)
    if m and n:
        key = (x.device.index, m, n, x.data_ptr() & 15 == 0)
        _launch_transpose(
            key, _current_stream(x), (_cdiv(m, _TILE), _cdiv(n, _TILE)),
            (src, out, m, n), {"BLOCK_M": _TILE, "BLOCK_N": _TILE}, num_warps=4,
        )
    return out.view(x.dtype)
