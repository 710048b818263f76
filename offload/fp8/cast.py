"""Quantize a GEMM operand (and dequantize a saved one): the fused Triton kernels on CUDA, the
torch path everywhere else.

Both paths give the same bits (tested on the GPU), so which one ran never shows in a result. The
torch path is :mod:`offload.quantized`'s; it runs on CPU, where Triton is absent, for tensors of
2**31 elements or more (the kernels use 32-bit offsets), and with ``OFFLOAD_FP8_TRITON=0``.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any, NamedTuple, Optional

import torch

from .. import quantized as q

__all__ = [
    "Operand", "quantize", "dequantize", "transpose", "triton_available", "triton_module", "fusable", "on_device_of",
]

_TRITON_ENV = "OFFLOAD_FP8_TRITON"
_MAX_TRITON_NUMEL = (1 << 31) - 1


class Operand(NamedTuple):
    """One tensor quantized for FP8 GEMMs. ``row`` is ``(M, K)`` and ``col`` its transpose
    ``(K, M)``, both row-major, either may be None. Scales are float32 dequantization factors:
    ``(1,)`` for tensorwise (the same for both layouts), ``(M, 1)`` and ``(K, 1)`` per row."""

    row: Optional[torch.Tensor]
    row_scale_inv: Optional[torch.Tensor]
    col: Optional[torch.Tensor]
    col_scale_inv: Optional[torch.Tensor]


@functools.lru_cache(maxsize=1)
def _kernels() -> Any:
    """The Triton kernels module, imported on first CUDA use (importing Triton costs ~0.5 s), or
    None where Triton is absent or turned off. ``_kernels.cache_clear()`` re-reads the setting."""
    if os.environ.get(_TRITON_ENV, "1") == "0":
        return None
    try:
        from . import triton_cast  # noqa: PLC0415 - optional, and slow to import
    except Exception:  # noqa: BLE001 - absent or broken Triton: the torch path still works
        return None
    return triton_cast


def triton_available() -> bool:
    """True when CUDA tensors are quantized by the fused Triton kernels."""
    return torch.cuda.is_available() and _kernels() is not None


def quantize(
    x: torch.Tensor, fp8_dtype: torch.dtype, scaling: str, rowwise: bool, columnwise: bool
) -> Operand:
    """Quantize a 2-D ``(M, K)`` float tensor with current scaling (``"tensorwise"``: one scale;
    ``"rowwise"``: one per row of each layout), producing the layouts asked for."""
    if x.is_cuda and x.numel() <= _MAX_TRITON_NUMEL:
        kernels = _kernels()
        if kernels is not None:
            return on_device_of(x, _quantize_fused, kernels, x, fp8_dtype, scaling, rowwise, columnwise)
    if scaling == "tensorwise":
        s = q.quantize_tensorwise(x, fp8_dtype, rowwise=rowwise, columnwise=columnwise)
        return Operand(s.rowwise_data, s.scale_inv, s.columnwise_data, s.scale_inv)
    b = q.quantize_blockwise(x, fp8_dtype, rowwise=rowwise, columnwise=columnwise)
    return Operand(b.rowwise_data, b.rowwise_scale_inv, b.columnwise_data, b.columnwise_scale_inv)


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, fp8_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """``data * scale_inv`` as ``dtype``: FP8 data (or its uint8 bits) with one float32 scale, by
    the fused kernel on CUDA (no float32 transient) and the torch path elsewhere, the same bits."""
    if data.dtype != fp8_dtype:
        data = data.view(fp8_dtype)
    if data.is_cuda and data.is_contiguous() and data.numel() <= _MAX_TRITON_NUMEL:
        kernels = _kernels()
        if kernels is not None:
            return on_device_of(data, kernels.dequantize_tensorwise_fused, data, scale_inv, dtype)
    return q.scaling.dequantize_tensorwise(data, scale_inv, fp8_dtype, dtype)


def transpose(data: torch.Tensor) -> torch.Tensor:
    """The contiguous transpose of contiguous 2-D FP8 ``data``: a tiled Triton kernel on CUDA
    (:mod:`.triton_transpose`), torch's copy of the transposed view elsewhere; the same bytes."""
    if data.is_cuda and data.numel() <= _MAX_TRITON_NUMEL and data.is_contiguous():
        kernels = triton_module("triton_transpose")
        if kernels is not None:
            return on_device_of(data, kernels.transpose_bytes, data)
    return data.t().contiguous()


def fusable(*tensors: torch.Tensor) -> bool:
    """Whether CUDA tensors this size can go to a fused Triton kernel (32-bit offsets)."""
    return all(t.is_cuda and t.numel() <= _MAX_TRITON_NUMEL for t in tensors)


def triton_module(name: str) -> Any:
    """The Triton kernels module ``offload.fp8.<name>`` wherever :func:`_kernels` loads (the same
    ``OFFLOAD_FP8_TRITON`` setting and Triton), else None."""
    return None if _kernels() is None else _import_kernels(name)


@functools.lru_cache(maxsize=None)
def _import_kernels(name: str) -> Any:
    # Cached: an import statement costs host time on every call of an op that asks.
    return importlib.import_module(f"{__package__}.{name}")


def on_device_of(x: torch.Tensor, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` with ``x``'s device current: the kernels launch into the current device's
    context, as Triton's own launcher does."""
    if torch._C._cuda_getDevice() == x.device.index:
        return fn(*args)
    with torch.cuda.device(x.device):
        return fn(*args)


def _quantize_fused(
    kernels: Any, x: torch.Tensor, fp8_dtype: torch.dtype, scaling: str, rowwise: bool, columnwise: bool
) -> Operand:
    if scaling == "tensorwise":
        row, col, scale_inv = kernels.quantize_tensorwise_fused(x, fp8_dtype, rowwise, columnwise)
        return Operand(row, scale_inv, col, scale_inv)
    return Operand(*kernels.quantize_rowwise_fused(x, fp8_dtype, rowwise, columnwise))
