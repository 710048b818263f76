"""An FP8 ``Linear`` on ``torch._scaled_mm`` that saves only the columnwise FP8 input for wgrad.

Forward, dgrad and wgrad are three FP8 GEMMs::

    Y  = X  @ W^T     mat1 = X  rowwise (M, K)            mat2 = W rowwise (N, K), transposed
    dX = dY @ W       mat1 = dY rowwise (M, N)            mat2 = W columnwise (K, N), transposed
    dW = dY^T @ X     mat1 = dY columnwise (N, M)         mat2 = X columnwise (K, M), transposed

``_scaled_mm`` wants ``mat1`` row-major and ``mat2`` column-major; ``c.t()`` of a contiguous
``c`` is column-major, so every ``mat2`` above is the ``.t()`` of contiguous data, and the only
activation autograd has to keep is the columnwise FP8 input ``(K, M)`` with its scale(s): half
the bytes of a bf16 input. Those components are tagged with
:func:`offload.engine.marks.mark_activation_offload` so that the v1 schedule (opt-in selection) moves
them. The weight's FP8 copies come from a per-module cache (the Parameter itself is what autograd
saves: the engine keeps Parameters on the GPU, and autograd's version check catches a weight
changed in place between forward and backward).

Cost (what makes it worth using over bf16): inputs and gradients are quantized by fused Triton
kernels on CUDA (:mod:`offload.fp8.cast`), two launches per tensor, one for small tensors; the
weight's FP8 copies are made once per weight version (:mod:`offload.fp8.weights`), not once per
call; the bias is added in the forward GEMM's epilogue; call checks run once per input kind. No
step waits on the host: forward and backward run under ``torch.cuda.set_sync_debug_mode("error")``
and capture in a CUDA graph (tested).

Scaling:

* ``"tensorwise"`` (default): current scaling, one float32 scale per tensor
  (``fp8_max / amax``, 1 when amax == 0). The columnwise copies are exact transposes.
* ``"rowwise"``: one float32 scale per row of each GEMM operand along its non-contracted dim:
  ``(M, 1)`` and ``(1, N)``. The columnwise copies are quantized from the transposes with their
  own per-row scales, since a GEMM can only apply scales along non-contracted dims.

Gradients are quantized to e4m3fn with their own current scale. The bias is added in the forward
GEMM's epilogue and its gradient summed in high precision. Non-finite inputs saturate (``inf``
becomes the largest FP8 value, NaN stays NaN) and never set the scale (see
:func:`offload.quantized.finite_amax`). Every step is deterministic, so outputs and gradients are bitwise
repeatable run to run.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import torch

from ..engine.marks import mark_activation_offload
from ..quantized import FP8_DTYPES, HIGH_PRECISION
from .cast import Operand, quantize
from .gemm import GEMM_MULTIPLE, features_reason, fp8_gemm, rowwise_out_dtype_reason, rowwise_supported, unsupported_reason
from .weights import DEFAULT_WEIGHT_LAYOUTS, GemmWeight, WeightCache, check_weight_layouts, dgrad_operand

__all__ = [
    "Linear", "SCALINGS", "GRAD_FP8", "INPUT_SOURCE_ATTR", "LinearCall", "mat2_scale", "fprop", "dgrad", "wgrad",
    "check_fp8_options", "remember_call", "linear_grads",
]

SCALINGS = ("tensorwise", "rowwise")
# Gradients are always e4m3fn: cuBLASLt has no e5m2 x e5m2 FP8 GEMM, and the rowwise kernels take
# e4m3fn only.
GRAD_FP8 = torch.float8_e4m3fn
# Set on a tensor by an op that remakes it in backward from tensors it saves anyway (fp8.RMSNorm,
# fp8.SwiGLU): a Linear called on that tensor saves those instead of an FP8 copy of it (see
# offload.fp8.input_source).
INPUT_SOURCE_ATTR = "_offload_fp8_input_source"


class LinearCall(NamedTuple):
    """What one forward needs besides tensors (an autograd.Function takes it as one argument)."""

    module: "Linear"
    need_wgrad: bool
    refresh_weight: bool


def mat2_scale(scale_inv: torch.Tensor, scaling: str) -> torch.Tensor:
    """A ``(rows, 1)`` per-row scale of contiguous data becomes the ``(1, rows)`` column scale
    ``_scaled_mm`` wants for its ``.t()``; one tensorwise scale is used as it is."""
    return scale_inv if scaling == "tensorwise" else scale_inv.view(1, -1)


def fprop(xq: Operand, w: GemmWeight, bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """``X @ W^T + b``: the quantized input's rowwise data against the weight's forward operand.
    cuBLASLt adds a bias in the FP8 GEMM's epilogue for 16-bit outputs only; a float32 output gets
    it added afterwards."""
    fused = bias is not None and bias.dtype == out_dtype and out_dtype != torch.float32
    y = torch._scaled_mm(
        xq.row, w.fprop, scale_a=xq.row_scale_inv, scale_b=w.fprop_scale,
        bias=bias if fused else None, out_dtype=out_dtype, use_fast_accum=False,
    )
    if bias is not None and not fused:
        y = y + bias.to(out_dtype)
    return y


def dgrad(dyq: Operand, w: GemmWeight, out_dtype: torch.dtype) -> torch.Tensor:
    """``dY @ W``: the quantized gradient's rowwise data against the weight's dgrad operand (made
    here from forward's copy when the cache keeps one layout: see :mod:`offload.fp8.weights`)."""
    mat2, scale = dgrad_operand(w)
    return torch._scaled_mm(
        dyq.row, mat2, scale_a=dyq.row_scale_inv, scale_b=scale,
        out_dtype=out_dtype, use_fast_accum=False,
    )


def check_fp8_options(owner: str, scaling: object, fp8_dtype: object, weight_layouts: object) -> None:
    """Raise a ValueError naming ``owner`` for a scaling, input FP8 format or weight layout
    setting that :class:`Linear` does not take."""
    if scaling not in SCALINGS:
        raise ValueError(f"{owner}: scaling must be one of {SCALINGS}, got {scaling!r}")
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"{owner}: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}")
    if scaling == "rowwise" and fp8_dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"{owner}: scaling='rowwise' supports fp8_dtype=torch.float8_e4m3fn only "
            "(rowwise-scaled FP8 GEMM kernels take e4m3 operands); use scaling='tensorwise' for e5m2"
        )
    check_weight_layouts(owner, weight_layouts)


