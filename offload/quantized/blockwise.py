"""float32 scales per row or per 1x128 / 128x128 block: :class:`Float8BlockwiseStorage` and its
quantizer."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .scaling import _cast_fp8, _check_fp8_dtype, _check_input, _check_usages, _scale_from_amax, finite_amax
from .storage import ScaledLayoutsStorage, _materialize


def _scale_shape(rows: int, cols: int, block: Optional[tuple[int, int]]) -> tuple[int, int]:
    if block is None:
        return (rows, 1)
    return (rows // block[0], cols // block[1])


def _quantize_blocks(
    a: torch.Tensor, fp8_dtype: torch.dtype, block: Optional[tuple[int, int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``a`` (R, C) with one float32 scale per row or per (br, bc) block.

    Returns ``(data (R, C), scale_inv)`` with scale_inv ``(R, 1)`` per row or ``(R/br, C/bc)``.
    """
    r, c = a.shape
    # contiguous(): ``a`` may be a transposed view (columnwise), and elementwise ops would keep
    # its strides; the data must come out row-major.
    af = a.float().contiguous()
    if block is None:
        amax = finite_amax(af, dim=1, keepdim=True)  # (R, 1)
        scale = _scale_from_amax(amax, fp8_dtype)
        q = _cast_fp8(af * scale, fp8_dtype)
    else:
        br, bc = block
        tiles = af.reshape(r // br, br, c // bc, bc)
        amax = finite_amax(tiles, dim=(1, 3))  # (R/br, C/bc)
        scale = _scale_from_amax(amax, fp8_dtype)
        q = _cast_fp8(tiles * scale[:, None, :, None], fp8_dtype).reshape(r, c)
    return q, torch.reciprocal(scale)


def _expand_block_scales(
    scale_inv: torch.Tensor, rows: int, cols: int, block: Optional[tuple[int, int]]
) -> torch.Tensor:
    """Broadcast per-row / per-block scales to a full ``(rows, cols)`` float32 matrix."""
    if block is None:
        return scale_inv.expand(rows, cols)
    br, bc = block
    return scale_inv.repeat_interleave(br, dim=0).repeat_interleave(bc, dim=1)


_BLOCKS: tuple[Optional[tuple[int, int]], ...] = (None, (1, 128), (128, 128))


class Float8BlockwiseStorage(ScaledLayoutsStorage):
    """FP8 data with float32 scales per row (``block=None``) or per 1x128 / 128x128 block.

    Components, in :meth:`prepare_for_saving` order: ``rowwise_data`` ``(M, K)``,
    ``rowwise_scale_inv`` float32 (``(M, 1)`` per row, ``(M, K/128)`` for 1x128,
    ``(M/128, K/128)`` for 128x128), ``columnwise_data`` ``(K, M)``, ``columnwise_scale_inv``
    float32 with the same rule applied to the ``(K, M)`` transpose (``(K, 1)`` per row).
    The columnwise pair is quantized from ``X^T`` directly: per-row scales of ``X^T`` are the
    per-column scales of ``X``, which is what a GEMM contracting over ``M`` (wgrad) needs.
    """

    def __init__(
        self,
        *,
        rowwise_data: Optional[torch.Tensor],
        rowwise_scale_inv: Optional[torch.Tensor],
        columnwise_data: Optional[torch.Tensor],
        columnwise_scale_inv: Optional[torch.Tensor],
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
        block: Optional[tuple[int, int]] = None,
        validate: bool = True,
    ) -> None:
        _check_fp8_dtype(fp8_dtype)
        self.block = _check_block(block)
        self.fp8_dtype = fp8_dtype
        self._set_layouts(rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv)
        self._finish_init(validate)

    def _validate(self) -> None:
        m, k = self.shape
        for usage, rows, cols in (("rowwise", m, k), ("columnwise", k, m)):
            data = getattr(self, f"{usage}_data")
            scale = getattr(self, f"{usage}_scale_inv")
            if (data is None) != (scale is None):
                raise ValueError(
                    f"Float8BlockwiseStorage: '{usage}_data' and '{usage}_scale_inv' come together"
                )
            self._check_data(f"{usage}_data", data, (rows, cols))
            self._check_scale(
                f"{usage}_scale_inv", scale, torch.float32, [_scale_shape(rows, cols, self.block)]
            )

    def dequantize(
        self, dtype: torch.dtype = torch.float32, *, usage: Optional[str] = None
    ) -> torch.Tensor:
        """``data * scale_inv`` (scales broadcast over their rows/blocks) as ``(M, K)``."""
        usage = self._pick_usage(usage)
        data = getattr(self, f"{usage}_data").view(self.fp8_dtype).float()
        scale = getattr(self, f"{usage}_scale_inv")
        out = data * _expand_block_scales(scale, data.shape[0], data.shape[1], self.block)
        if usage == "columnwise":
            out = out.t()
        return out.to(dtype)


def _check_block(block: Any) -> Optional[tuple[int, int]]:
    if block is not None:
        try:
            block = (int(block[0]), int(block[1]))
        except (TypeError, IndexError, ValueError):
            raise ValueError(
                f"block must be None (per row), (1, 128) or (128, 128), got {block!r}"
            ) from None
    if block not in _BLOCKS:
        raise ValueError(f"block must be None (per row), (1, 128) or (128, 128), got {block!r}")
    return block


def quantize_blockwise(
    x: torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    block: Optional[tuple[int, int]] = None,
    rowwise: bool = True,
    columnwise: bool = False,
    bulk: bool = False,
    as_uint8: bool = False,
) -> Float8BlockwiseStorage:
    """Quantize a 2-D ``(M, K)`` tensor with float32 scales per row or per block.

    Args:
        x: float32 / bfloat16 / float16 ``(M, K)`` tensor.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        block: ``None``: one scale per row (``(M, 1)``; what ``_scaled_mm`` rowwise scaling
            takes); ``(1, 128)`` or ``(128, 128)``: one scale per block. The block applies to the
            layout being produced (the ``(K, M)`` transpose for columnwise), so the blocked
            dimensions of each produced layout must be multiples of the block.
        rowwise / columnwise: which layouts to produce (see :class:`Float8BlockwiseStorage`).
        bulk: allocate all components as views of one uint8 buffer (256-byte aligned offsets).
        as_uint8: hold the FP8 bits as uint8 tensors.
    """
    fn = "quantize_blockwise"
    _check_input(x, fn)
    _check_fp8_dtype(fp8_dtype)
    _check_usages(rowwise, columnwise, fn)
    block = _check_block(block)
    m, k = x.shape
    if block is not None:
        br, bc = block
        for usage, rows, cols, on in (("rowwise", m, k, rowwise), ("columnwise", k, m, columnwise)):
            if on and (rows % br or cols % bc):
                raise ValueError(
                    f"{fn}: {usage} data of shape ({rows}, {cols}) is not a whole number of {br}x{bc} blocks; "
                    f"pad the tensor or use block=None (per-row scales)"
                )
    row = row_s = col = col_s = None
    if rowwise:
        row, row_s = _quantize_blocks(x, fp8_dtype, block)
    if columnwise:
        col, col_s = _quantize_blocks(x.t(), fp8_dtype, block)
    data_dtype = torch.uint8 if as_uint8 else fp8_dtype
    row, row_s, col, col_s = _materialize(
        [row, row_s, col, col_s],
        [data_dtype, torch.float32, data_dtype, torch.float32],
        bulk,
        x.device,
    )
    return Float8BlockwiseStorage(
        rowwise_data=row,
        rowwise_scale_inv=row_s,
        columnwise_data=col,
        columnwise_scale_inv=col_s,
        fp8_dtype=fp8_dtype,
        block=block,
    )


