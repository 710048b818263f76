"""An ``fp8.Linear`` input that the op producing it can remake in backward, so the Linear saves
no copy of it.

In a Llama layer one RMSNorm output feeds three Linears (``q_proj``, ``k_proj``, ``v_proj``) and
another feeds two (``gate_proj``, ``up_proj``); the SwiGLU product feeds ``down_proj``. A plain
:class:`~offload.fp8.Linear` quantizes its input itself and saves its own columnwise FP8 copy: one
copy per Linear, next to what the producing op saves anyway. Here the producer
(:class:`~offload.fp8.RMSNorm`, :class:`~offload.fp8.SwiGLU`) attaches an :class:`InputSource` to
its output tensor object, and every ``fp8.Linear`` called on that very object (checked by the
versions of it and of the source's tensors) takes :class:`_SourcedLinearFunction` instead:

* forward: the rowwise FP8 operand comes from the source, quantized once per (format, scaling)
  for all the Linears the output feeds;
* saved: the source's tensors (the ones the producer saves anyway: the same objects, so nothing
  new is held, and the offload engine stores a storage saved twice once) and the weight;
* backward: the source's :class:`Recipe` remakes the input from those tensors and quantizes its
  columnwise copy for wgrad, once for all the Linears of one forward.

Lifetimes. The source lives on the output tensor object and dies with it (in an HF layer, when
the attention or MLP forward that used it returns). It holds forward's tensors, so autograd's
graph never references it: ``ctx`` keeps only the recipe, which holds no forward tensor (a
reference from ``ctx`` to a saved tensor outside ``save_for_backward`` would pin it on the GPU
under offload). The recipe's cache holds a columnwise operand from the first consumer's backward
to the last one's; if some consumer's backward never runs, until the graph is freed.

Outputs are bitwise those of a plain ``fp8.Linear`` on the same input (the same quantization).
The weight gradient is too when the recipe remakes the input exactly (RMSNorm: deterministic
float ops on the saved input); see :mod:`offload.fp8.swiglu` for the one that does not.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from .cast import Operand, quantize
from .linear import INPUT_SOURCE_ATTR, LinearCall, fprop, linear_grads, remember_call

__all__ = ["InputSource", "Recipe", "attach_source"]

_Key = tuple[torch.dtype, str]


class Recipe:
    """How to remake a Linear input from the tensors its source saves, shared by the consumers of
    one forward. Holds no forward tensor (see the module docstring); subclasses define
    :meth:`remake`."""

    def __init__(self) -> None:
        self._consumers = 0
        self._served = 0
        self._cache: dict[_Key, tuple[torch.Tensor, torch.Tensor]] = {}

    def remake(self, saved: Sequence[torch.Tensor]) -> torch.Tensor:
        """The ``(M, K)`` high-precision input, from the source's saved tensors as restored."""
        raise NotImplementedError

    def join(self) -> None:
        """A consumer that will ask for the wgrad operand in backward (called in its forward)."""
        self._consumers += 1

    def wgrad_operand(self, saved: Sequence[torch.Tensor], fp8_dtype: torch.dtype, scaling: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The columnwise FP8 input and its scale: remade and quantized by the first consumer
        that asks, kept for the others of the same forward."""
        key = (fp8_dtype, scaling)
        operand = self._cache.get(key)
        if operand is None:
            xq = quantize(self.remake(saved), fp8_dtype, scaling, rowwise=False, columnwise=True)
            assert xq.col is not None and xq.col_scale_inv is not None
            operand = (xq.col, xq.col_scale_inv)
            if self._consumers > 1:
                self._cache[key] = operand
        return operand

    def served(self) -> None:
        """A joined consumer's backward is done; the last one drops the cache (and a second
        backward of a retained graph starts counting again)."""
        self._served += 1
        if self._served >= self._consumers:
            self._cache.clear()
            self._served = 0


class InputSource:
    """Attached to a producer's output: the tensors a consumer saves in its place, the recipe, and
    forward's rowwise operands. ``share_forward``: keep each rowwise operand for the next consumer
    (an output that feeds several Linears); otherwise it is made for each call and not kept."""

    __slots__ = ("tensors", "recipe", "share_forward", "_versions", "_operands")

    def __init__(self, output: torch.Tensor, tensors: tuple[torch.Tensor, ...], recipe: Recipe, share_forward: bool) -> None:
        self.tensors = tensors
        self.recipe = recipe
        self.share_forward = share_forward
        self._versions = (output._version,) + tuple(t._version for t in tensors)
        self._operands: dict[_Key, Operand] = {}

    def usable(self, x: torch.Tensor) -> bool:
        """False once ``x`` (the output) or a saved tensor was changed in place since forward:
        the remade input would not be the one the Linear multiplies."""
        return (x._version,) + tuple(t._version for t in self.tensors) == self._versions

    def forward_operand(self, x2: torch.Tensor, fp8_dtype: torch.dtype, scaling: str) -> Operand:
        """The rowwise FP8 operand of ``x2`` (the output as ``(M, K)``)."""
        key = (fp8_dtype, scaling)
        operand = self._operands.get(key)
        if operand is None:
            operand = quantize(x2, fp8_dtype, scaling, rowwise=True, columnwise=False)
            if self.share_forward:
                self._operands[key] = operand
        return operand

    def linear(self, x: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], call: LinearCall) -> Optional[torch.Tensor]:
        """``fp8.Linear``'s forward on ``x`` (flattened ``x2``) through this source, or None when
        the source is stale (the Linear then quantizes and saves as usual)."""
        if not self.usable(x):
            return None
        return _SourcedLinearFunction.apply(x2, weight, bias, call, self)


def attach_source(output: torch.Tensor, tensors: tuple[torch.Tensor, ...], recipe: Recipe, share_forward: bool) -> None:
    """Make the ``fp8.Linear``s called on ``output`` save ``tensors`` and remake their wgrad
    operand with ``recipe`` (``tensors`` must be saved by the producer too)."""
    setattr(output, INPUT_SOURCE_ATTR, InputSource(output, tensors, recipe, share_forward))


class _SourcedLinearFunction(torch.autograd.Function):
    """``fp8.Linear``'s three GEMMs, with the input's FP8 operands from an :class:`InputSource`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x2: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        call: LinearCall,
        source: InputSource,
    ) -> torch.Tensor:
        module = call.module
        scaling = module.scaling
        xq = source.forward_operand(x2, module.fp8_dtype, scaling)
        w = module.weight_cache.get(weight, scaling, call.refresh_weight)
        y = fprop(xq, w, bias, x2.dtype)
        if call.need_wgrad:
            source.recipe.join()
            # The source's tensors are saved (and marked) by the producer already: saving the
            # same objects again holds nothing new.
            ctx.save_for_backward(*source.tensors, weight)
            ctx.recipe = source.recipe
        else:
            ctx.save_for_backward(weight)  # autograd's version check, as in fp8.Linear
            ctx.recipe = None
        remember_call(ctx, module, w, x2.dtype, bias)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        saved = ctx.saved_tensors
        recipe: Optional[Recipe] = ctx.recipe
        need_wgrad = ctx.needs_input_grad[1] and recipe is not None
        grads = linear_grads(
            ctx, dy, saved[-1], need_wgrad, lambda: recipe.wgrad_operand(saved[:-1], ctx.fp8_dtype, ctx.scaling)
        )
        if recipe is not None:
            recipe.served()
        return (*grads, None, None)
