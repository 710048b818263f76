"""LayerNorm fused with the input quantization of an FP8 ``Linear``, saving only the LN input.

A plain ``LayerNorm -> Linear`` pair saves the LN input (for the LN backward) *and* the LN output
(the Linear's input, for wgrad): two activations of ``(M, K)``. :class:`LayerNormLinear` saves
only the first, plus LayerNorm's per-row ``mean`` and ``rstd`` (``(M, 1)`` each)::

    forward:   ln_out, mean, rstd = native_layer_norm(x)        ln_out is not saved
               Y = quantize_rowwise(ln_out) @ W^T (+ b)          one FP8 GEMM
    backward:  dLN = dY @ W                                      FP8 dgrad GEMM
               dX, dgamma, dbeta = native_layer_norm_backward(dLN, x, mean, rstd, ...)
               ln_out = native_layer_norm(x)                     recomputed for wgrad
               dW = dY^T @ quantize_columnwise(ln_out)           FP8 wgrad GEMM

The wgrad operand is recomputed rather than saved: ``native_layer_norm`` is deterministic (no
atomics; the same kernel on the same inputs gives the same bits), so the recomputed ``ln_out``
is bitwise forward's, and so is its FP8 quantization (current scaling: the scale comes from the
recomputed tensor's amax, which is forward's amax). Saving the columnwise FP8 ``ln_out`` instead
would cost ``K`` bytes per token; the recompute costs one LayerNorm and one quantization in
backward. The saved ``x`` is a plain high-precision tensor that the offload engine moves like
any other (it is tagged with :func:`~offload.engine.marks.mark_activation_offload`, as
TransformerEngine's LayerNormLinear tags its input, so the opt-in v1 schedule moves it too).
``mean``/``rstd`` are whatever ``native_layer_norm`` returns (float32 on CUDA; on CPU the
input's dtype unless the LN weight is float32), exactly what ``nn.LayerNorm`` saves.

Parameters (state dict keys), as in TransformerEngine's ``LayerNormLinear``:

* ``layer_norm_weight``, ``layer_norm_bias`` ``(in_features,)``: ``nn.LayerNorm``'s ``weight``
  and ``bias`` (absent with ``elementwise_affine=False``).
* ``weight`` ``(out_features, in_features)``, ``bias`` ``(out_features,)``: ``nn.Linear``'s.

So the state dict of ``nn.Sequential(nn.LayerNorm(K), nn.Linear(K, N))`` loads after renaming
``0.weight -> layer_norm_weight``, ``0.bias -> layer_norm_bias``, ``1.weight -> weight`` and
``1.bias -> bias``.

Everything else (argument checks, call checks run once per input kind, the FP8 weight cache, the
bias in the forward GEMM's epilogue, ``is_first_microbatch``) is :class:`~offload.fp8.Linear`'s.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import nn

from ..engine.marks import mark_activation_offload
from .cast import quantize
from .linear import GRAD_FP8, Linear, LinearCall, dgrad, fprop, wgrad
from .weights import DEFAULT_WEIGHT_LAYOUTS

__all__ = ["LayerNormLinear"]


class _LayerNormLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        ln_weight: Optional[torch.Tensor],
        ln_bias: Optional[torch.Tensor],
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        call: LinearCall,
    ) -> torch.Tensor:
        module: LayerNormLinear = call.module  # type: ignore[assignment]
        scaling = module.scaling
        ln_out, mean, rstd = torch.native_layer_norm(x, module.normalized_shape, ln_weight, ln_bias, module.eps)
        # Rowwise only: the columnwise copy for wgrad is remade in backward from a recomputed
        # ln_out, so neither ln_out nor any FP8 copy of it outlives this function.
        xq = quantize(ln_out, module.fp8_dtype, scaling, rowwise=True, columnwise=False)
        del ln_out
        w = module.weight_cache.get(weight, scaling, call.refresh_weight)
        y = fprop(xq, w, bias, x.dtype)
        del xq
        # x is our own (M, K) view of the caller's input: the mark lands on this view only, and
        # the engine resolves it to the caller's storage.
        mark_activation_offload(x)
        ctx.save_for_backward(x, mean, rstd, ln_weight, ln_bias, weight)
        ctx.module = module
        ctx.gemm_weight = w  # dgrad's operand: this forward's copy (see fp8.linear)
        ctx.need_wgrad = call.need_wgrad
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        module: LayerNormLinear = ctx.module
        scaling = module.scaling
        x, mean, rstd, ln_weight, ln_bias, weight = ctx.saved_tensors
        # Any of x, gamma, beta needing a gradient needs dLN, hence the dgrad GEMM.
        ln_mask = [bool(n) for n in ctx.needs_input_grad[:3]]
        need_dgrad = any(ln_mask)
        need_wgrad = ctx.needs_input_grad[3] and ctx.need_wgrad

        dx = d_ln_weight = d_ln_bias = dw = db = None
        if need_dgrad or need_wgrad:
            dyq = quantize(dy, GRAD_FP8, scaling, rowwise=need_dgrad, columnwise=need_wgrad)
        if need_wgrad:
            ln_out = torch.native_layer_norm(x, module.normalized_shape, ln_weight, ln_bias, module.eps)[0]
            lnq = quantize(ln_out, module.fp8_dtype, scaling, rowwise=False, columnwise=True)
            del ln_out
            dw = wgrad(dyq, lnq.col, lnq.col_scale_inv, scaling, weight.dtype)
            del lnq
        if need_dgrad:
            d_ln_out = dgrad(dyq, ctx.gemm_weight, x.dtype)
            dx, d_ln_weight, d_ln_bias = torch.ops.aten.native_layer_norm_backward(
                d_ln_out, x, module.normalized_shape, mean, rstd, ln_weight, ln_bias, ln_mask
            )
        if ctx.bias_dtype is not None and ctx.needs_input_grad[4]:
            db = dy.sum(dim=0).to(ctx.bias_dtype)
        return dx, d_ln_weight, d_ln_bias, dw, db, None


class LayerNormLinear(Linear):
    """``LayerNorm(in_features)`` then an FP8 :class:`~offload.fp8.Linear`, saving only the
    LayerNorm's input (and its per-row mean/rstd) for backward.

    Args:
        in_features, out_features, bias, scaling, fp8_dtype, weight_layouts, device, dtype: as
            for :class:`~offload.fp8.Linear` (both feature counts multiples of 16; ``fp8_dtype`` is
            the format of the quantized LayerNorm output).
        eps, elementwise_affine: as for :class:`torch.nn.LayerNorm` over the last dim.

    Inputs are ``(..., in_features)`` float32/bfloat16/float16; the output has the input's dtype.
    When the weight gets a gradient, the number of rows ``M`` must be a multiple of 16. The
    state dict keys are ``layer_norm_weight``, ``layer_norm_bias``, ``weight`` and ``bias`` (see
    the module docstring for loading a LayerNorm + Linear pair). The LayerNorm and its backward
    run in high precision; only the GEMM operands are FP8.

    It is an :class:`~offload.fp8.Linear` (and so an ``nn.Linear``) for the checks, the weight
    cache and ``is_first_microbatch``: code that replaces ``nn.Linear`` modules by type with
    something that only knows ``weight`` and ``bias`` would drop the LayerNorm, so leave it out
    of such swaps.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        scaling: str = "tensorwise",
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
        weight_layouts: str = DEFAULT_WEIGHT_LAYOUTS,
        device: Union[torch.device, str, None] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__(
            in_features, out_features, bias=bias, scaling=scaling, fp8_dtype=fp8_dtype,
            weight_layouts=weight_layouts, device=device, dtype=dtype,
        )
        self.normalized_shape = (in_features,)
        self.eps = float(eps)
        self.elementwise_affine = bool(elementwise_affine)
        self.layer_norm_weight: Optional[nn.Parameter]
        self.layer_norm_bias: Optional[nn.Parameter]
        if self.elementwise_affine:
            self.layer_norm_weight = nn.Parameter(torch.ones(in_features, device=device, dtype=dtype))
            self.layer_norm_bias = nn.Parameter(torch.zeros(in_features, device=device, dtype=dtype))
        else:
            self.register_parameter("layer_norm_weight", None)
            self.register_parameter("layer_norm_bias", None)

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialization for ``weight``/``bias``; ones and zeros for the
        LayerNorm's, as ``nn.LayerNorm`` does."""
        super().reset_parameters()
        # Linear.__init__ calls this before the LayerNorm parameters exist.
        if getattr(self, "layer_norm_weight", None) is not None:
            nn.init.ones_(self.layer_norm_weight)
            nn.init.zeros_(self.layer_norm_bias)

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """``Linear(LayerNorm(x))`` with FP8 GEMMs; ``is_first_microbatch`` as for
        :meth:`offload.fp8.Linear.forward`."""
        x2, call = self._prepare_call(x, is_first_microbatch)
        ln_weight = self.layer_norm_weight
        if ln_weight is not None and ln_weight.dtype != x.dtype and ln_weight.dtype != torch.float32:
            # LayerNorm kernels take parameters of the input's dtype or float32 (mixed precision);
            # say so here rather than with the kernel's "mixed dtype" message.
            raise ValueError(
                f"fp8.LayerNormLinear: the LayerNorm parameters are {ln_weight.dtype} but the input is "
                f"{x.dtype}; use parameters of the input's dtype or float32"
            )
        y = _LayerNormLinearFunction.apply(x2, ln_weight, self.layer_norm_bias, self.weight, self.bias, call)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
