"""OCP MX: one E8M0 scale per 32 elements: :class:`MXFP8TensorStorage` and its quantizer."""

from __future__ import annotations

from typing import Optional

import torch

from .scaling import MXFP8_BLOCK_SIZE, _E8M0_BIAS, _FP8_EMAX, _cast_fp8, _check_fp8_dtype, _check_input, _check_usages, _exp2_int, e8m0_to_float, finite_amax
from .storage import ScaledLayoutsStorage, _materialize


def _quantize_mx(a: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """MX-quantize ``a`` (R, C) along C: returns data (R, C) and uint8 E8M0 scales (R, C/32).

    The shared exponent of a block is ``floor(log2(amax)) - emax(fp8_dtype)`` (OCP MX v1.0), so
    the block's largest element lands in the top binade of the element format; the few values
    that then exceed the format's max (e.g. 1.9 * 2^8 > 448) saturate. ``torch.frexp`` gives
    ``floor(log2(amax))`` exactly (``amax = m * 2^e``, ``m`` in [0.5, 1) -> ``e - 1``).
    """
    r, c = a.shape
    blocks = a.float().contiguous().reshape(r, c // MXFP8_BLOCK_SIZE, MXFP8_BLOCK_SIZE)
    amax = finite_amax(blocks, dim=2)  # (R, C/32)
    _, e = torch.frexp(amax)
    shared = (e.to(torch.int32) - 1) - _FP8_EMAX[fp8_dtype]
    # All-zero blocks: scale 1 (biased 127); any scale would do, this one is easy to read.
    shared = torch.where(amax > 0, shared, torch.zeros_like(shared))
    biased = (shared + _E8M0_BIAS).clamp(0, 254)  # 255 is NaN in E8M0
    inv = _exp2_int(_E8M0_BIAS - biased)  # 2^-(shared exponent), exact
    q = _cast_fp8(blocks * inv[:, :, None], fp8_dtype).reshape(r, c)
    return q, biased.to(torch.uint8)


class MXFP8TensorStorage(ScaledLayoutsStorage):
    """MXFP8: FP8 data with one uint8 E8M0 scale (``2^(e - 127)``) per 32 contiguous elements.

    Components, in :meth:`prepare_for_saving` order: ``rowwise_data`` ``(M, K)``,
    ``rowwise_scale_inv`` uint8 ``(M, K/32)``, ``columnwise_data`` ``(K, M)``,
    ``columnwise_scale_inv`` uint8 ``(K, M/32)``. Scales are kept in plain row-major order (not
    the swizzled layout block-scaled GEMM kernels consume).
    """

    def __init__(
        self,
        *,
        rowwise_data: Optional[torch.Tensor],
        rowwise_scale_inv: Optional[torch.Tensor],
        columnwise_data: Optional[torch.Tensor],
        columnwise_scale_inv: Optional[torch.Tensor],
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    ) -> None:
        _check_fp8_dtype(fp8_dtype)
        self.fp8_dtype = fp8_dtype
        self._set_layouts(rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv)
        self._finish_init()

    def _validate(self) -> None:
        m, k = self.shape
        for usage, rows, cols in (("rowwise", m, k), ("columnwise", k, m)):
            data = getattr(self, f"{usage}_data")
            scale = getattr(self, f"{usage}_scale_inv")
            if (data is None) != (scale is None):
                raise ValueError(
                    f"MXFP8TensorStorage: '{usage}_data' and '{usage}_scale_inv' come together"
                )
            if data is None:
                continue
            if cols % MXFP8_BLOCK_SIZE:
                raise ValueError(
                    f"MXFP8TensorStorage: {usage} data has {cols} contiguous elements per row, "
                    f"not a multiple of {MXFP8_BLOCK_SIZE}"
                )
            self._check_data(f"{usage}_data", data, (rows, cols))
            self._check_scale(
                f"{usage}_scale_inv", scale, torch.uint8, [(rows, cols // MXFP8_BLOCK_SIZE)]
            )

    def dequantize(
        self, dtype: torch.dtype = torch.float32, *, usage: Optional[str] = None
    ) -> torch.Tensor:
        """``data * 2^(e - 127)`` per 32-element block, as ``(M, K)``."""
        usage = self._pick_usage(usage)
        data = getattr(self, f"{usage}_data").view(self.fp8_dtype).float()
        scale = e8m0_to_float(getattr(self, f"{usage}_scale_inv"))
        r, c = data.shape
        out = (
            data.reshape(r, c // MXFP8_BLOCK_SIZE, MXFP8_BLOCK_SIZE) * scale[:, :, None]
        ).reshape(r, c)
        if usage == "columnwise":
            out = out.t()
        return out.to(dtype)


def quantize_mxfp8(
    x: torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    bulk: bool = False,
    as_uint8: bool = False,
) -> MXFP8TensorStorage:
    """MXFP8-quantize a 2-D ``(M, K)`` tensor: E8M0 scales per 32 elements of the contiguous dim.

    Rowwise needs ``K % 32 == 0`` (scales ``(M, K/32)``); columnwise quantizes the ``(K, M)``
    transpose along ``M`` and needs ``M % 32 == 0`` (scales ``(K, M/32)``).
    ``bulk`` / ``as_uint8`` as in :func:`quantize_tensorwise`.
    """
    fn = "quantize_mxfp8"
    _check_input(x, fn)
    _check_fp8_dtype(fp8_dtype)
    _check_usages(rowwise, columnwise, fn)
    m, k = x.shape
    if rowwise and k % MXFP8_BLOCK_SIZE:
        raise ValueError(
            f"{fn}: K={k} (the last dim) must be a multiple of {MXFP8_BLOCK_SIZE} for rowwise MXFP8 "
            f"(one E8M0 scale per {MXFP8_BLOCK_SIZE} elements); pad the tensor"
        )
    if columnwise and m % MXFP8_BLOCK_SIZE:
        raise ValueError(
            f"{fn}: M={m} (the first dim) must be a multiple of {MXFP8_BLOCK_SIZE} for columnwise MXFP8 "
            f"(one E8M0 scale per {MXFP8_BLOCK_SIZE} elements of the transpose); pad the tensor"
        )
    row = row_s = col = col_s = None
    if rowwise:
        row, row_s = _quantize_mx(x, fp8_dtype)
    if columnwise:
        col, col_s = _quantize_mx(x.t(), fp8_dtype)
    data_dtype = torch.uint8 if as_uint8 else fp8_dtype
    row, row_s, col, col_s = _materialize(
        [row, row_s, col, col_s], [data_dtype, torch.uint8, data_dtype, torch.uint8], bulk, x.device
    )
    return MXFP8TensorStorage(
        rowwise_data=row,
        rowwise_scale_inv=row_s,
        columnwise_data=col,
        columnwise_scale_inv=col_s,
        fp8_dtype=fp8_dtype,
    )
