"""A GELU whose saved input is FP8: the forward is ``F.gelu``'s, the backward reads an FP8 copy.

``nn.GELU`` saves its high-precision input for ``gelu_backward``. In an MLP block that input is
``4 * hidden`` wide, the largest activation after the second Linear's input; saved in bf16 it is
8 bytes per hidden unit per token. :class:`GELU` saves it as FP8 e4m3 with one float32 scale
(current tensorwise scaling, quantized by :func:`offload.fp8.cast.quantize`): half the bytes. The
FP8 data and its scale are saved as two tensors tagged with
:func:`~offload.engine.marks.mark_activation_offload`, so the offload engine packs the FP8 bytes and
their scale into the layer's region (the opt-in v1 schedule moves them too). Backward
dequantizes straight to the input's dtype (:func:`offload.fp8.cast.dequantize`; one fused kernel
on CUDA), without a float32 copy of the widest activation of the block at backward's peak.

The output is ``F.gelu(x)``, bit for bit: only what is kept for backward changes. The gradient is
``gelu_backward(dy, dequantize(x_fp8).to(x.dtype))``: GELU's derivative evaluated at the
FP8-rounded input, an approximation of the exact one. e4m3 keeps 3 mantissa bits, so an input
within ``2**15`` of the tensor's largest magnitude is off by at most 1/16 of its value; smaller
ones fall in the subnormal range and lose more, and those below about ``amax / 2**19`` become 0
(where the derivative, 0.5, is what it is near 0 anyway). Every step is deterministic, so gradients are bitwise repeatable, and
bitwise equal with and without offload (the engine restores the same bytes).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.marks import mark_activation_offload
from ..quantized import HIGH_PRECISION
from .cast import dequantize, quantize

__all__ = ["GELU", "APPROXIMATIONS"]

APPROXIMATIONS = ("none", "tanh")
# e4m3, as for the other forward activations: its one more mantissa bit than e5m2 halves the
# rounding of the point the derivative is taken at, and current scaling fits the tensor's range.
_SAVED_FP8 = torch.float8_e4m3fn


class _Fp8SavingGeluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, approximate: str) -> torch.Tensor:  # type: ignore[override]
        y = F.gelu(x, approximate=approximate)
        # quantize() takes 2-D tensors; tensorwise scaling does not care how the rows fall.
        x2 = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
        xq = quantize(x2, _SAVED_FP8, "tensorwise", rowwise=True, columnwise=False)
        # The FP8 data and its scale are saved as the plain tensors they are, marked so that the
        # opt-in v1 schedule moves them too (see fp8.linear).
        mark_activation_offload(xq.row, xq.row_scale_inv)
        ctx.save_for_backward(xq.row, xq.row_scale_inv)
        ctx.x_shape = x.shape
        ctx.x_dtype = x.dtype
        ctx.approximate = approximate
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        data, scale_inv = ctx.saved_tensors
        # Straight to the input's dtype: the input is 4x wider than the FP8 data and this runs at
        # backward's memory peak, so no float32 copy of it is made on the GPU.
        x = dequantize(data, scale_inv, _SAVED_FP8, ctx.x_dtype).reshape(ctx.x_shape)
        return torch.ops.aten.gelu_backward(dy, x, approximate=ctx.approximate), None


class GELU(nn.GELU):
    """:class:`torch.nn.GELU` that saves its input in FP8 e4m3 (tensorwise scale) for backward.

    Args:
        approximate: ``"none"`` (erf) or ``"tanh"``, as for :class:`torch.nn.GELU`.

    The forward output is exactly ``F.gelu(x, approximate=...)``; the gradient is GELU's
    derivative at the FP8-rounded input (see the module docstring), deterministic. Inputs are
    float32/bfloat16/float16 tensors on any device (no FP8 GEMM is involved). Without a gradient
    to compute (``no_grad``, or an input that does not require grad) nothing is quantized.
    """

    def __init__(self, approximate: str = "none") -> None:
        if approximate not in APPROXIMATIONS:
            raise ValueError(f"fp8.GELU: approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
        super().__init__(approximate=approximate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"fp8.GELU expects a torch.Tensor input, got {type(x).__name__}")
        if x.dtype not in HIGH_PRECISION:
            raise ValueError(f"fp8.GELU: input dtype must be float32, bfloat16 or float16, got {x.dtype}")
        if not (x.requires_grad and torch.is_grad_enabled()) or x.numel() == 0:
            # Nothing will be saved (or nothing worth quantizing): the plain op.
            return F.gelu(x, approximate=self.approximate)
        return _Fp8SavingGeluFunction.apply(x, self.approximate)
