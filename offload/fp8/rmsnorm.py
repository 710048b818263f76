"""HF ``LlamaRMSNorm``'s forward, saving only its input and per-row rstd, and sharing one FP8
quantization of its output among the ``fp8.Linear``s it feeds.

``LlamaRMSNorm`` computes in float32 and casts back::

    rstd = rsqrt(mean(float32(x)^2) + eps);   y = weight * (float32(x) * rstd).to(x.dtype)

Under autograd those ops save ``float32(x)`` (4 bytes per element), ``rstd``, and the bf16
normalized ``x`` (2 bytes) for the weight's gradient; each Linear it feeds then saves its input
(bf16, or a columnwise FP8 copy per Linear with ``fp8.Linear``). :class:`RMSNorm` computes the
same output and saves only ``x`` (the residual stream, bf16) and ``rstd`` (float32, one per
row): 2 bytes per element instead of 6, and its output carries an
:class:`~offload.fp8.input_source.InputSource` (see there), so the ``fp8.Linear``s it feeds
quantize it once and save nothing of their own: in backward they remake it from ``x`` and
``rstd`` (bitwise forward's output) and quantize its columnwise copy once for
all of them. Both saved tensors are tagged with :func:`~offload.engine.marks.mark_activation_offload`,
so the opt-in v1 schedule moves them.

Backward is the closed form in float32 (``xhat = float32(x) * rstd``, ``g = dy * weight``)::

    dx      = rstd * (g - xhat * mean(g * xhat))      cast to x's dtype
    dweight = sum over rows of dy * xhat.to(x.dtype)  cast to weight's dtype

It treats the cast to ``x``'s dtype as the identity, as autograd does, and sums in float32 where
autograd's graph of ``LlamaRMSNorm`` rounds its products to bf16 first: the gradients agree with
``LlamaRMSNorm``'s to bf16 rounding (tested against a float64 reference), deterministic, so
bitwise equal with and without offload.

Two implementations of the same arithmetic. On CUDA, one Triton kernel each way
(:mod:`.triton_norm`: the torch ops below moved about 1.2 GB forward and 4 GB backward per norm
at 8192 x 4096 bf16, against 0.13 and 0.2 GB); its mean square sums in a different order than
torch's, so its output can differ from ``LlamaRMSNorm``'s in the last bits (tested: within two
roundings). Elsewhere, and for rows wider than the kernel takes, ``LlamaRMSNorm``'s own ops
(:func:`rms_norm_torch`), bit for bit.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from ..engine.marks import mark_activation_offload
from ..quantized import HIGH_PRECISION
from .cast import fusable, on_device_of, triton_module
from .input_source import Recipe, attach_source

__all__ = ["RMSNorm", "rms_norm", "normalize", "rms_norm_torch", "normalize_torch", "rms_norm_backward"]



def _fused(x: torch.Tensor) -> Any:
    """The Triton norm kernels when they take ``x`` (CUDA, rows they fit), else None."""
    kernels = triton_module("triton_norm") if fusable(x) else None
    return kernels if kernels is not None and x.shape[-1] <= kernels.MAX_WIDTH else None


def normalize_torch(x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight * (float32(x) * rstd).to(x.dtype)``: ``LlamaRMSNorm``'s output from its rstd."""
    return weight * (x.to(torch.float32) * rstd).to(x.dtype)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``LlamaRMSNorm``'s output, op for op (so bit for bit), and its float32 per-row ``rstd``."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    rstd = torch.rsqrt(variance + eps)
    return normalize_torch(x, rstd, weight), rstd


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``LlamaRMSNorm``'s output and its float32 per-row ``rstd`` (``(..., 1)``): the fused
    kernel where it runs (module docstring), :func:`rms_norm_torch` elsewhere."""
    kernels = _fused(x)
    if kernels is None:
        return rms_norm_torch(x, weight, eps)
    return on_device_of(x, kernels.rms_norm_forward, x, weight, eps)


def normalize(x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The output :func:`rms_norm` made, remade bitwise from its ``rstd``."""
    kernels = _fused(x)
    if kernels is None:
        return normalize_torch(x, rstd, weight)
    return on_device_of(x, kernels.rms_norm_forward, x, weight, 0.0, rstd)[0]


def rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, need_dx: bool, need_dweight: bool
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The closed-form gradients of :func:`rms_norm` (module docstring), in float32."""
    kernels = _fused(x)
    if kernels is not None and fusable(dy):
        dx, dweight = on_device_of(x, kernels.rms_norm_backward, dy, x, rstd, weight, need_dweight)
        return (dx if need_dx else None), dweight
    # In-place steps keep the float32 transients at three of ``x``'s size: this runs at
    # backward's peak.
    xhat = x.to(torch.float32) * rstd
    dyf = dy.to(torch.float32)
    dweight = None
    if need_dweight:
        dweight = (dyf * xhat.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    dx = None
    if need_dx:
        g = dyf.mul_(weight.to(torch.float32)) if dyf is not dy else dyf * weight.to(torch.float32)
        projection = (g * xhat).mean(-1, keepdim=True)
        dx = g.sub_(xhat.mul_(projection)).mul_(rstd).to(x.dtype)
    return dx, dweight


class _NormRecipe(Recipe):
    """Remakes the norm's output from the saved ``(x, rstd, weight)``."""

    def remake(self, saved: Sequence[torch.Tensor]) -> torch.Tensor:
        x, rstd, weight = saved
        y = normalize(x, rstd, weight)
        return y.reshape(-1, y.shape[-1])


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        y, rstd = rms_norm(x, weight, eps)
        # x is the caller's tensor (the residual stream), which nothing else in the layer saves.
        mark_activation_offload(x, rstd)
        ctx.save_for_backward(x, rstd, weight)
        # The very object returned here is the one the caller gets (autograd only sets its
        # grad_fn), so the Linears called on it find the source.
        attach_source(y, (x, rstd, weight), _NormRecipe(), share_forward=True)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        x, rstd, weight = ctx.saved_tensors
        dx, dweight = rms_norm_backward(dy, x, rstd, weight, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return dx, dweight, None


class RMSNorm(nn.Module):
    """``LlamaRMSNorm`` (same parameter ``weight``, same ``variance_epsilon``, the same output: bit
    for bit on the torch path, within two roundings from the fused kernels) that saves only its input
    and per-row rstd, and whose output the ``fp8.Linear``s it feeds quantize once and remake in
    backward instead of saving (module docstring).

    Args:
        hidden_size: the normalized (last) dimension.
        eps: added to the mean square, as ``LlamaRMSNorm``'s ``eps``.
        device, dtype: of ``weight`` (initialized to ones).

    :meth:`from_module` builds one around an existing norm's ``weight`` Parameter (the same
    object: optimizers and state dicts see no change). Inputs are float32/bfloat16/float16.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        device: Union[torch.device, str, None] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = float(eps)

    @classmethod
    def from_module(cls, norm: nn.Module) -> "RMSNorm":
        """An :class:`RMSNorm` holding ``norm.weight`` (the same Parameter) and its
        ``variance_epsilon``; ``norm`` is kept, unregistered, for
        :func:`offload.fp8.restore_llama_ops`."""
        weight = getattr(norm, "weight", None)
        eps = getattr(norm, "variance_epsilon", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or not isinstance(eps, (int, float)):
            raise ValueError(
                f"fp8.RMSNorm.from_module: {type(norm).__name__} is not an HF-style RMSNorm (a 1-D "
                "Parameter 'weight' and a float 'variance_epsilon')"
            )
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.weight = weight
        new.variance_epsilon = float(eps)
        object.__setattr__(new, "original", norm)  # not a submodule: the state dict stays the same
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.weight.shape[0]:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"fp8.RMSNorm expects a tensor (..., {self.weight.shape[0]}), got {shape}")
        if x.dtype not in HIGH_PRECISION:
            raise ValueError(f"fp8.RMSNorm: input dtype must be float32, bfloat16 or float16, got {x.dtype}")
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _RMSNormFunction.apply(x, self.weight, self.variance_epsilon)
        # Nothing to save: the plain ops, and a source so the Linears still quantize once.
        y, rstd = rms_norm(x, self.weight, self.variance_epsilon)
        attach_source(y, (x, rstd, self.weight), _NormRecipe(), share_forward=True)
        return y

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
