"""Quantized tensor storages and the save/restore protocol the offload engine relies on.

A quantized storage is a small Python object that owns a handful of plain tensors (FP8 data in
one or two layouts, float32 or uint8 scales, an optional amax). Autograd cannot save such an
object directly, so the storage follows TransformerEngine's duck-typed protocol:

.. code-block:: python

    tensors, restorable = storage.prepare_for_saving()   # list[Optional[Tensor]], object
    ctx.save_for_backward(*tensors)
    ctx.restorable = restorable
    ...  # backward
    restorable.restore_from_saved(list(ctx.saved_tensors))

``prepare_for_saving`` hands over the component tensors (``None`` for absent ones) and drops the
storage's own references, so the copy autograd keeps is the only one: the offload engine can then
move it to the host and really free the GPU memory. ``restore_from_saved`` puts (possibly other)
tensors back. The engine gives back each component as a typed *view* of one uint8 GPU buffer
(``buf[off:off + n].view(dtype).as_strided(shape, stride)``), so nothing here assumes that a
component owns its memory or is the only tensor living in its storage.

Storages here:

* :class:`Float8TensorStorage`: one float32 scale for the whole tensor ("tensorwise"). Rowwise data
  is ``(M, K)``; columnwise data is its transpose ``(K, M)`` made contiguous, with the same scale.
* :class:`Float8BlockwiseStorage`: float32 scales per row (``(M, 1)``) or per 1x128 / 128x128
  block. The columnwise data is quantized from the transpose with its own scales (``(K, 1)`` per
  row of the ``(K, M)`` transpose), because a per-row scale of ``X`` is not a per-row scale of
  ``X^T``.
* :class:`MXFP8TensorStorage`: OCP MX: one uint8 E8M0 scale (a power of two, ``2^(e - 127)``)
  per 32 consecutive elements along the contiguous dimension.

FP8 data may be held either as a ``torch.float8_*`` tensor or as uint8 holding the same bits
(``data.view(torch.uint8)``); :attr:`QuantizedStorage.fp8_dtype` says which format the bits are in.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple, Optional, Sequence

import torch

from .layout import plan_layout_py

__all__ = [
    "FP8_DTYPES",
    "HIGH_PRECISION",
    "MXFP8_BLOCK_SIZE",
    "QuantizedStorage",
    "Float8TensorStorage",
    "Float8BlockwiseStorage",
    "MXFP8TensorStorage",
    "fp8_max",
    "finite_amax",
    "fp8_transpose",
    "e8m0_to_float",
    "quantize_tensorwise",
    "quantize_blockwise",
    "quantize_mxfp8",
    "dequantize",
]

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


# ----------------------------------------------------------------------------------------------
# validation helpers
# ----------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------
# allocation (optionally all components in one uint8 buffer)
# ----------------------------------------------------------------------------------------------


class _Alloc(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _bulk_views(allocs: Sequence[_Alloc], device: torch.device) -> list[torch.Tensor]:
    """Allocate every component as a view of ONE uint8 buffer, each at a 256-byte aligned offset.

    Grouped layers do this to cut allocator calls; it also mimics what the offload engine hands
    back on unpack. Every component is a byte slice re-typed with ``.view(dtype)`` and reshaped:
    256-byte offsets keep each view aligned for any dtype and for cuBLASLt (16-byte minimum).
    """
    sizes = [_numel(a.shape) * torch.empty((), dtype=a.dtype).element_size() for a in allocs]
    offsets, total = plan_layout_py(sizes)
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    return [
        buf[off : off + n].view(a.dtype).view(a.shape) for a, off, n in zip(allocs, offsets, sizes)
    ]


def _materialize(
    values: Sequence[Optional[torch.Tensor]],
    dtypes: Sequence[torch.dtype],
    bulk: bool,
    device: torch.device,
) -> list[Optional[torch.Tensor]]:
    """Return ``values`` converted to ``dtypes`` (FP8 -> uint8 is a bit view, never a cast).

    With ``bulk=True`` the results are copied into views of one shared uint8 buffer.
    """

    def as_dtype(v: torch.Tensor, d: torch.dtype) -> torch.Tensor:
        if v.dtype == d:
            return v
        if d == torch.uint8 and v.dtype in FP8_DTYPES:
            return v.view(torch.uint8)  # same bits, raw representation
        return v.to(d)

    typed = [None if v is None else as_dtype(v, d) for v, d in zip(values, dtypes)]
    if not bulk:
        return typed
    present = [(i, t) for i, t in enumerate(typed) if t is not None]
    views = _bulk_views([_Alloc(t.dtype, tuple(t.shape)) for _, t in present], device)
    out: list[Optional[torch.Tensor]] = [None] * len(typed)
    for (i, t), v in zip(present, views):
        v.copy_(t)
        out[i] = v
    return out


# ----------------------------------------------------------------------------------------------
# the protocol
# ----------------------------------------------------------------------------------------------


class _Spec(NamedTuple):
    """What a component slot must hold for a restore to be accepted."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    device: torch.device


