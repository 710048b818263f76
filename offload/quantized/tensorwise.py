"""One float32 scale for the whole tensor: :class:`Float8TensorStorage` and its quantizer."""

from __future__ import annotations

from typing import ClassVar, Optional

import torch

from .scaling import (
    _cast_fp8, _check_fp8_dtype, _check_input, _check_usages, _scale_from_amax, dequantize_tensorwise, finite_amax,
    fp8_transpose,
)
from .storage import QuantizedStorage, _materialize


class Float8TensorStorage(QuantizedStorage):
    """FP8 data with one float32 scale for the whole tensor.

    Components, in :meth:`prepare_for_saving` order: ``rowwise_data`` ``(M, K)``,
    ``columnwise_data`` ``(K, M)`` (the contiguous transpose, same scale), ``scale_inv`` float32
    ``(1,)`` or ``()`` (dequantized = data * scale_inv), ``amax`` float32 ``(1,)`` or ``()``
    (optional). Data is ``fp8_dtype`` or uint8 holding its bits.
    """

    _COMPONENTS: ClassVar[tuple[str, ...]] = (
        "rowwise_data",
        "columnwise_data",
        "scale_inv",
        "amax",
    )

    def __init__(
        self,
        *,
        rowwise_data: Optional[torch.Tensor],
        columnwise_data: Optional[torch.Tensor],
        scale_inv: torch.Tensor,
        amax: Optional[torch.Tensor] = None,
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
        validate: bool = True,
    ) -> None:
        _check_fp8_dtype(fp8_dtype)
        self.fp8_dtype = fp8_dtype
        self.rowwise_data = rowwise_data
        self.columnwise_data = columnwise_data
        self.scale_inv = scale_inv
        self.amax = amax
        self.rowwise_usage = rowwise_data is not None
        self.columnwise_usage = columnwise_data is not None
        if rowwise_data is not None:
            if rowwise_data.dim() != 2:
                raise ValueError("Float8TensorStorage: 'rowwise_data' must be 2-D")
            self.shape = (rowwise_data.shape[0], rowwise_data.shape[1])
        elif columnwise_data is not None:
            if columnwise_data.dim() != 2:
                raise ValueError("Float8TensorStorage: 'columnwise_data' must be 2-D")
            self.shape = (columnwise_data.shape[1], columnwise_data.shape[0])
        else:
            raise ValueError("Float8TensorStorage needs rowwise_data or columnwise_data")
        self._finish_init(validate)

    def _validate(self) -> None:
        m, k = self.shape
        self._check_data("rowwise_data", self.rowwise_data, (m, k))
        self._check_data("columnwise_data", self.columnwise_data, (k, m))
        if self.scale_inv is None:
            raise ValueError("Float8TensorStorage: 'scale_inv' is required")
        self._check_scale("scale_inv", self.scale_inv, torch.float32, [(1,), ()])
        self._check_scale("amax", self.amax, torch.float32, [(1,), ()])

    def update_usage(
        self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None
    ) -> None:
        """Add or drop a layout. With one scale for the tensor, either layout is an exact
        transpose of the other, so a missing one is made with :func:`fp8_transpose`."""
        self._require_live("update_usage")
        want_row = self.rowwise_usage if rowwise_usage is None else bool(rowwise_usage)
        want_col = self.columnwise_usage if columnwise_usage is None else bool(columnwise_usage)
        if not (want_row or want_col):
            raise ValueError("Float8TensorStorage.update_usage: cannot drop both usages")
        if want_row and self.rowwise_data is None:
            self.rowwise_data = fp8_transpose(self.columnwise_data)
        if want_col and self.columnwise_data is None:
            self.columnwise_data = fp8_transpose(self.rowwise_data)
        if not want_row:
            self.rowwise_data = None
        if not want_col:
            self.columnwise_data = None
        self.rowwise_usage, self.columnwise_usage = want_row, want_col
        self._finish_init()

    def dequantize(
        self, dtype: torch.dtype = torch.float32, *, usage: Optional[str] = None
    ) -> torch.Tensor:
        """``data * scale_inv`` as an ``(M, K)`` tensor of ``dtype``."""
        usage = self._pick_usage(usage)
        if usage == "rowwise":
            return dequantize_tensorwise(self.rowwise_data, self.scale_inv, self.fp8_dtype, dtype)
        return dequantize_tensorwise(self.columnwise_data, self.scale_inv, self.fp8_dtype, dtype).t()


def quantize_tensorwise(
    x: torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    scale: Optional[torch.Tensor] = None,
    bulk: bool = False,
    as_uint8: bool = False,
) -> Float8TensorStorage:
    """Quantize a 2-D ``(M, K)`` tensor with one float32 scale (current scaling by default).

    Args:
        x: float32 / bfloat16 / float16 ``(M, K)`` tensor.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        rowwise: produce ``rowwise_data`` ``(M, K)``.
        columnwise: produce ``columnwise_data`` ``(K, M)``, the contiguous transpose.
        scale: optional float32 scale (delayed scaling); default ``fp8_max / amax(x)``, with
            amax == 0 giving scale 1.
        bulk: allocate all components as views of one uint8 buffer (256-byte aligned offsets).
        as_uint8: hold the FP8 bits as uint8 tensors instead of ``fp8_dtype`` tensors.
    """
    fn = "quantize_tensorwise"
    _check_input(x, fn)
    _check_fp8_dtype(fp8_dtype)
    _check_usages(rowwise, columnwise, fn)
    amax = finite_amax(x).reshape(1)
    if scale is None:
        scale = _scale_from_amax(amax, fp8_dtype)
    else:
        if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
            raise ValueError(f"{fn}: scale must be a one-element float32 tensor")
        scale = scale.to(torch.float32).reshape(1)
    scale_inv = torch.reciprocal(scale)
    # contiguous(): elementwise ops keep the input's strides, and the data must be row-major.
    q = _cast_fp8(x.float().contiguous() * scale, fp8_dtype)
    row = q if rowwise else None
    col = fp8_transpose(q) if columnwise else None
    data_dtype = torch.uint8 if as_uint8 else fp8_dtype
    row, col, scale_inv, amax = _materialize(
        [row, col, scale_inv, amax],
        [data_dtype, data_dtype, torch.float32, torch.float32],
        bulk,
        x.device,
    )
    return Float8TensorStorage(
        rowwise_data=row, columnwise_data=col, scale_inv=scale_inv, amax=amax, fp8_dtype=fp8_dtype
    )


