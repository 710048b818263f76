"""A group's per-tensor bookkeeping: the entry table, native or its Python reference.

One entry per saved tensor: the storage *slot* it lives in (views of one storage share one),
its byte offset there, dtype, shape, stride, lazy conj/neg bits and version at pack, and an alias
the table owns. The table gives the slot spans to the layout and the copy, empties the aliases
at release keeping their version counters, and hands each entry back, as the original while the
group holds it, or as a typed view of the reload buffer::

    buffer(uint8) -> .view(dtype) -> .as_strided(shape, stride, element offset)

This is the part of a group that runs once per saved tensor (pack, release, unpack), so it is
built in C++ against torch's C++ API (``csrc/torch/entry_table.cpp``, ``offload._entries``) where
the build had torch's headers; :class:`EntryTable` here is the same contract in Python, used
where that extension is absent or disabled, and the reference the tests hold it to.
:func:`new_entry_table` picks one.

Lazy conjugate and negative views (``t.conj()`` of a complex tensor, ``torch._neg_view``) share
their base's bytes and carry the operation as a bit; the bytes copied are the unconjugated ones,
and the bits are put back on the restored view, so the values autograd reads are the saved ones.

Alignment: a slot's span starts at its lowest byte rounded *down* to the alignment (256), and the
layout puts slots at aligned offsets, so a restored view has the same address modulo 256 as the
original: what was aligned for an FP8 GEMM stays aligned, and every element offset is an integer.

Version checks: ``original`` and ``restore`` return None when the tensor was changed in place
since it was saved (autograd skips its own check for tensors saved through hooks); the caller
raises, naming the tensor (``describe``).
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Union

import torch

from ..host import native

CONJ_BIT = 1
NEG_BIT = 2

_make_alias = torch.Tensor._make_subclass
_set_versions = torch._C._autograd._unsafe_set_version_counter
_version_of = operator.attrgetter("_version")


def own_alias(t: torch.Tensor) -> torch.Tensor:
    """An alias of ``t`` that the table owns: same storage and version counter, no autograd
    history (like ``detach()``), and free to change its storage later (unlike ``detach()``, whose
    result refuses ``set_``), which is what :func:`empty_keeping_versions` needs."""
    return _make_alias(torch.Tensor, t)


def empty_keeping_versions(aliases: list[torch.Tensor]) -> None:
    """Let go of the memory of :func:`own_alias` aliases, in place, keeping their version counters.

    Autograd's version counter is shared by every alias of a tensor (views, ``detach``), and an
    in-place change through any of them moves it. Once a group has released its originals, the
    caller may still hold an alias and change it; the emptied aliases keep the counter readable
    at no memory cost. ``set_()`` swaps in an empty storage (not a view: no ``_base`` keeps the
    original's memory), but counts as an in-place change, so the counters are put back to what
    they were, in one call.
    """
    versions = tuple(map(_version_of, aliases))
    for alias in aliases:
        alias.set_()
    _set_versions(tuple(aliases), versions)


def storage_extent_bytes(t: torch.Tensor) -> int:
    """Bytes from the first to one past the last element ``t`` addresses in its storage."""
    if t.is_contiguous():
        return t.numel() * t.element_size()
    span = 1
    for size, stride in zip(t.shape, t.stride()):
        if size == 0:
            return 0
        span += (size - 1) * stride
    return span * t.element_size()


def _with_lazy_bits(view: torch.Tensor, lazy: int) -> torch.Tensor:
    # The bytes are the base's; the bits say how the saved tensor reads them.
    if lazy & CONJ_BIT:
        view = torch.conj(view)
    if lazy & NEG_BIT:
        view = torch._neg_view(view)
    return view


class EntryTable:
    """The Python reference of ``offload._entries.EntryTable`` (same methods, same results).

    ``retain=False``: a table that only measures (the planner's probe): it lays slots out like
    any table but keeps no reference to the tensors or storages, so a plain step's memory is freed
    as usual; it is only ever sized, never copied or restored.
    """

    __slots__ = (
        "retain", "_align_mask", "_closed", "_holds", "_slot_of_ptr", "_storages", "slot_lo",
        "slot_hi", "_offsets", "_entries", "_versions", "_aliases", "element_offsets",
        "_typed_buffer", "_typed",
    )

    def __init__(self, retain: bool, alignment: int) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a positive power of two, got {alignment}")
        self.retain = retain
        self._align_mask = ~(alignment - 1)
        self._closed = False
        self._holds = True
        # Slots are keyed by data pointer: the table holds the storage while the key is in use,
        # so no other live storage can have that address.
        self._slot_of_ptr: dict[int, int] = {}
        self._storages: list[Any] = []
        self.slot_lo: list[int] = []
        self.slot_hi: list[int] = []
        self._offsets: list[int] = []
        # (slot, byte offset in its storage, dtype, shape, stride, lazy bits) per entry.
        self._entries: list[tuple[int, int, torch.dtype, torch.Size, tuple[int, ...], int]] = []
        self._versions: list[int] = []
        self._aliases: list[torch.Tensor] = []
        self.element_offsets: list[int] = []
        self._typed_buffer: Optional[torch.Tensor] = None
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    # -- building --------------------------------------------------------------------------------
    def add(self, t: torch.Tensor) -> int:
        """Record ``t`` and return its entry index."""
        if self._closed:
            raise RuntimeError("offload: add() on a closed entry table")
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        itemsize = t.element_size()
        lo = t.storage_offset() * itemsize
        hi = lo + storage_extent_bytes(t)
        aligned_lo = lo & self._align_mask
        slot = self._slot_of_ptr.get(ptr)
        if slot is None:
            slot = len(self.slot_lo)
            self._slot_of_ptr[ptr] = slot
            self._storages.append(storage if self.retain else None)
            self.slot_lo.append(aligned_lo)
            self.slot_hi.append(hi)
        else:
            if aligned_lo < self.slot_lo[slot]:
                self.slot_lo[slot] = aligned_lo
            if hi > self.slot_hi[slot]:
                self.slot_hi[slot] = hi
        self._entries.append((slot, lo, t.dtype, t.shape, t.stride(), t.is_conj() | (t.is_neg() << 1)))
        self._versions.append(t._version)
        if self.retain:
            self._aliases.append(own_alias(t))
        return len(self._entries) - 1

    def __len__(self) -> int:
        return len(self._entries)

    def slot_count(self) -> int:
        """How many storage slots the entries live in."""
        return len(self.slot_lo)

    def slot_of(self, index: int) -> int:
        """The slot of entry ``index``."""
        return self._entries[index][0]

    def slot_sizes(self) -> list[int]:
        """Byte size of each slot's span."""
        return [hi - lo for lo, hi in zip(self.slot_lo, self.slot_hi)]

    def close(self, offsets: list[int]) -> None:
        """Freeze the table with each slot's planned offset in the region."""
        if len(offsets) != len(self.slot_lo):
            raise ValueError(f"close: one offset per slot expected, got {len(offsets)} for {len(self.slot_lo)} slots")
        slot_lo = self.slot_lo
        self.element_offsets = [
            (offsets[slot] + byte_offset - slot_lo[slot]) // dtype.itemsize
            for slot, byte_offset, dtype, _, _, _ in self._entries
        ]
        self._offsets = list(offsets)
        self._slot_of_ptr.clear()
        self._closed = True

    # -- copying ---------------------------------------------------------------------------------
    def _check_storages(self, what: str) -> None:
        if not (self.retain and self._holds and self._closed):
            raise RuntimeError(f"offload: {what}() needs a closed table that still holds its storages")

    def copy_lists(self, base: int) -> tuple[list[int], list[int], list[int]]:
        """``(dsts, srcs, sizes)`` of the offload copy: each slot's span to its offset from ``base``."""
        self._check_storages("copy_lists")
        return (
            [base + off for off in self._offsets],
            [s.data_ptr() + lo for s, lo in zip(self._storages, self.slot_lo)],
            self.slot_sizes(),
        )

    def slot_byte_views(self, device: torch.device) -> list[torch.Tensor]:
        """Each slot's span as a uint8 tensor over its storage (the torch copy path)."""
        self._check_storages("slot_byte_views")
        return [
            torch.empty(0, dtype=torch.uint8, device=device).set_(storage, lo, (hi - lo,), (1,))
            for storage, lo, hi in zip(self._storages, self.slot_lo, self.slot_hi)
        ]

    def release(self) -> None:
        """Let go of the originals' memory; the emptied aliases stay as version sentinels."""
        empty_keeping_versions(self._aliases)
        self._storages = []
        self._holds = False

    @property
    def holds_originals(self) -> bool:
        """Whether the originals are still held (not yet released)."""
        return self._holds

    # -- handing back ----------------------------------------------------------------------------
    def original(self, index: int) -> Optional[torch.Tensor]:
        """The saved tensor as it was, or None if it was changed in place since."""
        if not self._holds:
            raise RuntimeError("offload: original() after the originals were released")
        alias = self._aliases[index]
        return alias if alias._version == self._versions[index] else None

    def restore(self, index: int, buffer: torch.Tensor) -> Optional[torch.Tensor]:
        """Entry ``index`` as a typed view of ``buffer``, or None if it was changed in place."""
        _, _, dtype, shape, stride, lazy = self._entries[index]
        if self.retain and self._aliases[index]._version != self._versions[index]:
            return None
        if buffer is not self._typed_buffer:
            self._typed_buffer = buffer
            self._typed = {}
        typed = self._typed.get(dtype)
        if typed is None:
            typed = self._typed[dtype] = buffer.view(dtype)
        view = typed.as_strided(shape, stride, self.element_offsets[index])
        return _with_lazy_bits(view, lazy) if lazy else view

    def drop_buffer(self) -> None:
        """Forget the reload buffer's typed views (the group dropped the buffer)."""
        self._typed_buffer = None
        self._typed = {}

    def describe(self, index: int) -> tuple[list[int], torch.dtype, int, int]:
        """``(shape, dtype, version now, version at pack)``: what the in-place error names."""
        _, _, dtype, shape, _, _ = self._entries[index]
        saved = self._versions[index]
        now = self._aliases[index]._version if self.retain else saved
        return list(shape), dtype, now, saved

    def entry(self, index: int) -> tuple[int, int, torch.dtype, list[int], list[int], int]:
        """``(slot, byte offset in its storage, dtype, shape, stride, lazy bits)`` of an entry."""
        slot, lo, dtype, shape, stride, lazy = self._entries[index]
        return slot, lo, dtype, list(shape), list(stride), lazy


Table = Union[EntryTable, Any]  # Any: offload._entries.EntryTable


def new_entry_table(retain: bool, alignment: int) -> Table:
    """A fresh table: the native one when ``offload._entries`` is live, else the reference."""
    ext = native.entries_extension()
    if ext is not None:
        return ext.EntryTable(retain, alignment)
    return EntryTable(retain, alignment)
