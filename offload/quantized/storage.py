"""The quantized-storage base class (the ``prepare_for_saving`` / ``restore_from_saved``
protocol and usage flags) and the optional one-buffer allocation of a storage's components."""

from __future__ import annotations

from typing import ClassVar, NamedTuple, Optional, Sequence

import torch

from .scaling import FP8_DTYPES, _is_data_dtype
from ..host.layout import plan_layout_py


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

    def __repr__(self) -> str:
        state = "saved" if getattr(self, "_saved", False) else "live"
        return (
            f"{type(self).__name__}(shape={self.shape}, fp8_dtype={self.fp8_dtype}, "
            f"rowwise={self.rowwise_usage}, columnwise={self.columnwise_usage}, {state})"
        )



class ScaledLayoutsStorage(QuantizedStorage):
    """A storage whose two layouts each carry their own scales (per row, per block): the
    blockwise and MXFP8 storages. What they share: the four components, how the layouts and the
    logical shape are set, and that a missing layout cannot be made from the other one."""

    _COMPONENTS: ClassVar[tuple[str, ...]] = (
        "rowwise_data",
        "rowwise_scale_inv",
        "columnwise_data",
        "columnwise_scale_inv",
    )

    rowwise_data: Optional[torch.Tensor]
    rowwise_scale_inv: Optional[torch.Tensor]
    columnwise_data: Optional[torch.Tensor]
    columnwise_scale_inv: Optional[torch.Tensor]

    def _set_layouts(
        self,
        rowwise_data: Optional[torch.Tensor],
        rowwise_scale_inv: Optional[torch.Tensor],
        columnwise_data: Optional[torch.Tensor],
        columnwise_scale_inv: Optional[torch.Tensor],
    ) -> None:
        # The usages follow the data given; (M, K) comes from whichever layout is there.
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
            raise ValueError(f"{type(self).__name__} needs 2-D rowwise_data or columnwise_data")

    def update_usage(
        self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None
    ) -> None:
        """Drop a layout. Creating one needs the high-precision tensor: with per-row or per-block
        scales the layouts' scales differ (storages whose layouts are exact transposes of each
        other override this to make the missing one)."""
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
        for usage, wanted in (("rowwise", want_row), ("columnwise", want_col)):
            if not wanted:
                setattr(self, f"{usage}_data", None)
                setattr(self, f"{usage}_scale_inv", None)
        self.rowwise_usage, self.columnwise_usage = want_row, want_col
        self._finish_init()

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
