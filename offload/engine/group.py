"""One layer's saved tensors: dedup by storage, view→base, byte layout, typed-view restore.

A group is pure bookkeeping; it never copies. The transport copies each *storage slot* (the span
of one storage that the group's views touch) into the group's region at the offsets planned here,
and after reload every saved tensor comes back as a view of one buffer::

    buffer(uint8) -> .view(dtype) -> .as_strided(shape, stride, element offset)

so each component keeps its own dtype (float32 scales stay float32, uint8 stays uint8).

Lazy conjugate and negative views (``t.conj()`` of a complex tensor, ``torch._neg_view``) share
their base's bytes and carry the operation as a bit on the tensor; the bytes copied are the
unconjugated ones. The bits are recorded per entry and put back on the restored view, so the
values autograd reads are the saved ones, exactly.

Alignment: a slot's span starts at its lowest byte rounded *down* to 256, and slots sit at 256-byte
aligned offsets, so a restored view has the same address modulo 256 as the original. Anything
that was aligned for an FP8 GEMM (cuBLASLt wants 16 bytes) stays aligned, and the element offset
of every view is an integer, because each view's byte offset is a multiple of its item size.

States (transitions are checked; a wrong one is a bug in a schedule, and says so)::

    OPEN --close--> RESIDENT --offload--> OFFLOADING --release--> OFFLOADED <--drop-- RELOADED
                       |                                             |                  ^
                       +--keep (budget)--> KEPT                      +-----reload-------+
"""

from __future__ import annotations

import enum
import operator
from typing import Any, Optional

import torch

from ..host import native
from ..host.layout import ALIGNMENT


class GroupState(enum.Enum):
    OPEN = "open"              # tensors are still being saved into it
    RESIDENT = "resident"      # closed; originals on the GPU, no copy started
    KEPT = "kept"              # closed; will stay on the GPU (no host region could be had)
    OFFLOADING = "offloading"  # D2H submitted; originals still referenced
    OFFLOADED = "offloaded"    # originals dropped; the data lives in the host region only
    RELOADED = "reloaded"      # a GPU buffer holds the data again


# The states in which the original GPU tensors are still held and can be handed back as they are.
# Tuples, not sets, for every state test: ``in`` on a tuple compares by identity first, while a
# set hashes the member, and Enum's ``__hash__`` is Python code (0.5 us a test on the hot path).
HOLDS_ORIGINALS = (GroupState.OPEN, GroupState.RESIDENT, GroupState.KEPT, GroupState.OFFLOADING)

_FROM_OPEN = (GroupState.OPEN,)
_FROM_RESIDENT = (GroupState.RESIDENT,)
_FROM_OFFLOADING = (GroupState.OFFLOADING,)
_FROM_OFFLOADED = (GroupState.OFFLOADED,)
_FROM_RELOADED = (GroupState.RELOADED,)

_ALIGN_MASK = ~(ALIGNMENT - 1)


CONJ_BIT = 1
NEG_BIT = 2



def modified_error(shape: Any, dtype: torch.dtype, layer: int, now: int, saved: int) -> RuntimeError:
    """Autograd's error for a saved tensor changed in place, naming what the engine knows."""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: a tensor of shape {list(shape)} and dtype {dtype} saved for backward in "
        f"offloaded layer {layer} is at version {now}; expected version {saved} instead. "
        "(offload checks this in place of autograd, which skips its check for tensors saved "
        "through saved-tensor hooks.) Hint: change a copy (.clone()) or use the out-of-place "
        "operation instead."
    )


def _with_lazy_bits(view: torch.Tensor, lazy: int) -> torch.Tensor:
    # The bytes are the base's; the bits say how the saved tensor reads them.
    if lazy & CONJ_BIT:
        view = torch.conj(view)
    if lazy & NEG_BIT:
        view = torch._neg_view(view)
    return view


_make_alias = torch.Tensor._make_subclass
_set_versions = torch._C._autograd._unsafe_set_version_counter
_version_of = operator.attrgetter("_version")


