"""FP8 modules on ``torch._scaled_mm`` that save FP8 activations for backward.

* :class:`Linear`: a drop-in ``nn.Linear`` with FP8 forward, dgrad and wgrad GEMMs that saves only
  its columnwise FP8 input.
* :class:`LayerNormLinear`: LayerNorm fused with an FP8 Linear's input quantization; saves only
  the LayerNorm input (and its per-row mean/rstd), recomputing the FP8 wgrad operand in backward.
* :class:`GELU`: ``nn.GELU``'s output, with its input saved in FP8 e4m3 for backward.
* :func:`convert` / :func:`unconvert`: a model's ``nn.Linear`` modules to :class:`Linear` in
  place (the same modules and Parameters) and back; :func:`weight_cache_bytes`: the memory their
  FP8 weight copies hold.

Submodules, one job each: :mod:`.gemm` (where FP8 GEMMs run, the checked GEMM call), :mod:`.cast`
(quantizing an operand: Triton kernels on CUDA, torch elsewhere), :mod:`.triton_cast` (the
kernels), :mod:`.weights` (FP8 weight copies cached per weight version, in one layout or two),
:mod:`.linear`, :mod:`.layernorm_linear`, :mod:`.gelu`, :mod:`.conversion` (convert, unconvert).
"""

from .conversion import ConvertSummary, convert, unconvert
from .gemm import fp8_gemm, rowwise_supported, scaled_mm_supported
from .gelu import GELU
from .layernorm_linear import LayerNormLinear
from .linear import SCALINGS, Linear
from .weights import WEIGHT_LAYOUTS, weight_cache_bytes

__all__ = [
    "ConvertSummary", "GELU", "LayerNormLinear", "Linear", "SCALINGS", "WEIGHT_LAYOUTS", "convert", "fp8_gemm",
    "rowwise_supported", "scaled_mm_supported", "unconvert", "weight_cache_bytes",
]
