"""Quantized tensor storages and the save/restore protocol the offload engine relies on.

A quantized storage is a small Python object that owns a handful of plain tensors (FP8 data in
one or two layouts, float32 or uint8 scales, an optional amax). Autograd cannot save such an
object directly, so the storage follows TransformerEngine's duck-typed protocol:

.. code-block:: python

    tensors, restorable = storage.prepare_for_saving()   # list[Optional[Tensor]], object
    ctx.save_for_backward(*tensors)
    ctx.restorable = restorable
    ...  # backward
    restorable.restore_from_saved(list(ctx.saved_tensors))

``prepare_for_saving`` hands over the component tensors (``None`` for absent ones) and drops the
storage's own references, so the copy autograd keeps is the only one: the offload engine can then
move it to the host and really free the GPU memory. ``restore_from_saved`` puts (possibly other)
tensors back. The engine gives back each component as a typed *view* of one uint8 GPU buffer
(``buf[off:off + n].view(dtype).as_strided(shape, stride)``), so nothing here assumes that a
component owns its memory or is the only tensor living in its storage.

Storages here:

* :class:`Float8TensorStorage`: one float32 scale for the whole tensor ("tensorwise"). Rowwise data
  is ``(M, K)``; columnwise data is its transpose ``(K, M)`` made contiguous, with the same scale.
* :class:`Float8BlockwiseStorage`: float32 scales per row (``(M, 1)``) or per 1x128 / 128x128
  block. The columnwise data is quantized from the transpose with its own scales (``(K, 1)`` per
  row of the ``(K, M)`` transpose), because a per-row scale of ``X`` is not a per-row scale of
  ``X^T``.
* :class:`MXFP8TensorStorage`: OCP MX: one uint8 E8M0 scale (a power of two, ``2^(e - 127)``)
  per 32 consecutive elements along the contiguous dimension.

FP8 data may be held either as a ``torch.float8_*`` tensor or as uint8 holding the same bits
(``data.view(torch.uint8)``); :attr:`QuantizedStorage.fp8_dtype` says which format the bits are in.
"""

from __future__ import annotations

from .scaling import FP8_DTYPES, HIGH_PRECISION, MXFP8_BLOCK_SIZE, fp8_max, finite_amax, fp8_transpose, e8m0_to_float
from .storage import QuantizedStorage, dequantize
from .tensorwise import Float8TensorStorage, quantize_tensorwise
from .blockwise import Float8BlockwiseStorage, quantize_blockwise
from .mxfp8 import MXFP8TensorStorage, quantize_mxfp8

__all__ = [
    "FP8_DTYPES",
    "HIGH_PRECISION",
    "MXFP8_BLOCK_SIZE",
    "QuantizedStorage",
    "Float8TensorStorage",
    "Float8BlockwiseStorage",
    "MXFP8TensorStorage",
    "fp8_max",
    "finite_amax",
    "fp8_transpose",
    "e8m0_to_float",
    "quantize_tensorwise",
    "quantize_blockwise",
    "quantize_mxfp8",
    "dequantize",
]
