"""SwiGLU (``silu(gate) * up``) whose backward reads only FP8 copies of its two inputs, and the
Llama MLP built on it.

``LlamaMLP`` computes ``down_proj(silu(gate_proj(x)) * up_proj(x))``. Under autograd SiLU saves
``gate`` and the product saves ``silu(gate)`` and ``up``: three bf16 tensors of the intermediate
width ``I``, 6 bytes per unit per token, and ``down_proj`` saves its input too (2 bytes in bf16,
1 as ``fp8.Linear``'s FP8 copy). :class:`SwiGLU` saves ``gate`` and ``up`` in FP8 e4m3 with one
float32 scale each (current tensorwise scaling, as :class:`~offload.fp8.GELU` does): 2 bytes per
unit per token for the whole block, since its output carries an
:class:`~offload.fp8.input_source.InputSource` and ``down_proj`` (an ``fp8.Linear``) remakes its
wgrad operand from the same two FP8 copies instead of saving one: ``silu(g~) * u~`` with ``g~``,
``u~`` the dequantized copies. Saving ``down_proj``'s FP8 input instead would cost one more byte
per unit per token (3 against 2: at the LLAMA-2B shape, ``I = 14336``, 14 KiB per token per layer,
0.9 GiB over 8 layers of 8192 tokens) for a less approximate wgrad operand.

Numerics. The output is ``F.silu(gate) * up``. The gradients are those of the SwiGLU at the
FP8-rounded inputs, with autograd's own ops (``du = dp * silu(g~)``,
``dg = silu_backward(dp * u~, g~)``); ``down_proj``'s fprop multiplies forward's exact product,
its wgrad the remade one, quantized again (e4m3 keeps 3 mantissa bits: up to 1/16 relative per
rounding, below that in the subnormal range; the tests bound the gradients' error against bf16).
Every step is deterministic, so gradients are bitwise equal with and without offload. The FP8
data and scales are tagged with :func:`~offload.engine.marks.mark_activation_offload` (the v1 schedule
moves them).

Two implementations of the same arithmetic: on CUDA one Triton kernel per step
(:mod:`.triton_swiglu`, with torch's ``silu`` and roundings, so the same bits as the torch ops
where libdevice's ``expf`` is CUDA's); elsewhere those torch ops. Neither keeps anything between
``down_proj``'s backward and the SwiGLU's: each remakes what it needs from the FP8 copies.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.marks import mark_activation_offload
from ..quantized import HIGH_PRECISION
from .cast import dequantize, fusable, on_device_of, quantize, triton_module
from .input_source import Recipe, attach_source

__all__ = ["SwiGLU", "SwiGLUMLP", "swiglu_forward", "remake_product", "swiglu_grads"]

# e4m3, as for fp8.GELU's saved input: one more mantissa bit than e5m2, and current scaling fits
# the tensor's range.
_SAVED_FP8 = torch.float8_e4m3fn


_Saved = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _fused(*tensors: torch.Tensor) -> Any:
    """The Triton SwiGLU kernels when they take ``tensors`` (CUDA), else None."""
    return triton_module("triton_swiglu") if fusable(*tensors) else None


def _quantize_saved(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 data and scale of ``t`` (any shape; tensorwise scaling does not care how rows fall)."""
    q = quantize(t.reshape(-1, t.shape[-1]), _SAVED_FP8, "tensorwise", rowwise=True, columnwise=False)
    assert q.row is not None and q.row_scale_inv is not None
    return q.row, q.row_scale_inv


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, _Saved]:
    """``F.silu(gate) * up`` and the saved ``(g8, g_scale_inv, u8, u_scale_inv)``: e4m3 copies
    ``(rows, width)`` of both inputs with their ``(1,)`` float32 scales."""
    kernels = _fused(gate, up)
    if kernels is None:
        product = F.silu(gate) * up
        return product, (*_quantize_saved(gate), *_quantize_saved(up))
    width = gate.shape[-1]
    product, g8, g_sinv, u8, u_sinv = on_device_of(gate, kernels.swiglu_forward, gate.contiguous(), up.contiguous())
    return product, (g8.view(-1, width), g_sinv, u8.view(-1, width), u_sinv)


