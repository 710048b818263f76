"""FP8 modules on ``torch._scaled_mm`` that save FP8 activations for backward.

* :class:`Linear`: a drop-in ``nn.Linear`` with FP8 forward, dgrad and wgrad GEMMs that saves only
  its columnwise FP8 input.

Submodules, one job each: :mod:`.gemm` (where FP8 GEMMs run, the checked GEMM call), :mod:`.cast`
(quantizing an operand: Triton kernels on CUDA, torch elsewhere), :mod:`.triton_cast` (the
kernels), :mod:`.weights` (FP8 weight copies cached per weight version), :mod:`.linear`.
"""

from .gemm import fp8_gemm, rowwise_supported, scaled_mm_supported
from .linear import SCALINGS, Linear

__all__ = ["Linear", "SCALINGS", "fp8_gemm", "rowwise_supported", "scaled_mm_supported"]
