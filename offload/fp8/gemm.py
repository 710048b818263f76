"""FP8 GEMMs on ``torch._scaled_mm``: where they can run, and the one call every FP8 module makes.

``_scaled_mm`` wants ``mat1`` row-major and ``mat2`` column-major; ``c.t()`` of a contiguous ``c``
is column-major, so a module passes the ``.t()`` of contiguous FP8 data as ``mat2``.
"""

from __future__ import annotations

import functools
from typing import Optional, Union

import torch

from ..quantized import FP8_DTYPES

__all__ = ["GEMM_MULTIPLE", "features_reason", "scaled_mm_supported", "rowwise_supported", "fp8_gemm", "unsupported_reason", "rowwise_out_dtype_reason"]

# ``_scaled_mm`` (cuBLASLt) needs the contraction dim and both dims of mat2 to be multiples of 16.
GEMM_MULTIPLE = 16


def features_reason(in_features: object, out_features: object) -> Optional[str]:
    """Why a Linear of these feature counts cannot run its three GEMMs in FP8 (every dim of a
    weight is a contraction or a ``mat2`` dim in one of them), or None when it can."""
    for name, n in (("in_features", in_features), ("out_features", out_features)):
        if not isinstance(n, int) or n <= 0 or n % GEMM_MULTIPLE:
            return f"{name}={n} must be a positive multiple of {GEMM_MULTIPLE} (torch._scaled_mm requires it)"
    return None


def _device_of(device: Union[torch.device, str, int, None]) -> torch.device:
    if device is None:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    return torch.device(device)


def unsupported_reason(device: torch.device) -> Optional[str]:
    """Why FP8 GEMMs cannot run on ``device``, or None when they can."""
    if not hasattr(torch, "_scaled_mm"):
        return f"this PyTorch ({torch.__version__}) has no torch._scaled_mm; upgrade PyTorch"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available"
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            return (
                f"FP8 GEMMs need compute capability 8.9 or newer (Ada/Hopper/Blackwell); "
                f"{torch.cuda.get_device_name(device)} is sm_{cap[0]}{cap[1]}"
            )
        return None
    if device.type == "cpu":
        return None
    return f"FP8 GEMMs are not supported on device type '{device.type}'"


def scaled_mm_supported(device: Union[torch.device, str, int, None] = None) -> bool:
    """True when ``torch._scaled_mm`` FP8 GEMMs can run on ``device`` (default: current CUDA
    device, or CPU without CUDA): any CPU with a PyTorch that has ``_scaled_mm``, or a CUDA GPU
    of compute capability 8.9+."""
    return unsupported_reason(_device_of(device)) is None


@functools.lru_cache(maxsize=None)
def rowwise_supported(device_type: str) -> bool:
    """Whether ``torch._scaled_mm`` takes rowwise (vector) scales on this device type.

    Probed once with a 16x16 GEMM: CUDA (sm_89+) has it; the CPU kernel gained it only in newer
    PyTorch releases (torch 2.11's CPU ``_scaled_mm`` is per-tensor only).
    """
    device = torch.device(device_type)
    if unsupported_reason(device) is not None:
        return False
    a = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), torch.ones(16, 1, device=device), torch.ones(1, 16, device=device), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def rowwise_out_dtype_reason(device: torch.device, out_dtype: torch.dtype) -> Optional[str]:
    """Rowwise-scaled GEMMs with a float32 result only exist in cuBLAS >= 12.9 on sm_90; the
    fallback kernels write bfloat16 only. Say so up front instead of failing in the GEMM."""
    if device.type != "cuda" or out_dtype == torch.bfloat16:
        return None
    cap = torch.cuda.get_device_capability(device)
    cuda_version = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    if cap[0] == 9 and cuda_version >= (12, 9):
        return None
    return (
        f"scaling='rowwise' with {out_dtype} results needs an sm_90 GPU and CUDA >= 12.9 "
        f"(found sm_{cap[0]}{cap[1]}, CUDA {torch.version.cuda}); use bfloat16 inputs and "
        "parameters, or scaling='tensorwise'"
    )


def fp8_gemm(
    a: torch.Tensor,
    b_t: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``(a * scale_a) @ (b_t * scale_b) [+ bias]`` with ``torch._scaled_mm``.

    ``a`` is row-major FP8 ``(M, K)``; ``b_t`` is column-major ``(K, N)``, i.e. ``c.t()`` of
    contiguous ``(N, K)`` data. Scales are float32 dequantization factors (scale_inv): one element
    each (tensorwise), or ``(M, 1)`` and ``(1, N)`` (rowwise). Data held as uint8 bits must be
    viewed as its FP8 dtype first (``t.view(fp8_dtype)``): the format is not knowable from bytes.
    """
    for name, t in (("a", a), ("b_t", b_t)):
        if t.dtype not in FP8_DTYPES:
            raise ValueError(
                f"fp8_gemm: {name} must be float8_e4m3fn or float8_e5m2, got {t.dtype} "
                "(uint8 FP8 bits: pass t.view(fp8_dtype))"
            )
    if a.dtype == b_t.dtype == torch.float8_e5m2:
        raise ValueError("fp8_gemm: e5m2 x e5m2 has no FP8 GEMM; make one operand e4m3fn")
    # Restored components may be views of a larger buffer; only the layout matters here.
    if a.stride(-1) != 1 or a.stride(0) != a.shape[1]:
        a = a.contiguous()
    if b_t.stride(0) != 1 or b_t.stride(1) != b_t.shape[0]:
        b_t = b_t.t().contiguous().t()
    out = torch._scaled_mm(
        a,
        b_t,
        scale_a=scale_a,
        scale_b=scale_b,
        out_dtype=out_dtype,
        bias=bias,
        use_fast_accum=False,  # full-precision accumulation: fast accumulation loses bits
    )
    # Very old releases returned (out, amax).
    return out[0] if isinstance(out, tuple) else out