def _dequantized(saved: Sequence[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g8, g_scale, u8, u_scale = saved
    return dequantize(g8, g_scale, _SAVED_FP8, dtype), dequantize(u8, u_scale, _SAVED_FP8, dtype)


def remake_product(saved: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``F.silu(g~) * u~`` ``(rows, width)`` from the saved FP8 copies."""
    g8, g_scale, u8, u_scale = saved
    kernels = _fused(g8)
    if kernels is None:
        g, u = _dequantized(saved, dtype)
        return F.silu(g) * u
    # (contiguous(): the kernels read flat data; restored copies normally are, at no cost.)
    return on_device_of(g8, kernels.swiglu_remake, g8.contiguous(), g_scale, u8.contiguous(), u_scale, dtype).view(g8.shape)


def swiglu_grads(dp: torch.Tensor, saved: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dgate, dup)`` shaped as ``dp``: the SwiGLU's gradients at the dequantized saved copies."""
    g8, g_scale, u8, u_scale = saved
    kernels = _fused(dp, g8)
    if kernels is None:
        g, u = (t.view(dp.shape) for t in _dequantized(saved, dp.dtype))
        return torch.ops.aten.silu_backward(dp * u, g), dp * F.silu(g)
    dg, du = on_device_of(dp, kernels.swiglu_backward, dp.contiguous(), g8.contiguous(), g_scale, u8.contiguous(), u_scale)
    return dg.view(dp.shape), du.view(dp.shape)


class _SwiGLURecipe(Recipe):
    """Remakes the product for ``down_proj``'s wgrad from the saved ``(g8, g_scale, u8, u_scale)``."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def remake(self, saved: Sequence[torch.Tensor]) -> torch.Tensor:
        return remake_product(saved, self.dtype)


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        product, saved = swiglu_forward(gate, up)
        mark_activation_offload(*saved)
        ctx.save_for_backward(*saved)
        # One consumer (down_proj): its rowwise operand is not worth keeping on the output.
        attach_source(product, saved, _SwiGLURecipe(gate.dtype), share_forward=False)
        return product

    @staticmethod
    def backward(ctx: Any, dp: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:  # type: ignore[override]
        dg, du = swiglu_grads(dp, ctx.saved_tensors)
        return (dg if ctx.needs_input_grad[0] else None), (du if ctx.needs_input_grad[1] else None)


def _check_inputs(gate: Any, up: Any) -> None:
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"fp8.SwiGLU expects tensors, got {type(t).__name__} for {name}")
        if t.dtype not in HIGH_PRECISION:
            raise ValueError(f"fp8.SwiGLU: {name} dtype must be float32, bfloat16 or float16, got {t.dtype}")
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(
            f"fp8.SwiGLU: gate and up must match in shape, dtype and device; got {tuple(gate.shape)} "
            f"{gate.dtype} {gate.device} and {tuple(up.shape)} {up.dtype} {up.device}"
        )


class SwiGLU(nn.Module):
    """``F.silu(gate) * up``, saving ``gate`` and ``up`` in FP8 e4m3 (one tensorwise scale each)
    for backward; an ``fp8.Linear`` fed its output remakes its wgrad operand from those copies
    (module docstring). Without a gradient to compute nothing is quantized."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        _check_inputs(gate, up)
        if not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)) or gate.numel() == 0:
            return F.silu(gate) * up
        return _SwiGLUFunction.apply(gate, up)


class SwiGLUMLP(nn.Module):
    """A Llama MLP, ``down_proj(silu(gate_proj(x)) * up_proj(x))``, through :class:`SwiGLU`.

    :meth:`from_module` moves an existing MLP's ``gate_proj``, ``up_proj`` and ``down_proj``
    modules (the same objects, under the same names: state dict keys and optimizers see no
    change). The Linears may be ``nn.Linear`` or ``fp8.Linear``; only an ``fp8.Linear`` as
    ``down_proj`` skips saving its input.
    """

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module) -> None:
        super().__init__()
        self.gate_proj = gate_proj
        self.up_proj = up_proj
        self.down_proj = down_proj
        self.act = SwiGLU()
        # What code reading a LlamaMLP may look at.
        self.hidden_size = getattr(gate_proj, "in_features", None)
        self.intermediate_size = getattr(gate_proj, "out_features", None)

    @classmethod
    def from_module(cls, mlp: nn.Module) -> "SwiGLUMLP":
        """A :class:`SwiGLUMLP` with ``mlp``'s three projections; ``mlp`` is kept, unregistered,
        for :func:`offload.fp8.restore_llama_ops`."""
        new = cls(mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        object.__setattr__(new, "original", mlp)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))