def wgrad(dyq: Operand, x_col: torch.Tensor, x_scale: torch.Tensor, scaling: str, out_dtype: torch.dtype) -> torch.Tensor:
    """``dY^T @ X``: the gradient's columnwise ``(N, M)`` data, row-major, against the input's
    columnwise ``(K, M)`` data, whose ``.t()`` is the column-major ``mat2``. ``fp8_gemm`` also
    takes the engine's restored views."""
    return fp8_gemm(dyq.col, x_col.t(), dyq.col_scale_inv, mat2_scale(x_scale, scaling), out_dtype)


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        call: LinearCall,
    ) -> torch.Tensor:
        module = call.module
        scaling = module.scaling
        # Input: rowwise for this GEMM, columnwise (K, M) for wgrad when it will be needed.
        xq = quantize(x, module.fp8_dtype, scaling, rowwise=True, columnwise=call.need_wgrad)
        w = module.weight_cache.get(weight, scaling, call.refresh_weight)
        y = fprop(xq, w, bias, x.dtype)
        if call.need_wgrad:
            # Keep ONLY the columnwise input and its scale(s); the rowwise copy dies here. They are
            # saved as the plain tensors they are (no storage object to walk through
            # prepare/restore on every call), and marked so that the opt-in v1 schedule moves them.
            mark_activation_offload(xq.col, xq.col_scale_inv)
            ctx.save_for_backward(xq.col, xq.col_scale_inv, weight)
        else:
            # The weight is saved for autograd's version check only: backward raises if it was
            # changed in place since this forward, as it does for nn.Linear.
            ctx.save_for_backward(weight)
        del xq
        remember_call(ctx, module, w, x.dtype, bias)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        saved = ctx.saved_tensors  # unpacked even when unused: the weight's version check
        need_wgrad = ctx.needs_input_grad[1] and len(saved) == 3

        def saved_input() -> tuple[torch.Tensor, torch.Tensor]:
            x_col = saved[0]
            # FP8 bits restored as uint8 are viewed as their format again.
            return (x_col if x_col.dtype == ctx.fp8_dtype else x_col.view(ctx.fp8_dtype)), saved[1]

        return (*linear_grads(ctx, dy, saved[-1], need_wgrad, saved_input), None)


