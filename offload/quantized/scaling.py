"""FP8 formats and current scaling: format limits, input checks, the finite amax, the scale,
the saturating cast, the FP8 transpose and E8M0 decoding. Every quantizer here and the fused
kernels (:mod:`offload.fp8.triton_cast`) share these rules."""

from __future__ import annotations

from typing import Any, Optional

import torch


FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)
# The high-precision dtypes we quantize from.
HIGH_PRECISION: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
# OCP MX block: 32 consecutive elements share one E8M0 scale.
MXFP8_BLOCK_SIZE = 32
# Largest power-of-two exponent of a normal number of each element format (448 = 1.75 * 2^8,
# 57344 = 1.75 * 2^15); MX picks the shared exponent so that the block's amax lands in this binade.
_FP8_EMAX = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}
_E8M0_BIAS = 127
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 format (448 for e4m3fn, 57344 for e5m2)."""
    _check_fp8_dtype(fp8_dtype)
    return float(torch.finfo(fp8_dtype).max)


def _check_fp8_dtype(fp8_dtype: Any, where: str = "fp8_dtype") -> None:
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(
            f"{where} must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}"
        )


def _check_input(x: Any, fn: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{fn} expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in HIGH_PRECISION:
        raise ValueError(
            f"{fn} expects a float32, bfloat16 or float16 tensor, got {x.dtype}; "
            "convert it first (FP8 inputs are already quantized)"
        )
    if x.dim() != 2:
        raise ValueError(
            f"{fn} expects a 2-D (M, K) tensor, got shape {tuple(x.shape)}; "
            "reshape to (-1, K) first"
        )


def _check_usages(rowwise: bool, columnwise: bool, fn: str) -> None:
    if not (rowwise or columnwise):
        raise ValueError(f"{fn}: at least one of rowwise=True / columnwise=True is required")


def _is_data_dtype(t: torch.Tensor, fp8_dtype: torch.dtype) -> bool:
    """FP8 bits may come typed (float8_*) or raw (uint8): both hold the same bytes."""
    return t.dtype == fp8_dtype or t.dtype == torch.uint8


def finite_amax(
    x: torch.Tensor, dim: Optional[int | tuple[int, ...]] = None, keepdim: bool = False
) -> torch.Tensor:
    """float32 ``amax(|x|)`` over the finite elements (0 where there are none, and where a
    reduced dim is empty, such as an expert with no tokens, where ``torch.amax`` would raise).

    Non-finite values do not set the scale, so one ``inf`` cannot turn every other value into
    zero (a scale of ``fp8_max / inf``) and one NaN cannot make the scale NaN. The cast then
    saturates ``inf`` to the largest FP8 value and keeps NaN as NaN, so a non-finite input still
    shows in the result (a NaN loss, as without FP8) instead of becoming a silent garbage scale.
    """
    # nan_to_num maps NaN and +inf (|-inf| is +inf) to 0 in one pass.
    xf = x.float().abs().nan_to_num_(nan=0.0, posinf=0.0)
    if dim is None:
        if x.numel() == 0:
            return torch.zeros((), dtype=torch.float32, device=x.device)
        return xf.amax()
    dims = tuple(d % x.dim() for d in ((dim,) if isinstance(dim, int) else dim))
    if any(x.shape[d] == 0 for d in dims):
        shape = [1 if d in dims else s for d, s in enumerate(x.shape)]
        out = torch.zeros(shape, dtype=torch.float32, device=x.device)
        return out if keepdim else out.squeeze(dims)
    return xf.amax(dim=dims, keepdim=keepdim)


def _scale_from_amax(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Current scaling: ``scale = fp8_max / amax`` so the largest element maps to the FP8 max.

    amax == 0 (an all-zero tensor or block) would give inf; the scale is 1 there instead, which
    quantizes zeros to zeros. A subnormal amax would overflow the division to inf (and 0 * inf is
    NaN), so the scale is capped at the float32 maximum. Computed with ``torch.where`` so that no
    host sync is needed.
    """
    fmax = fp8_max(fp8_dtype)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    # reciprocal, then multiply: two correctly rounded steps that the fused kernels repeat
    # exactly (offload.fp8.triton_cast), so both paths give the same scale bits.
    scale = safe.reciprocal().mul_(fmax).clamp_(max=_FLOAT32_MAX)
    return torch.where(amax > 0, scale, torch.ones_like(amax))


def _cast_fp8(x_scaled: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    # Clamp before the cast: rounding in x * scale can overshoot the max by an ulp, and an
    # out-of-range value becomes NaN (e4m3fn) or inf (e5m2) instead of saturating.
    fmax = fp8_max(fp8_dtype)
    return x_scaled.clamp(-fmax, fmax).to(fp8_dtype)


def dequantize_tensorwise(data: torch.Tensor, scale_inv: torch.Tensor, fp8_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """``data * scale_inv`` as ``dtype``: FP8 data (or its uint8 bits) times one float32
    dequantization factor, multiplied in float32 and rounded once to ``dtype``.

    The product is formed in place in the float32 copy, so the transient is that copy alone (4
    bytes per element) and not a copy plus a product. The fused kernel
    (:func:`offload.fp8.triton_cast.dequantize_tensorwise_fused`) gives the same bits without the
    float32 copy at all.
    """
    out = data.view(fp8_dtype).float()
    out.mul_(scale_inv.reshape(()))
    return out.to(dtype)


def fp8_transpose(data: torch.Tensor) -> torch.Tensor:
    """Contiguous transpose of 2-D FP8 data: ``(R, C)`` -> ``(C, R)``, same dtype.

    This is how the columnwise copy of tensorwise-scaled data is made: ``_scaled_mm`` wants its
    second operand column-major, and ``fp8_transpose(x).t()`` is exactly that. The copy goes
    through uint8 because byte copies are supported on every backend, whatever the FP8 format;
    the bits are unchanged.
    """
    if not isinstance(data, torch.Tensor) or data.dim() != 2:
        raise ValueError("fp8_transpose expects a 2-D tensor")
    if data.dtype not in FP8_DTYPES and data.dtype != torch.uint8:
        raise ValueError(f"fp8_transpose expects FP8 or uint8 data, got {data.dtype}")
    return data.view(torch.uint8).t().contiguous().view(data.dtype)


def _exp2_int(k: torch.Tensor) -> torch.Tensor:
    """Exact float32 ``2**k`` for integer ``k`` in [-127, 127], built from the bit pattern.

    ``torch.exp2`` on a float is not guaranteed exact on every backend; building the IEEE bits
    is. ``2**-127`` is below the smallest normal float32 and has its own (subnormal) pattern.
    """
    k = k.to(torch.int32)
    bits = torch.where(
        k >= -126,
        (k + 127) << 23,
        torch.full_like(k, 1 << 22),  # 2**-127 as a float32 subnormal
    )
    return bits.view(torch.float32)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Decode uint8 E8M0 scales to float32: ``2^(e - 127)``; 255 is NaN by the OCP MX spec."""
    e = scale.view(torch.uint8).to(torch.int32)
    val = _exp2_int(e.clamp(max=254) - _E8M0_BIAS)
    return torch.where(e == 255, torch.full_like(val, float("nan")), val)


