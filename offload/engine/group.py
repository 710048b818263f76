"""One layer's saved tensors in one step: the group's states, its region's layout and its copies'
bookkeeping.

A group is pure bookkeeping; it never copies. Its per-tensor part (storage slots, entries,
aliases, version sentinels, typed-view restore) is its entry table
(``offload.engine.entry_table``: native where built, else the Python reference); the group adds
what is per group: its state, the region's layout (one ``plan_layout`` over the slot spans), the
host region and the copies' events. The transport copies each *storage slot* (the span of one
storage that the group's views touch) into the region at the offsets planned here, and after
reload every saved tensor comes back as a view of one buffer, each with its own dtype (float32
scales stay float32, uint8 stays uint8).

States (transitions are checked; a wrong one is a bug in a schedule, and says so)::

    OPEN --close--> RESIDENT --offload--> OFFLOADING --release--> OFFLOADED <--drop-- RELOADED
                       |                                             |                  ^
                       +--keep (budget)--> KEPT                      +-----reload-------+
"""

from __future__ import annotations

import enum
from typing import Any, Optional

import torch

from ..host import native
from ..host.layout import ALIGNMENT
from .entry_table import Table, new_entry_table


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


class Group:
    """The saved tensors of one layer in one step: state, layout and copies' bookkeeping, over
    the entry table that records the tensors themselves."""

    # Slots: a group is created per layer per step, and its attributes are read on every pack
    # and unpack.
    __slots__ = (
        "layer", "top", "step", "retain", "state", "table", "saved_bytes", "claim_credit", "min_offload_bytes",
        "nbytes", "copy_bytes", "host", "d2h_done", "gpu", "h2d_done", "h2d_waited", "unpacks_since_reload",
        "unpacks", "consumed", "counters", "on_free", "local", "captured", "reload_captured",
        "__weakref__",
    )

    def __init__(self, layer: int, step: int, *, retain: bool = True) -> None:
        self.layer = layer
        # The last layer whose tensors join this group: ``layer`` itself, unless the schedule
        # lets small layers share one group (``Schedule.joins_next``); the group is then found
        # under each of its layers, and copied once for all of them.
        self.top = layer
        self.step = step
        # retain=False: a group that only measures (the planner's probe): its table lays slots
        # out like any group's but keeps no reference to the tensors or storages, so a plain
        # step's memory is freed as usual. Its slots are only ever sized, never copied.
        self.retain = retain
        self.state = GroupState.OPEN
        # One entry per saved tensor (``len(group.table)``). The table holds an alias of each
        # (same storage and version counter, no autograd history), never the tensor autograd
        # handed the pack hook: that is a node's output with its grad_fn (that very node), and
        # the node holds what pack returned, so holding it would close a cycle group -> tensor
        # -> grad_fn -> saved handle -> group that only the cyclic GC (which cannot see the C++
        # edges) could break, and a step abandoned before backward would keep its activations
        # and host regions. Autograd re-attaches the grad_fn when it unpacks.
        self.table: Table = new_entry_table(retain, ALIGNMENT)
        self.saved_bytes = 0
        # Host bytes the native pack claimed ahead of this group's next tensors (one claim for
        # many small tensors: HostArena.claim_ahead), given back with the rest by take_claim.
        self.claim_credit = 0
        self.min_offload_bytes: Optional[int] = None  # a plan's size floor for this layer
        # Filled by close(); the slots' offsets and sizes are the table's (``copy_lists``).
        self.nbytes = 0                 # the region's size (layout total, alignment included)
        self.copy_bytes = 0             # bytes each direction's copy moves (the spans, no padding)
        # Filled by the transport / engine.
        self.host: Any = None           # arena region holding the group's bytes
        self.d2h_done: Any = None       # event: the D2H copy finished
        self.gpu: Optional[torch.Tensor] = None  # reload buffer (uint8)
        self.h2d_done: Any = None       # event: the H2D copy finished
        self.h2d_waited = False         # has the compute stream waited on h2d_done?
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
        return self.table.add(t)

    def slot_sizes(self) -> list[int]:
        """Byte size of each storage slot's span."""
        return self.table.slot_sizes()

    def take_claim(self) -> int:
        """The host bytes promised to this group at pack time (its tensors' and the credit claimed
        ahead of them), to give back to the arena once: the credit is zeroed."""
        claimed, self.claim_credit = self.saved_bytes + self.claim_credit, 0
        return claimed

    def close(self) -> None:
        """Freeze the group and lay its slots out in one region (the one layout function)."""
        self._move(_FROM_OPEN, GroupState.RESIDENT)
        sizes = self.table.slot_sizes()
        offsets, total = native.plan_layout(sizes)
        self.table.close(offsets)
        self.copy_bytes = sum(sizes)
        self.nbytes = total

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

        The table's aliases of the originals are emptied in place and kept as version sentinels,
        so that an in-place change made before or after this point is still refused at unpack,
        where autograd would refuse it.
        """
        self._move(_FROM_OFFLOADING, GroupState.OFFLOADED)
        self.table.release()

    def mark_reloaded(self, gpu: torch.Tensor, h2d_done: Any) -> None:
        """``gpu`` holds the group's bytes once ``h2d_done`` has completed."""
        self._move(_FROM_OFFLOADED, GroupState.RELOADED)
        self.gpu = gpu
        self.h2d_done = h2d_done
        self.h2d_waited = False
        self.unpacks_since_reload = 0

    def mark_dropped(self) -> None:
        """Forget the reload buffer (its views may live on; the allocator frees it after them)."""
        self._move(_FROM_RELOADED, GroupState.OFFLOADED)
        self.gpu = None
        self.table.drop_buffer()

    @property
    def holds_gpu_memory(self) -> bool:
        """Whether the group's data occupies GPU memory that backward has not finished with."""
        if self.state is GroupState.RELOADED:
            return True
        return self.state in HOLDS_ORIGINALS and not self.consumed

    # -- handing back ----------------------------------------------------------------------------
    def modified(self, index: int) -> RuntimeError:
        """Autograd's in-place error for entry ``index``, which its table found changed (its
        ``original`` or ``restore`` returned None; the unpack hook raises this)."""
        shape, dtype, now, saved = self.table.describe(index)
        return modified_error(shape, dtype, self.layer, now, saved)

    def __del__(self) -> None:
        # Returning the host region must happen exactly once, when the last saved-tensor handle
        # (autograd's reference) and the engine's step list have let go of the group.
        on_free = self.on_free
        if on_free is not None:
            self.on_free = None
            on_free(self)