def remember_call(ctx: Any, module: "Linear", w: GemmWeight, x_dtype: torch.dtype, bias: Optional[torch.Tensor]) -> None:
    """Keep on ``ctx`` what :func:`linear_grads` needs besides saved tensors. dgrad uses the FP8
    weight copy this forward used: no cache lookup in backward, and the right copy even when a
    later forward (``is_first_microbatch=True``) has replaced the cached one."""
    ctx.gemm_weight = w
    ctx.scaling = module.scaling
    ctx.fp8_dtype = module.fp8_dtype
    ctx.x_dtype = x_dtype
    ctx.bias_dtype = None if bias is None else bias.dtype


def linear_grads(
    ctx: Any, dy: torch.Tensor, weight: torch.Tensor, need_wgrad: bool,
    wgrad_input: Callable[[], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(dx, dw, db)`` of one FP8 Linear call (``ctx`` as :func:`remember_call` left it);
    ``wgrad_input()`` gives the columnwise FP8 input and its scale, asked only for wgrad."""
    need_dgrad = ctx.needs_input_grad[0]
    scaling = ctx.scaling
    dx = dw = db = None
    if need_dgrad or need_wgrad:
        dyq = quantize(dy, GRAD_FP8, scaling, rowwise=need_dgrad, columnwise=need_wgrad)
        if need_dgrad:
            dx = dgrad(dyq, ctx.gemm_weight, ctx.x_dtype)
        if need_wgrad:
            x_col, x_scale = wgrad_input()
            dw = wgrad(dyq, x_col, x_scale, scaling, weight.dtype)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
        db = dy.sum(dim=0).to(ctx.bias_dtype)
    return dx, dw, db


class Linear(torch.nn.Linear):
    """Drop-in for :class:`torch.nn.Linear` whose three GEMMs run in FP8 via ``torch._scaled_mm``.

    Args:
        in_features, out_features, bias, device, dtype: as for :class:`torch.nn.Linear`. Both
            feature counts must be multiples of 16 (an FP8 GEMM requirement).
        scaling: ``"tensorwise"`` (one current scale per tensor) or ``"rowwise"`` (per-row
            float32 scales, ``(M, 1)`` x ``(1, N)``).
        fp8_dtype: FP8 format of the input activation (the tensor saved for backward):
            ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (tensorwise only). Weights and
            output gradients are always e4m3fn.
        weight_layouts: ``"one"`` (default: cache the forward's FP8 weight, one byte per
            parameter, and make dgrad's in backward) or ``"both"`` (cache both, two bytes per
            parameter); bitwise the same results (see :mod:`offload.fp8.weights`).

    Inputs are ``(..., in_features)`` float32/bfloat16/float16; the output has the input's dtype.
    When the weight gets a gradient, the number of rows ``M`` (the product of the leading dims)
    must be a multiple of 16, since wgrad contracts over it.

    The weight's FP8 copies live in ``weight_cache`` (``weight_cache.nbytes``: half the bf16
    weight's bytes with one layout, as many with both) and are remade when the weight changes
    (see :mod:`offload.fp8.weights`). :func:`offload.fp8.convert` turns an existing
    ``nn.Linear`` into this class in place. ``forward``'s
    ``is_first_microbatch=True`` (TransformerEngine's argument) forces a new copy; after writing
    the weight through ``.data``, which autograd's version counter does not see, call
    ``weight_cache.clear()``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        scaling: str = "tensorwise",
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
        weight_layouts: str = DEFAULT_WEIGHT_LAYOUTS,
        device: Union[torch.device, str, None] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        name = f"fp8.{type(self).__name__}"
        check_fp8_options(name, scaling, fp8_dtype, weight_layouts)
        reason = features_reason(in_features, out_features)
        if reason is not None:
            raise ValueError(f"{name}: {reason}; pad the layer or use torch.nn.Linear")
        if dtype is not None and dtype not in HIGH_PRECISION:
            raise ValueError(f"{name}: dtype must be float32, bfloat16 or float16, got {dtype}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_fp8_state(scaling, fp8_dtype, weight_layouts)

    # The attributes this class adds to nn.Linear's: what fp8.unconvert removes again.
    FP8_STATE = ("scaling", "fp8_dtype", "weight_cache", "_checked_kinds")

    def _init_fp8_state(self, scaling: str, fp8_dtype: torch.dtype, weight_layouts: str) -> None:
        """Set the state this class adds to an ``nn.Linear`` (its :data:`FP8_STATE`); also how
        :func:`offload.fp8.convert` completes an ``nn.Linear`` whose class it swapped."""
        self.scaling = scaling
        self.fp8_dtype = fp8_dtype
        self.weight_cache = WeightCache(weight_layouts)
        # Input kinds (dtype, device, weight dtype and device) already checked: the checks cost
        # more host time than the GEMM at small sizes, and their answer does not change.
        self._checked_kinds: set[tuple[object, ...]] = set()

    def _check_call(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"fp8.{type(self).__name__} expects a torch.Tensor input, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"fp8.{type(self).__name__}: input of shape {tuple(x.shape)} does not end in "
                f"in_features={self.in_features}"
            )
        weight = self.weight
        # get_device() is an int (-1 on the CPU): cheaper than building torch.device objects.
        kind = (x.dtype, x.get_device(), weight.dtype, weight.get_device())
        if kind in self._checked_kinds:
            return
        name = f"fp8.{type(self).__name__}"
        if x.dtype not in HIGH_PRECISION:
            raise ValueError(
                f"{name}: input dtype must be float32, bfloat16 or float16, got {x.dtype}"
            )
        if self.weight.dtype not in HIGH_PRECISION:
            raise ValueError(
                f"{name}: weight dtype must be float32, bfloat16 or float16, got {self.weight.dtype}"
            )
        if x.device != self.weight.device:
            raise ValueError(
                f"{name}: input is on {x.device} but the weight is on {self.weight.device}; move one of them"
            )
        dev = x.device
        reason = unsupported_reason(dev)
        if reason is not None:
            raise ValueError(f"{name} cannot run on {dev}: {reason}")
        if self.scaling == "rowwise":
            if not rowwise_supported(dev.type):
                raise ValueError(
                    f"{name}: scaling='rowwise' is not supported by torch._scaled_mm on {dev.type} "
                    f"in PyTorch {torch.__version__}; use scaling='tensorwise' or a CUDA GPU"
                )
            for what, dt in (("input", x.dtype), ("weight", self.weight.dtype)):
                reason = rowwise_out_dtype_reason(dev, dt)
                if reason is not None:
                    raise ValueError(f"{name} ({what}): {reason}")
        self._checked_kinds.add(kind)

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """``x @ W^T + b`` with FP8 GEMMs. ``is_first_microbatch=True`` re-quantizes the weight
        even when its version did not change (TransformerEngine's argument; ``None``/``False``
        rely on the version check)."""
        x2, call = self._prepare_call(x, is_first_microbatch)
        y = self._sourced(x, x2, call)
        if y is None:
            y = _Fp8LinearFunction.apply(x2, self.weight, self.bias, call)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def _sourced(self, x: torch.Tensor, x2: torch.Tensor, call: LinearCall) -> Optional[torch.Tensor]:
        """The output through the input source that ``x`` carries (see
        :mod:`offload.fp8.input_source`), or None: no source, or a stale one."""
        source = getattr(x, INPUT_SOURCE_ATTR, None)
        return None if source is None else source.linear(x, x2, self.weight, self.bias, call)

    def _prepare_call(self, x: torch.Tensor, is_first_microbatch: Optional[bool]) -> tuple[torch.Tensor, LinearCall]:
        """Check the input (once per kind), flatten it to ``(M, in_features)`` and say what the
        call needs: wgrad contracts over ``M``, so ``M`` must then be a multiple of 16."""
        self._check_call(x)
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        need_wgrad = self.weight.requires_grad and torch.is_grad_enabled()
        if need_wgrad and x2.shape[0] % GEMM_MULTIPLE:
            raise ValueError(
                f"fp8.{type(self).__name__}: the input has M={x2.shape[0]} rows (product of the leading dims "
                f"{tuple(x.shape[:-1])}); the FP8 wgrad GEMM contracts over M, which must be a multiple "
                f"of {GEMM_MULTIPLE}. Pad the batch/sequence to a multiple of 16 tokens"
            )
        return x2, LinearCall(self, need_wgrad, bool(is_first_microbatch))

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, scaling={self.scaling}, fp8_dtype={self.fp8_dtype}, "
                f"weight_layouts={self.weight_cache.weight_layouts}")
