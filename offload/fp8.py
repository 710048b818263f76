"""An FP8 ``Linear`` on ``torch._scaled_mm`` that saves only the columnwise FP8 input for wgrad.

Forward, dgrad and wgrad are three FP8 GEMMs::

    Y  = X  @ W^T     mat1 = X  rowwise (M, K)            mat2 = W rowwise (N, K), transposed
    dX = dY @ W       mat1 = dY rowwise (M, N)            mat2 = W columnwise (K, N), transposed
    dW = dY^T @ X     mat1 = dY columnwise (N, M)         mat2 = X columnwise (K, M), transposed

``_scaled_mm`` wants ``mat1`` row-major and ``mat2`` column-major; ``c.t()`` of a contiguous
``c`` is column-major, so every ``mat2`` above is the ``.t()`` of contiguous data, and the only
activation autograd has to keep is the columnwise FP8 input ``(K, M)`` with its scale(s): half
the bytes of a bf16 input. Those components are tagged with
:func:`offload.marks.mark_activation_offload` so that the v1 schedule (opt-in selection) moves
them. The weight's FP8 copy is recomputed from the Parameter in backward (bitwise the same as in
forward, since quantization is deterministic), and the Parameter itself is what autograd saves:
the engine keeps Parameters on the GPU.

Scaling:

* ``"tensorwise"`` (default): current scaling, one float32 scale per tensor
  (``fp8_max / amax``, 1 when amax == 0). The columnwise copies are exact transposes.
* ``"rowwise"``: one float32 scale per row of each GEMM operand along its non-contracted dim:
  ``(M, 1)`` and ``(1, N)``. The columnwise copies are quantized from the transposes with their
  own per-row scales, since a GEMM can only apply scales along non-contracted dims.

Gradients are quantized to e4m3fn with their own current scale. Bias is added (and its gradient
summed) in high precision. Every step is deterministic, so outputs and gradients are bitwise
repeatable run to run.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from .marks import mark_activation_offload
from .quantized import (
    FP8_DTYPES,
    Float8BlockwiseStorage,
    Float8TensorStorage,
    QuantizedStorage,
    quantize_blockwise,
    quantize_tensorwise,
)

__all__ = ["Linear", "scaled_mm_supported", "fp8_gemm", "SCALINGS"]

SCALINGS = ("tensorwise", "rowwise")
# ``_scaled_mm`` (cuBLASLt) needs the contraction dim and both dims of mat2 to be multiples of 16.
_GEMM_MULTIPLE = 16
_HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)
# Weights and gradients are always e4m3fn: cuBLASLt has no e5m2 x e5m2 FP8 GEMM, and the rowwise
# kernels take e4m3fn only.
_WEIGHT_FP8 = torch.float8_e4m3fn
_GRAD_FP8 = torch.float8_e4m3fn


def _device_of(device: Union[torch.device, str, int, None]) -> torch.device:
    if device is None:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    return torch.device(device)


def _fp8_unsupported_reason(device: torch.device) -> Optional[str]:
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
    return _fp8_unsupported_reason(_device_of(device)) is None


@functools.lru_cache(maxsize=None)
def rowwise_supported(device_type: str) -> bool:
    """Whether ``torch._scaled_mm`` takes rowwise (vector) scales on this device type.

    Probed once with a 16x16 GEMM: CUDA (sm_89+) has it; the CPU kernel gained it only in newer
    PyTorch releases (torch 2.11's CPU ``_scaled_mm`` is per-tensor only).
    """
    device = torch.device(device_type)
    if _fp8_unsupported_reason(device) is not None:
        return False
    a = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), torch.ones(16, 1, device=device), torch.ones(1, 16, device=device), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def _rowwise_out_dtype_reason(device: torch.device, out_dtype: torch.dtype) -> Optional[str]:
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
) -> torch.Tensor:
    """``(a * scale_a) @ (b_t * scale_b)`` with ``torch._scaled_mm``.

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
        use_fast_accum=False,  # full-precision accumulation: fast accumulation loses bits
    )
    # Very old releases returned (out, amax).
    return out[0] if isinstance(out, tuple) else out