def own_alias(t: torch.Tensor) -> torch.Tensor:
    """An alias of ``t`` that the group owns: same storage and version counter, no autograd
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
    they were, in one call (about 0.5 us a tensor in all on our CPU box).
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


class Group:
    """The saved tensors of one layer in one step, with their layout and restore recipe."""

    # Slots: a group is created per layer per step, and its attributes are read on every pack
    # and unpack.
    __slots__ = (
        "layer", "step", "retain", "state", "_slot_of_ptr", "slot_storages", "slot_lo", "slot_hi",
        "entries", "originals", "versions", "sentinels", "saved_bytes",
        "min_offload_bytes", "sizes", "slot_offsets", "nbytes", "copy_bytes",
        "entry_element_offsets", "host", "d2h_done", "gpu", "h2d_done", "h2d_waited", "typed",
        "unpacks_since_reload", "unpacks", "consumed", "counters", "on_free", "local", "captured",
        "reload_captured", "__weakref__",
    )

    def __init__(self, layer: int, step: int, *, retain: bool = True) -> None:
        self.layer = layer
        self.step = step
        # retain=False: a group that only measures (the planner's probe): it lays slots out
        # like any group but keeps no reference to the tensors or storages, so a plain step's
        # memory is freed as usual. Its slots are only ever sized, never copied.
        self.retain = retain
        self.state = GroupState.OPEN
        # Storage slots, indexed by slot number. A storage is identified by its data pointer: the
        # group holds a reference to it while the pointer is used as a key, so no other live
        # storage can have the same address.
        self._slot_of_ptr: dict[int, int] = {}
        self.slot_storages: list[Any] = []
        self.slot_lo: list[int] = []
        self.slot_hi: list[int] = []
        # Entries: (slot, byte offset in its storage, dtype, shape, stride, lazy bits), one per
        # saved tensor; lazy bits: CONJ_BIT | NEG_BIT as the tensor carried them.
        self.entries: list[tuple[int, int, torch.dtype, torch.Size, tuple[int, ...], int]] = []
        # What the group holds until release: an alias of each saved tensor (``own_alias``),
        # detached like ``detach()`` when it requires grad.
        # Autograd hands the pack hook a node's *output* with its grad_fn (that very node), and
        # the node holds what pack returned: holding the output itself would close a cycle
        # group -> tensor -> grad_fn -> saved handle -> group that only the cyclic GC (which
        # cannot see the C++ edges) could ever break, so a step abandoned before backward
        # would keep its activations and host regions. The alias shares storage and version
        # counter; autograd re-attaches the grad_fn when it unpacks.
        self.originals: Optional[list[torch.Tensor]] = []
        # Version counter of each saved tensor at pack: autograd skips its own in-place check for
        # tensors saved through hooks, so the engine does it (see ``check_version``).
        self.versions: list[int] = []
        # From release on, the originals emptied in place (``empty_keeping_versions``): they
        # share the saved tensors' version counters and hold no memory, so an in-place change
        # made after release, through any alias the caller still holds, is still seen at unpack.
        self.sentinels: Optional[list[torch.Tensor]] = None
        self.saved_bytes = 0
        self.min_offload_bytes: Optional[int] = None  # a plan's size floor for this layer
        # Filled by close().
        self.sizes: list[int] = []      # byte size of each slot's span
        self.slot_offsets: list[int] = []
        self.nbytes = 0                 # the region's size (layout total, alignment included)
        self.copy_bytes = 0             # bytes each direction's copy moves (the spans, no padding)
        self.entry_element_offsets: list[int] = []
        # Filled by the transport / engine.
        self.host: Any = None           # arena region holding the group's bytes
        self.d2h_done: Any = None       # event: the D2H copy finished
        self.gpu: Optional[torch.Tensor] = None  # reload buffer (uint8)
        self.h2d_done: Any = None       # event: the H2D copy finished
        self.h2d_waited = False         # has the compute stream waited on h2d_done?
        self.typed: dict[torch.dtype, torch.Tensor] = {}
        self.unpacks_since_reload = 0
        self.unpacks = 0                # all unpacks, in any state
        self.consumed = False           # every entry handed back at least once
        self.counters: Any = None       # the StepCounters of the group's step
        self.on_free: Any = None        # called once when the group is garbage (returns the region)
        # CUDA graphs. A *local* group belongs to one graphed layer (offload.graphs): it is
        # offloaded and released inside the layer's forward graph and reloaded inside its
        # backward graph, outside any step. ``captured`` / ``reload_captured``: its D2H / its
        # H2D were recorded into a graph (they then run on each replay, not now).
        self.local = False
        self.captured = False
        self.reload_captured = False

    # -- building --------------------------------------------------------------------------------
    def add(self, t: torch.Tensor) -> int:
        """Record ``t`` and return its entry index. Views of one storage share one slot."""
        # Runs once per saved tensor: the contiguous case of ``storage_extent_bytes`` is
        # written out (a Python call saved on the common case).
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        itemsize = t.element_size()
        lo = t.storage_offset() * itemsize
        hi = lo + (t.numel() * itemsize if t.is_contiguous() else storage_extent_bytes(t))
        aligned_lo = lo & _ALIGN_MASK
        slot_lo = self.slot_lo
        slot = self._slot_of_ptr.get(ptr)
        if slot is None:
            slot = len(slot_lo)
            self._slot_of_ptr[ptr] = slot
            self.slot_storages.append(storage if self.retain else None)
            slot_lo.append(aligned_lo)
            self.slot_hi.append(hi)
        else:
            if aligned_lo < slot_lo[slot]:
                slot_lo[slot] = aligned_lo
            if hi > self.slot_hi[slot]:
                self.slot_hi[slot] = hi
        entries = self.entries
        index = len(entries)
        entries.append((slot, lo, t.dtype, t.shape, t.stride(), t.is_conj() | (t.is_neg() << 1)))
        self.versions.append(t._version)
        if self.retain:
            self.originals.append(own_alias(t))  # type: ignore[union-attr]
        return index

    def slot_sizes(self) -> list[int]:
        """Byte size of each storage slot's span."""
        return [hi - lo for lo, hi in zip(self.slot_lo, self.slot_hi)]

    def close(self) -> None:
        """Freeze the group and lay its slots out in one region (the one layout function)."""
        self._move(_FROM_OPEN, GroupState.RESIDENT)
        slot_lo = self.slot_lo
        sizes = self.slot_sizes()
        offsets, total = native.plan_layout(sizes)
        self.sizes = sizes
        self.copy_bytes = sum(sizes)
        self.slot_offsets = offsets
        self.nbytes = total
        self.entry_element_offsets = [
            (offsets[slot] + byte_offset - slot_lo[slot]) // dtype.itemsize
            for slot, byte_offset, dtype, _, _, _ in self.entries
        ]
        self._slot_of_ptr.clear()

    # -- state transitions -----------------------------------------------------------------------
    def _move(self, allowed: tuple[GroupState, ...], new: GroupState) -> None:
        if self.state not in allowed:
            names = ", ".join(sorted(s.value for s in allowed))
            raise RuntimeError(
                f"offload: layer {self.layer} group cannot go from {self.state.value} to {new.value} "
                f"(expected one of: {names}); this is a bug in the offload schedule, please report it"
            )
        self.state = new

    def mark_kept(self) -> None:
        """No host region could be had: the group stays on the GPU, nothing is lost."""
        self._move(_FROM_RESIDENT, GroupState.KEPT)

    def mark_offloading(self, host: Any, d2h_done: Any) -> None:
        """The D2H copy of the group into ``host`` was submitted; ``d2h_done`` marks its end."""
        self._move(_FROM_RESIDENT, GroupState.OFFLOADING)
        self.host = host
        self.d2h_done = d2h_done

    def mark_released(self) -> None:
        """Drop the GPU originals (the caller has ordered their reuse after the D2H).

        The group's aliases of the originals are emptied in place and kept as version sentinels,
        so that an in-place change made before or after this point is still refused at unpack,
        where autograd would refuse it.
        """
        self._move(_FROM_OFFLOADING, GroupState.OFFLOADED)
        empty_keeping_versions(self.originals)  # type: ignore[arg-type]
        self.sentinels, self.originals = self.originals, None
        self.slot_storages = []

    def mark_reloaded(self, gpu: torch.Tensor, h2d_done: Any) -> None:
        """``gpu`` holds the group's bytes once ``h2d_done`` has completed."""
        self._move(_FROM_OFFLOADED, GroupState.RELOADED)
        self.gpu = gpu
        self.h2d_done = h2d_done
        self.h2d_waited = False
        self.typed = {}
        self.unpacks_since_reload = 0

    def mark_dropped(self) -> None:
        """Forget the reload buffer (its views may live on; the allocator frees it after them)."""
        self._move(_FROM_RELOADED, GroupState.OFFLOADED)
        self.gpu = None
        self.typed = {}

    @property
    def holds_gpu_memory(self) -> bool:
        """Whether the group's data occupies GPU memory that backward has not finished with."""
        if self.state is GroupState.RELOADED:
            return True
        return self.state in HOLDS_ORIGINALS and not self.consumed

    # -- restore ---------------------------------------------------------------------------------
    def original(self, index: int) -> torch.Tensor:
        """The tensor as it was saved (only while the group still holds the originals)."""
        return self.originals[index]  # type: ignore[index]

    def check_version(self, index: int, tensor: torch.Tensor) -> None:
        """Raise autograd's in-place error if entry ``index`` changed since it was saved.

        ``tensor``: one that shares the saved tensor's version counter (the original the group
        holds, or its sentinel after release).
        """
        saved = self.versions[index]
        now = tensor._version
        if now != saved:
            _, _, dtype, shape, _, _ = self.entries[index]
            raise modified_error(shape, dtype, self.layer, now, saved)

    def restore(self, index: int) -> torch.Tensor:
        """Entry ``index`` as a typed view of the reload buffer, with its dtype, shape and stride."""
        _, _, dtype, shape, stride, lazy = self.entries[index]
        typed = self.typed.get(dtype)
        if typed is None:
            typed = self.gpu.view(dtype)  # type: ignore[union-attr]
            self.typed[dtype] = typed
        view = typed.as_strided(shape, stride, self.entry_element_offsets[index])
        if lazy:
            view = _with_lazy_bits(view, lazy)
        return view

    def __del__(self) -> None:
        # Returning the host region must happen exactly once, when the last saved-tensor handle
        # (autograd's reference) and the engine's step list have let go of the group.
        on_free = self.on_free
        if on_free is not None:
            self.on_free = None
            on_free(self)
