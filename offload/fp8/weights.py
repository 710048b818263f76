"""FP8 copies of a weight, made once per weight version.

A weight does not change between micro-batches, nor between forward and backward, so quantizing
it on every call (as TransformerEngine does unless told ``is_first_microbatch``) wastes a read of
the weight and two kernels per GEMM. The cache is keyed on the parameter's version counter, which
every in-place update through autograd-visible ops bumps (optimizer steps, ``copy_`` under
``no_grad``, ``load_state_dict``), and on its storage address, so a stale copy cannot be used.
Writes through ``.data`` bypass the version counter: after one, call :meth:`WeightCache.clear`.

While a CUDA graph is being captured the cache is neither read nor written: the captured kernels
must quantize the weight on every replay, since the optimizer changes it between replays.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .cast import quantize

__all__ = ["GemmWeight", "WeightCache"]

# Weights are always e4m3fn: cuBLASLt has no e5m2 x e5m2 FP8 GEMM, and the rowwise kernels take
# e4m3fn only.
WEIGHT_FP8 = torch.float8_e4m3fn


class GemmWeight(NamedTuple):
    """A weight ``W`` ``(N, K)`` as ready-made ``_scaled_mm`` ``mat2`` operands: ``fprop``
    ``(K, N)`` column-major for ``X @ W^T`` and ``dgrad`` ``(N, K)`` column-major for ``dY @ W``,
    with their scales shaped as ``_scaled_mm`` wants them (``(1,)``, or ``(1, N)`` / ``(1, K)``)."""

    fprop: torch.Tensor
    fprop_scale: torch.Tensor
    dgrad: torch.Tensor
    dgrad_scale: torch.Tensor


def quantize_weight(weight: torch.Tensor, scaling: str) -> GemmWeight:
    """Both layouts of ``weight`` in FP8, from one read of it."""
    op = quantize(weight.detach(), WEIGHT_FP8, scaling, rowwise=True, columnwise=True)
    assert op.row is not None and op.col is not None and op.row_scale_inv is not None and op.col_scale_inv is not None
    if scaling == "tensorwise":
        return GemmWeight(op.row.t(), op.row_scale_inv, op.col.t(), op.col_scale_inv)
    return GemmWeight(op.row.t(), op.row_scale_inv.view(1, -1), op.col.t(), op.col_scale_inv.view(1, -1))


class WeightCache:
    """The FP8 operands of one weight, remade when the weight's version or storage changes."""

    __slots__ = ("_key", "_value")

    def __init__(self) -> None:
        self._key: Optional[tuple[object, ...]] = None
        self._value: Optional[GemmWeight] = None

    def clear(self) -> None:
        """Forget the cached copy (the next call quantizes again)."""
        self._key = None
        self._value = None

    def get(self, weight: torch.Tensor, scaling: str, refresh: bool = False) -> GemmWeight:
        """The FP8 operands of ``weight``, from the cache when it is current. ``refresh`` forces a
        new quantization (TransformerEngine's ``is_first_microbatch=True``)."""
        # (torch._C's query directly: torch.cuda's wrapper adds a Python frame to every call.)
        if weight.is_cuda and torch._C._cuda_isCurrentStreamCapturing():
            return quantize_weight(weight, scaling)
        key = (weight._version, weight.data_ptr(), weight.dtype, weight.shape, scaling)
        if refresh or key != self._key or self._value is None:
            self._value = quantize_weight(weight, scaling)
            self._key = key
        return self._value