def _fp8(t: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == fp8_dtype else t.view(fp8_dtype)


def _tensor_scale(s: torch.Tensor) -> torch.Tensor:
    return s.reshape(())


@dataclass(frozen=True)
class _Config:
    scaling: str
    act_fp8: torch.dtype
    need_wgrad: bool


def _quantize(
    x: torch.Tensor, cfg: _Config, fp8_dtype: torch.dtype, *, rowwise: bool, columnwise: bool
) -> QuantizedStorage:
    if cfg.scaling == "tensorwise":
        return quantize_tensorwise(x, fp8_dtype, rowwise=rowwise, columnwise=columnwise)
    return quantize_blockwise(x, fp8_dtype, block=None, rowwise=rowwise, columnwise=columnwise)


def _row_operand(s: QuantizedStorage, cfg: _Config) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, scale) of a storage's rowwise layout as ``_scaled_mm``'s mat1."""
    if cfg.scaling == "tensorwise":
        assert isinstance(s, Float8TensorStorage)
        return _fp8(s.rowwise_data, s.fp8_dtype), _tensor_scale(s.scale_inv)
    assert isinstance(s, Float8BlockwiseStorage)
    return _fp8(s.rowwise_data, s.fp8_dtype), s.rowwise_scale_inv  # (rows, 1)


def _col_operand_as_mat1(s: QuantizedStorage, cfg: _Config) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, scale) of a storage's columnwise layout ``(K, M)`` as mat1 (row-major)."""
    if cfg.scaling == "tensorwise":
        assert isinstance(s, Float8TensorStorage)
        return _fp8(s.columnwise_data, s.fp8_dtype), _tensor_scale(s.scale_inv)
    assert isinstance(s, Float8BlockwiseStorage)
    return _fp8(s.columnwise_data, s.fp8_dtype), s.columnwise_scale_inv  # (K, 1)


