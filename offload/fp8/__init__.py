"""FP8 modules on ``torch._scaled_mm`` that save FP8 activations for backward.

* :class:`Linear`: a drop-in ``nn.Linear`` with FP8 forward, dgrad and wgrad GEMMs that saves only
  its columnwise FP8 input.
* :class:`LayerNormLinear`: LayerNorm fused with an FP8 Linear's input quantization; saves only
  the LayerNorm input (and its per-row mean/rstd), recomputing the FP8 wgrad operand in backward.
* :class:`GELU`: ``nn.GELU``'s output, with its input saved in FP8 e4m3 for backward.
* :class:`RMSNorm`: HF ``LlamaRMSNorm``'s output (one fused Triton kernel each way on CUDA),
  saving only its input and per-row rstd; the ``fp8.Linear``s it feeds (q, k, v; gate, up) share
  one FP8 quantization of its output and remake their wgrad operand from that input in backward
  instead of each saving a copy.
* :class:`SwiGLU`, :class:`SwiGLUMLP`: ``silu(gate) * up`` saving only FP8 copies of ``gate`` and
  ``up``, from which the ``fp8.Linear`` it feeds (``down_proj``) remakes its wgrad operand.
* :func:`convert` / :func:`unconvert`: a model's ``nn.Linear`` modules to :class:`Linear` in
  place (the same modules and Parameters) and back; :func:`weight_cache_bytes`: the memory their
  FP8 weight copies hold.
* :func:`convert_llama_ops`: swaps the norms and MLPs of every Llama-style decoder layer of a
  model for :class:`RMSNorm` and :class:`SwiGLUMLP`, keeping its Parameters and state dict keys
  (:func:`restore_llama_ops` undoes it); before or after :func:`convert`, either order.

Submodules, one job each: :mod:`.gemm` (where FP8 GEMMs run, the checked GEMM call), :mod:`.cast`
(quantizing an operand: Triton kernels on CUDA, torch elsewhere), :mod:`.triton_cast` (the
kernels), :mod:`.triton_transpose`, :mod:`.triton_norm` and :mod:`.triton_swiglu` (the transpose,
RMSNorm and SwiGLU kernels), :mod:`.weights` (FP8 weight copies cached per weight version, in one layout or two),
:mod:`.linear`, :mod:`.layernorm_linear`, :mod:`.gelu`, :mod:`.conversion` (convert, unconvert),
:mod:`.input_source` (a Linear input remade in backward by the op that produced it),
:mod:`.rmsnorm`, :mod:`.swiglu`, :mod:`.llama_ops` (convert_llama_ops, restore_llama_ops).
"""

from .conversion import ConvertSummary, convert, unconvert
from .gemm import fp8_gemm, rowwise_supported, scaled_mm_supported
from .gelu import GELU
from .layernorm_linear import LayerNormLinear
from .linear import SCALINGS, Linear
from .llama_ops import LlamaOpsSummary, convert_llama_ops, restore_llama_ops
from .rmsnorm import RMSNorm
from .swiglu import SwiGLU, SwiGLUMLP
from .weights import WEIGHT_LAYOUTS, weight_cache_bytes

__all__ = [
    "ConvertSummary", "GELU", "LayerNormLinear", "Linear", "LlamaOpsSummary", "RMSNorm", "SCALINGS", "SwiGLU",
    "SwiGLUMLP", "WEIGHT_LAYOUTS", "convert", "convert_llama_ops", "fp8_gemm", "restore_llama_ops",
    "rowwise_supported", "scaled_mm_supported", "unconvert", "weight_cache_bytes",
]
