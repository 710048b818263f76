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

Numerics. The output is ``F.silu(gate) * up`` bit for bit. The gradients are those of the
SwiGLU at the FP8-rounded inputs, with autograd's own ops (``du = dp * silu(g~)``,
``dg = silu_backward(dp * u~, g~)``); ``down_proj``'s fprop multiplies forward's exact product,
its wgrad the remade one, quantized again (e4m3 keeps 3 mantissa bits: up to 1/16 relative per
rounding, below that in the subnormal range; the tests bound the gradients' error against bf16).
Every step is deterministic, so gradients are bitwise equal with and without offload. The FP8
data and scales are tagged with :func:`~offload.marks.mark_activation_offload` (the v1 schedule
moves them). ``down_proj``'s backward (which runs first) keeps the dequantized ``g~``, ``u~`` and
``silu(g~)`` it made for :class:`SwiGLU`'s backward, which runs next.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..marks import mark_activation_offload
from ..quantized import HIGH_PRECISION
from .cast import dequantize, quantize
from .input_source import Recipe, attach_source

__all__ = ["SwiGLU", "SwiGLUMLP"]

# e4m3, as for fp8.GELU's saved input: one more mantissa bit than e5m2, and current scaling fits
# the tensor's range.
_SAVED_FP8 = torch.float8_e4m3fn

_Parts = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class _SwiGLURecipe(Recipe):
    """Dequantizes the saved ``(g8, g_scale, u8, u_scale)``; remakes the product for
    ``down_proj``'s wgrad and keeps the parts for the SwiGLU's own backward."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype) -> None:
        super().__init__()
        self.shape = shape
        self.dtype = dtype
        self._parts: Optional[_Parts] = None

    def parts(self, saved: Sequence[torch.Tensor]) -> _Parts:
        """``(g~, u~, silu(g~))`` in the inputs' dtype and shape."""
        g8, g_scale, u8, u_scale = saved
        g = dequantize(g8, g_scale, _SAVED_FP8, self.dtype).view(self.shape)
        u = dequantize(u8, u_scale, _SAVED_FP8, self.dtype).view(self.shape)
        return g, u, F.silu(g)

    def remake(self, saved: Sequence[torch.Tensor]) -> torch.Tensor:
        g, u, a = self._parts = self.parts(saved)
        return (a * u).view(-1, self.shape[-1])

    def take_parts(self, saved: Sequence[torch.Tensor]) -> _Parts:
        """The parts ``down_proj``'s backward made, or new ones (``down_proj`` is not an
        ``fp8.Linear``, or needed no wgrad)."""
        parts, self._parts = self._parts, None
        return parts if parts is not None else self.parts(saved)


def _quantize_saved(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 data and scale of ``t`` (any shape; tensorwise scaling does not care how rows fall)."""
    q = quantize(t.reshape(-1, t.shape[-1]), _SAVED_FP8, "tensorwise", rowwise=True, columnwise=False)
    assert q.row is not None and q.row_scale_inv is not None
    return q.row, q.row_scale_inv


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        product = F.silu(gate) * up
        g8, g_scale = _quantize_saved(gate)
        u8, u_scale = _quantize_saved(up)
        mark_activation_offload(g8, g_scale, u8, u_scale)
        ctx.save_for_backward(g8, g_scale, u8, u_scale)
        recipe = _SwiGLURecipe(gate.shape, gate.dtype)
        ctx.recipe = recipe
        # One consumer (down_proj): its rowwise operand is not worth keeping on the output.
        attach_source(product, (g8, g_scale, u8, u_scale), recipe, share_forward=False)
        return product

    @staticmethod
    def backward(ctx: Any, dp: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:  # type: ignore[override]
        g, u, a = ctx.recipe.take_parts(ctx.saved_tensors)
        du = dp * a if ctx.needs_input_grad[1] else None
        dg = torch.ops.aten.silu_backward(dp * u, g) if ctx.needs_input_grad[0] else None
        return dg, du


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