def _as_mat2(
    data: torch.Tensor, scale: torch.Tensor, cfg: _Config
) -> tuple[torch.Tensor, torch.Tensor]:
    """mat2 is the transpose of contiguous (rows, K) data: column-major (K, rows). A per-row
    scale (rows, 1) of that data becomes the (1, rows) column scale ``_scaled_mm`` wants."""
    if cfg.scaling == "tensorwise":
        return data.t(), scale
    return data.t(), scale.reshape(1, -1)


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        cfg: _Config,
    ) -> torch.Tensor:
        out_dtype = x.dtype
        # Input: rowwise for this GEMM, columnwise (K, M) for wgrad when it will be needed.
        xq = _quantize(x, cfg, cfg.act_fp8, rowwise=True, columnwise=cfg.need_wgrad)
        wq = _quantize(weight.detach(), cfg, _WEIGHT_FP8, rowwise=True, columnwise=False)
        a, sa = _row_operand(xq, cfg)
        b, sb = _as_mat2(*_row_operand(wq, cfg), cfg)
        y = fp8_gemm(a, b, sa, sb, out_dtype)
        if bias is not None:
            y = y + bias.to(out_dtype)

        saved: Optional[QuantizedStorage] = None
        if cfg.need_wgrad:
            # Keep ONLY the columnwise input and its scale(s); the rowwise copy and amax die here.
            if cfg.scaling == "tensorwise":
                saved = Float8TensorStorage(
                    rowwise_data=None,
                    columnwise_data=xq.columnwise_data,
                    scale_inv=xq.scale_inv,
                    amax=None,
                    fp8_dtype=xq.fp8_dtype,
                )
            else:
                xq.update_usage(rowwise_usage=False)
                saved = xq
            mark_activation_offload(saved)
            tensors, restorable = saved.prepare_for_saving()
        else:
            tensors, restorable = [], None
        del xq
        ctx.save_for_backward(*tensors, weight)
        ctx.restorable = restorable
        ctx.n_storage = len(tensors)
        ctx.cfg = cfg
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.x_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        cfg: _Config = ctx.cfg
        saved = ctx.saved_tensors
        weight = saved[ctx.n_storage]
        need_dgrad = ctx.needs_input_grad[0]
        need_wgrad = ctx.needs_input_grad[1] and ctx.restorable is not None
        dy = dy.contiguous()

        dx = dw = db = None
        if need_dgrad or need_wgrad:
            dyq = _quantize(dy, cfg, _GRAD_FP8, rowwise=need_dgrad, columnwise=need_wgrad)
        if need_dgrad:
            # W columnwise (K, N): the exact transpose for one scale; its own per-row scales
            # (per column of W) for rowwise scaling.
            if cfg.scaling == "tensorwise":
                wq = quantize_tensorwise(
                    weight.detach(), _WEIGHT_FP8, rowwise=False, columnwise=True
                )
            else:
                wq = quantize_blockwise(
                    weight.detach(), _WEIGHT_FP8, rowwise=False, columnwise=True
                )
            a, sa = _row_operand(dyq, cfg)
            b, sb = _as_mat2(*_col_operand_as_mat1(wq, cfg), cfg)
            dx = fp8_gemm(a, b, sa, sb, ctx.x_dtype)
        if need_wgrad:
            storage: QuantizedStorage = ctx.restorable
            storage.restore_from_saved(list(saved[: ctx.n_storage]))
            try:
                a, sa = _col_operand_as_mat1(dyq, cfg)  # dY^T (N, M), row-major
                b, sb = _as_mat2(*_col_operand_as_mat1(storage, cfg), cfg)  # X (M, K), col-major
                dw = fp8_gemm(a, b, sa, sb, weight.dtype)
            finally:
                # Drop our references to the (possibly engine-owned) restored buffers right away;
                # a second backward (retain_graph=True) restores again from ctx.saved_tensors.
                storage.release()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(dim=0).to(ctx.bias_dtype)
        return dx, dw, db, None


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

    Inputs are ``(..., in_features)`` float32/bfloat16/float16; the output has the input's dtype.
    When the weight gets a gradient, the number of rows ``M`` (the product of the leading dims)
    must be a multiple of 16, since wgrad contracts over it.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        scaling: str = "tensorwise",
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
        device: Union[torch.device, str, None] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        if scaling not in SCALINGS:
            raise ValueError(f"fp8.Linear: scaling must be one of {SCALINGS}, got {scaling!r}")
        if fp8_dtype not in FP8_DTYPES:
            raise ValueError(
                f"fp8.Linear: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}"
            )
        if scaling == "rowwise" and fp8_dtype != torch.float8_e4m3fn:
            raise ValueError(
                "fp8.Linear: scaling='rowwise' supports fp8_dtype=torch.float8_e4m3fn only "
                "(rowwise-scaled FP8 GEMM kernels take e4m3 operands); use scaling='tensorwise' for e5m2"
            )
        for name, n in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(n, int) or n <= 0 or n % _GEMM_MULTIPLE:
                raise ValueError(
                    f"fp8.Linear: {name}={n} must be a positive multiple of {_GEMM_MULTIPLE} "
                    "(torch._scaled_mm requires it); pad the layer or use torch.nn.Linear"
                )
        if dtype is not None and dtype not in _HIGH_PRECISION:
            raise ValueError(f"fp8.Linear: dtype must be float32, bfloat16 or float16, got {dtype}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.scaling = scaling
        self.fp8_dtype = fp8_dtype
        self._checked_devices: set[torch.device] = set()

    def _check_call(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"fp8.Linear expects a torch.Tensor input, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"fp8.Linear: input of shape {tuple(x.shape)} does not end in in_features={self.in_features}"
            )
        if x.dtype not in _HIGH_PRECISION:
            raise ValueError(
                f"fp8.Linear: input dtype must be float32, bfloat16 or float16, got {x.dtype}"
            )
        if self.weight.dtype not in _HIGH_PRECISION:
            raise ValueError(
                f"fp8.Linear: weight dtype must be float32, bfloat16 or float16, got {self.weight.dtype}"
            )
        if x.device != self.weight.device:
            raise ValueError(
                f"fp8.Linear: input is on {x.device} but the weight is on {self.weight.device}; move one of them"
            )
        dev = x.device
        if dev not in self._checked_devices:
            reason = _fp8_unsupported_reason(dev)
            if reason is not None:
                raise ValueError(f"fp8.Linear cannot run on {dev}: {reason}")
            self._checked_devices.add(dev)
        if self.scaling == "rowwise":
            if not rowwise_supported(dev.type):
                raise ValueError(
                    f"fp8.Linear: scaling='rowwise' is not supported by torch._scaled_mm on {dev.type} "
                    f"in PyTorch {torch.__version__}; use scaling='tensorwise' or a CUDA GPU"
                )
            for what, dt in (("input", x.dtype), ("weight", self.weight.dtype)):
                reason = _rowwise_out_dtype_reason(dev, dt)
                if reason is not None:
                    raise ValueError(f"fp8.Linear ({what}): {reason}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_call(x)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        m = x2.shape[0]
        need_wgrad = torch.is_grad_enabled() and self.weight.requires_grad
        if need_wgrad and m % _GEMM_MULTIPLE:
            raise ValueError(
                f"fp8.Linear: the input has M={m} rows (product of the leading dims {tuple(lead)}); the FP8 "
                f"wgrad GEMM contracts over M, which must be a multiple of {_GEMM_MULTIPLE}. Pad the "
                "batch/sequence to a multiple of 16 tokens"
            )
        cfg = _Config(scaling=self.scaling, act_fp8=self.fp8_dtype, need_wgrad=need_wgrad)
        y = _Fp8LinearFunction.apply(x2, self.weight, self.bias, cfg)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scaling={self.scaling}, fp8_dtype={self.fp8_dtype}"