class QuantizedStorage:
    """Base of the quantized storages: the save/restore protocol and usage flags.

    Subclasses list their component attribute names in ``_COMPONENTS``; that order is the order of
    :meth:`prepare_for_saving`'s list and of what :meth:`restore_from_saved` consumes.

    Attributes:
        fp8_dtype: the FP8 format of the data bits (data tensors may be typed FP8 or uint8).
        shape: logical ``(M, K)`` shape of the quantized matrix.
        rowwise_usage: the storage holds ``(M, K)`` data (for ``X @ W^T`` style GEMMs).
        columnwise_usage: the storage holds ``(K, M)`` data (the transpose, contiguous, for
            GEMMs that contract over ``M``, e.g. wgrad ``dY^T @ X``).
    """

    _COMPONENTS: ClassVar[tuple[str, ...]] = ()

    fp8_dtype: torch.dtype
    shape: tuple[int, int]
    rowwise_usage: bool
    columnwise_usage: bool

    def _finish_init(self, validate: bool = True) -> None:
        """Validate the components (unless the caller made them correct by construction: the
        checks cost ~10 us, a lot on an FP8 module's hot path) and remember their
        dtype/shape/device for restore checks."""
        if validate:
            present = self.components()
            if not present:
                raise ValueError(f"{type(self).__name__}: no component tensors given")
            devices = {t.device for t in present}
            if len(devices) != 1:
                raise ValueError(
                    f"{type(self).__name__}: components live on different devices {sorted(map(str, devices))}"
                )
            self._validate()
        self._specs: list[Optional[_Spec]] = [
            None if t is None else _Spec(t.dtype, tuple(t.shape), t.device)
            for t in (getattr(self, n) for n in self._COMPONENTS)
        ]
        self._saved = False

    def _validate(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    # -- introspection ---------------------------------------------------------------------------

    @classmethod
    def component_names(cls) -> tuple[str, ...]:
        """Names of the component slots, in :meth:`prepare_for_saving` order."""
        return cls._COMPONENTS

    def named_components(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for every present component, in protocol order."""
        out = []
        for name in self._COMPONENTS:
            t = getattr(self, name)
            if t is not None:
                out.append((name, t))
        return out

    def components(self) -> list[torch.Tensor]:
        """The present component tensors, in protocol order (empty while saved)."""
        return [t for _, t in self.named_components()]

    @property
    def device(self) -> torch.device:
        """Device of the components (as recorded at construction; valid while saved too)."""
        return next(s.device for s in self._specs if s is not None)

    def nbytes(self) -> int:
        """Total bytes of the component tensors (recorded sizes; valid while saved too)."""
        return sum(
            _numel(s.shape) * torch.empty((), dtype=s.dtype).element_size()
            for s in self._specs
            if s is not None
        )

    @property
    def is_saved(self) -> bool:
        """True between :meth:`prepare_for_saving` and :meth:`restore_from_saved`."""
        return self._saved

    def _require_live(self, what: str) -> None:
        if self._saved:
            raise RuntimeError(
                f"{type(self).__name__}.{what}: the components were handed over by "
                "prepare_for_saving(); call restore_from_saved() first"
            )

    # -- the protocol ----------------------------------------------------------------------------

    def prepare_for_saving(self) -> tuple[list[Optional[torch.Tensor]], "QuantizedStorage"]:
        """Hand over the components for ``ctx.save_for_backward`` and drop our references.

        Returns ``(tensors, self)``: one entry per slot of :meth:`component_names` (``None`` for
        absent ones), and the object to call :meth:`restore_from_saved` on. Dropping our
        references matters: the engine can only free GPU memory when autograd holds the sole one.
        """
        self._require_live("prepare_for_saving")
        tensors = [getattr(self, n) for n in self._COMPONENTS]
        for n in self._COMPONENTS:
            setattr(self, n, None)
        self._saved = True
        return tensors, self

    def restore_from_saved(
        self, tensors: Sequence[Optional[torch.Tensor]]
    ) -> list[Optional[torch.Tensor]]:
        """Put components back (e.g. ``ctx.saved_tensors``) and return the unused remainder.

        The tensors may be views of any storage with any strides (the engine restores typed views
        of one uint8 buffer). The restore is atomic: count, presence, dtype, shape and device of
        every slot are checked first against what the storage held; on any mismatch a
        ``ValueError`` naming the component is raised and the storage is left exactly as it was.
        """
        tensors = list(tensors)
        n = len(self._COMPONENTS)
        cls = type(self).__name__
        if len(tensors) < n:
            raise ValueError(
                f"{cls}.restore_from_saved needs {n} entries ({', '.join(self._COMPONENTS)}), got {len(tensors)}"
            )
        for i, (name, spec, t) in enumerate(zip(self._COMPONENTS, self._specs, tensors)):
            if spec is None:
                if t is not None:
                    raise ValueError(
                        f"{cls}.restore_from_saved: component '{name}' (#{i}) was absent when saved, "
                        f"got a tensor of shape {tuple(t.shape)}"
                    )
                continue
            if not isinstance(t, torch.Tensor):
                raise ValueError(
                    f"{cls}.restore_from_saved: component '{name}' (#{i}) expected a {spec.dtype} tensor "
                    f"of shape {spec.shape}, got {type(t).__name__}"
                )
            if t.dtype != spec.dtype:
                raise ValueError(
                    f"{cls}.restore_from_saved: component '{name}' (#{i}) expected dtype {spec.dtype}, "
                    f"got {t.dtype} (restore each component viewed as its own dtype)"
                )
            if tuple(t.shape) != spec.shape:
                raise ValueError(
                    f"{cls}.restore_from_saved: component '{name}' (#{i}) expected shape {spec.shape}, "
                    f"got {tuple(t.shape)}"
                )
            if t.device != spec.device:
                raise ValueError(
                    f"{cls}.restore_from_saved: component '{name}' (#{i}) expected device {spec.device}, "
                    f"got {t.device}"
                )
        # Everything checked: now commit.
        for name, t in zip(self._COMPONENTS, tensors):
            setattr(self, name, t)
        self._saved = False
        return tensors[n:]

    def release(self) -> None:
        """Drop every component reference (after backward) while keeping the slot specs.

        A later :meth:`restore_from_saved` (e.g. a second backward with ``retain_graph=True``)
        works as after :meth:`prepare_for_saving`.
        """
        for n in self._COMPONENTS:
            setattr(self, n, None)
        self._saved = True

    def dequantize(
        self, dtype: torch.dtype = torch.float32, *, usage: Optional[str] = None
    ) -> torch.Tensor:
        """Return the ``(M, K)`` high-precision tensor (from ``usage`` data, default: rowwise if held)."""
        raise NotImplementedError

    def _pick_usage(self, usage: Optional[str]) -> str:
        self._require_live("dequantize")
        if usage is None:
            usage = "rowwise" if self.rowwise_usage else "columnwise"
        if usage not in ("rowwise", "columnwise"):
            raise ValueError(f"usage must be 'rowwise' or 'columnwise', got {usage!r}")
        if usage == "rowwise" and not self.rowwise_usage:
            raise ValueError(f"{type(self).__name__} holds no rowwise data")
        if usage == "columnwise" and not self.columnwise_usage:
            raise ValueError(f"{type(self).__name__} holds no columnwise data")
        return usage

    def _check_data(self, name: str, t: Optional[torch.Tensor], shape: tuple[int, int]) -> None:
        if t is None:
            return
        if not _is_data_dtype(t, self.fp8_dtype):
            raise ValueError(
                f"{type(self).__name__}: '{name}' must be {self.fp8_dtype} or uint8 (FP8 bits), got {t.dtype}"
            )
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{type(self).__name__}: '{name}' must have shape {shape}, got {tuple(t.shape)}"
            )

    def _check_scale(
        self,
        name: str,
        t: Optional[torch.Tensor],
        dtype: torch.dtype,
        shapes: Sequence[tuple[int, ...]],
    ) -> None:
        if t is None:
            return
        if t.dtype != dtype:
            raise ValueError(f"{type(self).__name__}: '{name}' must be {dtype}, got {t.dtype}")
        if tuple(t.shape) not in [tuple(s) for s in shapes]:
            raise ValueError(
                f"{type(self).__name__}: '{name}' must have shape {' or '.join(map(str, shapes))}, got {tuple(t.shape)}"
            )

    def _drop_usage(
        self,
        rowwise_usage: Optional[bool],
        columnwise_usage: Optional[bool],
        slots: dict[str, tuple[str, ...]],
    ) -> None:
        """Shared part of ``update_usage``: only dropping data is possible without requantizing."""
        self._require_live("update_usage")
        want_row = self.rowwise_usage if rowwise_usage is None else bool(rowwise_usage)
        want_col = self.columnwise_usage if columnwise_usage is None else bool(columnwise_usage)
        if not (want_row or want_col):
            raise ValueError(f"{type(self).__name__}.update_usage: cannot drop both usages")
        if (want_row and not self.rowwise_usage) or (want_col and not self.columnwise_usage):
            raise ValueError(
                f"{type(self).__name__}.update_usage: cannot create a usage this storage does not hold "
                "(its scales are per block of the other layout); quantize again from the high-precision tensor"
            )
        if not want_row:
            for n in slots["rowwise"]:
                setattr(self, n, None)
        if not want_col:
            for n in slots["columnwise"]:
                setattr(self, n, None)
        self.rowwise_usage, self.columnwise_usage = want_row, want_col
        self._finish_init()

    def __repr__(self) -> str:
        state = "saved" if getattr(self, "_saved", False) else "live"
        return (
            f"{type(self).__name__}(shape={self.shape}, fp8_dtype={self.fp8_dtype}, "
            f"rowwise={self.rowwise_usage}, columnwise={self.columnwise_usage}, {state})"
        )


# ----------------------------------------------------------------------------------------------
# tensorwise
# ----------------------------------------------------------------------------------------------


class Float8TensorStorage(QuantizedStorage):
    """FP8 data with one float32 scale for the whole tensor.

    Components, in :meth:`prepare_for_saving` order: ``rowwise_data`` ``(M, K)``,
    ``columnwise_data`` ``(K, M)`` (the contiguous transpose, same scale), ``scale_inv`` float32
    ``(1,)`` or ``()`` (dequantized = data * scale_inv), ``amax`` float32 ``(1,)`` or ``()``
    (optional). Data is ``fp8_dtype`` or uint8 holding its bits.
    """

    _COMPONENTS: ClassVar[tuple[str, ...]] = (
        "rowwise_data",
        "columnwise_data",
        "scale_inv",
        "amax",
    )

    def __init__(
        self,
        *,
        rowwise_data: Optional[torch.Tensor],
        columnwise_data: Optional[torch.Tensor],
        scale_inv: torch.Tensor,
        amax: Optional[torch.Tensor] = None,
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
        validate: bool = True,
    ) -> None:
        _check_fp8_dtype(fp8_dtype)
        self.fp8_dtype = fp8_dtype
        self.rowwise_data = rowwise_data
        self.columnwise_data = columnwise_data
        self.scale_inv = scale_inv
        self.amax = amax
        self.rowwise_usage = rowwise_data is not None
        self.columnwise_usage = columnwise_data is not None
        if rowwise_data is not None:
            if rowwise_data.dim() != 2:
                raise ValueError("Float8TensorStorage: 'rowwise_data' must be 2-D")
            self.shape = (rowwise_data.shape[0], rowwise_data.shape[1])
        elif columnwise_data is not None:
            if columnwise_data.dim() != 2:
                raise ValueError("Float8TensorStorage: 'columnwise_data' must be 2-D")
            self.shape = (columnwise_data.shape[1], columnwise_data.shape[0])
        else:
            raise ValueError("Float8TensorStorage needs rowwise_data or columnwise_data")
        self._finish_init(validate)

    def _validate(self) -> None:
        m, k = self.shape
        self._check_data("rowwise_data", self.rowwise_data, (m, k))
        self._check_data("columnwise_data", self.columnwise_data, (k, m))
        if self.scale_inv is None:
            raise ValueError("Float8TensorStorage: 'scale_inv' is required")
        self._check_scale("scale_inv", self.scale_inv, torch.float32, [(1,), ()])
        self._check_scale("amax", self.amax, torch.float32, [(1,), ()])

    def update_usage(
        self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None
    ) -> None:
        """Add or drop a layout. With one scale for the tensor, either layout is an exact
        transpose of the other, so a missing one is made with :func:`fp8_transpose`."""
        self._require_live("update_usage")
        want_row = self.rowwise_usage if rowwise_usage is None else bool(rowwise_usage)
        want_col = self.columnwise_usage if columnwise_usage is None else bool(columnwise_usage)
        if not (want_row or want_col):
            raise ValueError("Float8TensorStorage.update_usage: cannot drop both usages")
        if want_row and self.rowwise_data is None:
            self.rowwise_data = fp8_transpose(self.columnwise_data)
        if want_col and self.columnwise_data is None:
            self.columnwise_data = fp8_transpose(self.rowwise_data)
        if not want_row:
            self.rowwise_data = None
        if not want_col:
            self.columnwise_data = None
        self.rowwise_usage, self.columnwise_usage = want_row, want_col
        self._finish_init()

    def dequantize(
        self, dtype: torch.dtype = torch.float32, *, usage: Optional[str] = None
    ) -> torch.Tensor:
        """``data * scale_inv`` as an ``(M, K)`` tensor of ``dtype``."""
        usage = self._pick_usage(usage)
        if usage == "rowwise":
            data = self.rowwise_data.view(self.fp8_dtype).float()
        else:
            data = self.columnwise_data.view(self.fp8_dtype).float().t()
        return (data * self.scale_inv.reshape(())).to(dtype)


def quantize_tensorwise(
    x: torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    scale: Optional[torch.Tensor] = None,
    bulk: bool = False,
    as_uint8: bool = False,
) -> Float8TensorStorage:
    """Quantize a 2-D ``(M, K)`` tensor with one float32 scale (current scaling by default).

    Args:
        x: float32 / bfloat16 / float16 ``(M, K)`` tensor.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        rowwise: produce ``rowwise_data`` ``(M, K)``.
        columnwise: produce ``columnwise_data`` ``(K, M)``, the contiguous transpose.
        scale: optional float32 scale (delayed scaling); default ``fp8_max / amax(x)``, with
            amax == 0 giving scale 1.
        bulk: allocate all components as views of one uint8 buffer (256-byte aligned offsets).
        as_uint8: hold the FP8 bits as uint8 tensors instead of ``fp8_dtype`` tensors.
    """
    fn = "quantize_tensorwise"
    _check_input(x, fn)
    _check_fp8_dtype(fp8_dtype)
    _check_usages(rowwise, columnwise, fn)
    amax = finite_amax(x).reshape(1)
    if scale is None:
        scale = _scale_from_amax(amax, fp8_dtype)
    else:
        if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
            raise ValueError(f"{fn}: scale must be a one-element float32 tensor")
        scale = scale.to(torch.float32).reshape(1)
    scale_inv = torch.reciprocal(scale)
    # contiguous(): elementwise ops keep the input's strides, and the data must be row-major.
    q = _cast_fp8(x.float().contiguous() * scale, fp8_dtype)
    row = q if rowwise else None
    col = fp8_transpose(q) if columnwise else None
    data_dtype = torch.uint8 if as_uint8 else fp8_dtype
    row, col, scale_inv, amax = _materialize(
        [row, col, scale_inv, amax],
        [data_dtype, data_dtype, torch.float32, torch.float32],
        bulk,
        x.device,
    )
    return Float8TensorStorage(
        rowwise_data=row, columnwise_data=col, scale_inv=scale_inv, amax=amax, fp8_dtype=fp8_dtype
    )


# ----------------------------------------------------------------------------------------------
# rowwise / blockwise float32 scales
# ----------------------------------------------------------------------------------------------


def _scale_shape(rows: int, cols: int, block: Optional[tuple[int, int]]) -> tuple[int, int]:
    if block is None:
        return (rows, 1)
    return (rows // block[0], cols // block[1])


def _quantize_blocks(
    a: torch.Tensor, fp8_dtype: torch.dtype, block: Optional[tuple[int, int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``a`` (R, C) with one float32 scale per row or per (br, bc) block.

    Returns ``(data (R, C), scale_inv)`` with scale_inv ``(R, 1)`` per row or ``(R/br, C/bc)``.
    """
    r, c = a.shape
    # contiguous(): ``a`` may be a transposed view (columnwise), and elementwise ops would keep
    # its strides; the data must come out row-major.
    af = a.float().contiguous()
    if block is None:
        amax = finite_amax(af, dim=1, keepdim=True)  # (R, 1)
        scale = _scale_from_amax(amax, fp8_dtype)
        q = _cast_fp8(af * scale, fp8_dtype)
    else:
        br, bc = block
        tiles = af.reshape(r // br, br, c // bc, bc)
        amax = finite_amax(tiles, dim=(1, 3))  # (R/br, C/bc)
        scale = _scale_from_amax(amax, fp8_dtype)
        q = _cast_fp8(tiles * scale[:, None, :, None], fp8_dtype).reshape(r, c)
    return q, torch.reciprocal(scale)


def _expand_block_scales(
    scale_inv: torch.Tensor, rows: int, cols: int, block: Optional[tuple[int, int]]
) -> torch.Tensor:
    """Broadcast per-row / per-block scales to a full ``(rows, cols)`` float32 matrix."""
    if block is None:
        return scale_inv.expand(rows, cols)
    br, bc = block
    return scale_inv.repeat_interleave(br, dim=0).repeat_interleave(bc, dim=1)


_BLOCKS: tuple[Optional[tuple[int, int]], ...] = (None, (1, 128), (128, 128))


class Float8BlockwiseStorage(QuantizedStorage):
    """FP8 data with float32 scales per row (``block=None``) or per 1x128 / 128x128 block.

    Components, in :meth:`prepare_for_saving` order: ``rowwise_data`` ``(M, K)``,
    ``rowwise_scale_inv`` float32 (``(M, 1)`` per row, ``(M, K/128)`` for 1x128,
    ``(M/128, K/128)`` for 128x128), ``columnwise_data`` ``(K, M)``, ``columnwise_scale_inv``
    float32 with the same rule applied to the ``(K, M)`` transpose (``(K, 1)`` per row).
    The columnwise pair is quantized from ``X^T`` directly: per-row scales of ``X^T`` are the
    per-column scales of ``X``, which is what a GEMM contracting over ``M`` (wgrad) needs.
    """

    _COMPONENTS: ClassVar[tuple[str, ...]] = (
        "rowwise_data",
        "rowwise_scale_inv",
        "columnwise_data",
        "columnwise_scale_inv",
    )

    def __init__(
        self,
        *,
        rowwise_data: Optional[torch.Tensor],
        rowwise_scale_inv: Optional[torch.Tensor],
        columnwise_data: Optional[torch.Tensor],
        columnwise_scale_inv: Optional[torch.Tensor],
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
        block: Optional[tuple[int, int]] = None,
        validate: bool = True,
    ) -> None:
        _check_fp8_dtype(fp8_dtype)
        self.block = _check_block(block)
        self.fp8_dtype = fp8_dtype
        self.rowwise_data = rowwise_data
        self.rowwise_scale_inv = rowwise_scale_inv
        self.columnwise_data = columnwise_data
        self.columnwise_scale_inv = columnwise_scale_inv
        self.rowwise_usage = rowwise_data is not None
        self.columnwise_usage = columnwise_data is not None
        if rowwise_data is not None and rowwise_data.dim() == 2:
            self.shape = (rowwise_data.shape[0], rowwise_data.shape[1])
        elif columnwise_data is not None and columnwise_data.dim() == 2:
            self.shape = (columnwise_data.shape[1], columnwise_data.shape[0])
        else:
            raise ValueError("Float8BlockwiseStorage needs 2-D rowwise_data or columnwise_data")
        self._finish_init(validate)

    def _validate(self) -> None:
        m, k = self.shape
        for usage, rows, cols in (("rowwise", m, k), ("columnwise", k, m)):
            data = getattr(self, f"{usage}_data")
            scale = getattr(self, f"{usage}_scale_inv")
            if (data is None) != (scale is None):
                raise ValueError(
                    f"Float8BlockwiseStorage: '{usage}_data' and '{usage}_scale_inv' come together"
                )
            self._check_data(f"{usage}_data", data, (rows, cols))
            self._check_scale(
                f"{usage}_scale_inv", scale, torch.float32, [_scale_shape(rows, cols, self.block)]
            )

    def update_usage(
        self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None
    ) -> None:
        """Drop a layout (creating one needs the high-precision tensor: scales differ per layout)."""
        self._drop_usage(
            rowwise_usage,
            columnwise_usage,
            {
                "rowwise": ("rowwise_data", "rowwise_scale_inv"),
                "columnwise": ("columnwise_data", "columnwise_scale_inv"),
            },
        )

    def dequantize(
        self, dtype: torch.dtype = torch.float32, *, usage: Optional[str] = None
    ) -> torch.Tensor:
        """``data * scale_inv`` (scales broadcast over their rows/blocks) as ``(M, K)``."""
        usage = self._pick_usage(usage)
        data = getattr(self, f"{usage}_data").view(self.fp8_dtype).float()
        scale = getattr(self, f"{usage}_scale_inv")
        out = data * _expand_block_scales(scale, data.shape[0], data.shape[1], self.block)
        if usage == "columnwise":
            out = out.t()
        return out.to(dtype)


def _check_block(block: Any) -> Optional[tuple[int, int]]:
    if block is not None:
        try:
            block = (int(block[0]), int(block[1]))
        except (TypeError, IndexError, ValueError):
            raise ValueError(
                f"block must be None (per row), (1, 128) or (128, 128), got {block!r}"
            ) from None
    if block not in _BLOCKS:
        raise ValueError(f"block must be None (per row), (1, 128) or (128, 128), got {block!r}")
    return block


def quantize_blockwise(
    x: torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    block: Optional[tuple[int, int]] = None,
    rowwise: bool = True,
    columnwise: bool = False,
    bulk: bool = False,
    as_uint8: bool = False,
) -> Float8BlockwiseStorage:
    """Quantize a 2-D ``(M, K)`` tensor with float32 scales per row or per block.

    Args:
        x: float32 / bfloat16 / float16 ``(M, K)`` tensor.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        block: ``None``: one scale per row (``(M, 1)``; what ``_scaled_mm`` rowwise scaling
            takes); ``(1, 128)`` or ``(128, 128)``: one scale per block. The block applies to the
            layout being produced (the ``(K, M)`` transpose for columnwise), so the blocked
            dimensions of each produced layout must be multiples of the block.
        rowwise / columnwise: which layouts to produce (see :class:`Float8BlockwiseStorage`).
        bulk: allocate all components as views of one uint8 buffer (256-byte aligned offsets).
        as_uint8: hold the FP8 bits as uint8 tensors.
    """
    fn = "quantize_blockwise"
    _check_input(x, fn)
    _check_fp8_dtype(fp8_dtype)
    _check_usages(rowwise, columnwise, fn)
    block = _check_block(block)
    m, k = x.shape
    if block is not None:
        br, bc = block
        for usage, rows, cols, on in (("rowwise", m, k, rowwise), ("columnwise", k, m, columnwise)):
            if on and (rows % br or cols % bc):
                raise ValueError(
                    f"{fn}: {usage} data of shape ({rows}, {cols}) is not a whole number of {br}x{bc} blocks; "
                    f"pad the tensor or use block=None (per-row scales)"
                )
    row = row_s = col = col_s = None
    if rowwise:
        row, row_s = _quantize_blocks(x, fp8_dtype, block)
    if columnwise:
        col, col_s = _quantize_blocks(x.t(), fp8_dtype, block)
    data_dtype = torch.uint8 if as_uint8 else fp8_dtype
    row, row_s, col, col_s = _materialize(
        [row, row_s, col, col_s],
        [data_dtype, torch.float32, data_dtype, torch.float32],
        bulk,
        x.device,
    )
    return Float8BlockwiseStorage(
        rowwise_data=row,
        rowwise_scale_inv=row_s,
        columnwise_data=col,
        columnwise_scale_inv=col_s,
        fp8_dtype=fp8_dtype,
        block=block,
    )


# ----------------------------------------------------------------------------------------------
# MXFP8
# ----------------------------------------------------------------------------------------------


def _quantize_mx(a: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """MX-quantize ``a`` (R, C) along C: returns data (R, C) and uint8 E8M0 scales (R, C/32).

    The shared exponent of a block is ``floor(log2(amax)) - emax(fp8_dtype)`` (OCP MX v1.0), so
    the block's largest element lands in the top binade of the element format; the few values
    that then exceed the format's max (e.g. 1.9 * 2^8 > 448) saturate. ``torch.frexp`` gives
    ``floor(log2(amax))`` exactly (``amax = m * 2^e``, ``m`` in [0.5, 1) -> ``e - 1``).
    """
    r, c = a.shape
    blocks = a.float().contiguous().reshape(r, c // MXFP8_BLOCK_SIZE, MXFP8_BLOCK_SIZE)
    amax = finite_amax(blocks, dim=2)  # (R, C/32)
    _, e = torch.frexp(amax)
    shared = (e.to(torch.int32) - 1) - _FP8_EMAX[fp8_dtype]
    # All-zero blocks: scale 1 (biased 127); any scale would do, this one is easy to read.
    shared = torch.where(amax > 0, shared, torch.zeros_like(shared))
    biased = (shared + _E8M0_BIAS).clamp(0, 254)  # 255 is NaN in E8M0
    inv = _exp2_int(_E8M0_BIAS - biased)  # 2^-(shared exponent), exact
    q = _cast_fp8(blocks * inv[:, :, None], fp8_dtype).reshape(r, c)
    return q, biased.to(torch.uint8)


class MXFP8TensorStorage(QuantizedStorage):
    """MXFP8: FP8 data with one uint8 E8M0 scale (``2^(e - 127)``) per 32 contiguous elements.

    Components, in :meth:`prepare_for_saving` order: ``rowwise_data`` ``(M, K)``,
    ``rowwise_scale_inv`` uint8 ``(M, K/32)``, ``columnwise_data`` ``(K, M)``,
    ``columnwise_scale_inv`` uint8 ``(K, M/32)``. Scales are kept in plain row-major order (not
    the swizzled layout block-scaled GEMM kernels consume).
    """

    _COMPONENTS: ClassVar[tuple[str, ...]] = (
        "rowwise_data",
        "rowwise_scale_inv",
        "columnwise_data",
        "columnwise_scale_inv",
    )

    def __init__(
        self,
        *,
        rowwise_data: Optional[torch.Tensor],
        rowwise_scale_inv: Optional[torch.Tensor],
        columnwise_data: Optional[torch.Tensor],
        columnwise_scale_inv: Optional[torch.Tensor],
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    ) -> None:
        _check_fp8_dtype(fp8_dtype)
        self.fp8_dtype = fp8_dtype
        self.rowwise_data = rowwise_data
        self.rowwise_scale_inv = rowwise_scale_inv
        self.columnwise_data = columnwise_data
        self.columnwise_scale_inv = columnwise_scale_inv
        self.rowwise_usage = rowwise_data is not None
        self.columnwise_usage = columnwise_data is not None
        if rowwise_data is not None and rowwise_data.dim() == 2:
            self.shape = (rowwise_data.shape[0], rowwise_data.shape[1])
        elif columnwise_data is not None and columnwise_data.dim() == 2:
            self.shape = (columnwise_data.shape[1], columnwise_data.shape[0])
        else:
            raise ValueError("MXFP8TensorStorage needs 2-D rowwise_data or columnwise_data")
        self._finish_init()

    def _validate(self) -> None:
        m, k = self.shape
        for usage, rows, cols in (("rowwise", m, k), ("columnwise", k, m)):
            data = getattr(self, f"{usage}_data")
            scale = getattr(self, f"{usage}_scale_inv")
            if (data is None) != (scale is None):
                raise ValueError(
                    f"MXFP8TensorStorage: '{usage}_data' and '{usage}_scale_inv' come together"
                )
            if data is None:
                continue
            if cols % MXFP8_BLOCK_SIZE:
                raise ValueError(
                    f"MXFP8TensorStorage: {usage} data has {cols} contiguous elements per row, "
                    f"not a multiple of {MXFP8_BLOCK_SIZE}"
                )
            self._check_data(f"{usage}_data", data, (rows, cols))
            self._check_scale(
                f"{usage}_scale_inv", scale, torch.uint8, [(rows, cols // MXFP8_BLOCK_SIZE)]
            )

    def update_usage(
        self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None
    ) -> None:
        """Drop a layout (creating one needs the high-precision tensor: blocks differ per layout)."""
        self._drop_usage(
            rowwise_usage,
            columnwise_usage,
            {
                "rowwise": ("rowwise_data", "rowwise_scale_inv"),
                "columnwise": ("columnwise_data", "columnwise_scale_inv"),
            },
        )

    def dequantize(
        self, dtype: torch.dtype = torch.float32, *, usage: Optional[str] = None
    ) -> torch.Tensor:
        """``data * 2^(e - 127)`` per 32-element block, as ``(M, K)``."""
        usage = self._pick_usage(usage)
        data = getattr(self, f"{usage}_data").view(self.fp8_dtype).float()
        scale = e8m0_to_float(getattr(self, f"{usage}_scale_inv"))
        r, c = data.shape
        out = (
            data.reshape(r, c // MXFP8_BLOCK_SIZE, MXFP8_BLOCK_SIZE) * scale[:, :, None]
        ).reshape(r, c)
        if usage == "columnwise":
            out = out.t()
        return out.to(dtype)


def quantize_mxfp8(
    x: torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    bulk: bool = False,
    as_uint8: bool = False,
) -> MXFP8TensorStorage:
    """MXFP8-quantize a 2-D ``(M, K)`` tensor: E8M0 scales per 32 elements of the contiguous dim.

    Rowwise needs ``K % 32 == 0`` (scales ``(M, K/32)``); columnwise quantizes the ``(K, M)``
    transpose along ``M`` and needs ``M % 32 == 0`` (scales ``(K, M/32)``).
    ``bulk`` / ``as_uint8`` as in :func:`quantize_tensorwise`.
    """
    fn = "quantize_mxfp8"
    _check_input(x, fn)
    _check_fp8_dtype(fp8_dtype)
    _check_usages(rowwise, columnwise, fn)
    m, k = x.shape
    if rowwise and k % MXFP8_BLOCK_SIZE:
        raise ValueError(
            f"{fn}: K={k} (the last dim) must be a multiple of {MXFP8_BLOCK_SIZE} for rowwise MXFP8 "
            f"(one E8M0 scale per {MXFP8_BLOCK_SIZE} elements); pad the tensor"
        )
    if columnwise and m % MXFP8_BLOCK_SIZE:
        raise ValueError(
            f"{fn}: M={m} (the first dim) must be a multiple of {MXFP8_BLOCK_SIZE} for columnwise MXFP8 "
            f"(one E8M0 scale per {MXFP8_BLOCK_SIZE} elements of the transpose); pad the tensor"
        )
    row = row_s = col = col_s = None
    if rowwise:
        row, row_s = _quantize_mx(x, fp8_dtype)
    if columnwise:
        col, col_s = _quantize_mx(x.t(), fp8_dtype)
    data_dtype = torch.uint8 if as_uint8 else fp8_dtype
    row, row_s, col, col_s = _materialize(
        [row, row_s, col, col_s], [data_dtype, torch.uint8, data_dtype, torch.uint8], bulk, x.device
    )
    return MXFP8TensorStorage(
        rowwise_data=row,
        rowwise_scale_inv=row_s,
        columnwise_data=col,
        columnwise_scale_inv=col_s,
        fp8_dtype=fp8_dtype,
    )


def dequantize(
    storage: QuantizedStorage, dtype: torch.dtype = torch.float32, *, usage: Optional[str] = None
) -> torch.Tensor:
    """Dequantize any storage of this module to an ``(M, K)`` tensor of ``dtype``.

    ``usage`` picks the layout to read (``"rowwise"`` / ``"columnwise"``); by default the
    rowwise data when held, otherwise the columnwise data.
    """
    if not isinstance(storage, QuantizedStorage):
        raise ValueError(f"dequantize expects a QuantizedStorage, got {type(storage).__name__}")
    return storage.dequantize(dtype, usage=usage)
