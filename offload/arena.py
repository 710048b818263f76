"""Pinned host arena: reusable host blocks for group regions, capped by a host-RAM budget.

Why an arena: ``torch.empty(pin_memory=True)`` costs 44 ms for 64 MB on our H100 host (it pins
pages with the driver), so pinning per tensor or per step would dominate the step. The arena pins a
block the first time a region of that size is needed and hands the same block out again in later
steps, so an unchanged model makes no pinned allocation after its first step, and the region
addresses stay stable (what a CUDA-graph replay needs).

A block's bytes may still be read by an H2D copy (or written by a D2H copy) of the step that used
it last. Instead of synchronising the host, a released block remembers the event of its last copy
and the next user's copy stream waits on it (``Region.ready``).

The budget caps the bytes the arena holds (in use + idle). Tensors are also counted against it at
pack time (``reserve``), so that a step that would overrun it keeps the excess tensors on the GPU
instead of failing later.

CUDA-graph capture: a captured copy names its host address once, and every replay copies to and
from that address again, with no Python running. So a region acquired under capture
(``acquire(..., captured=True)``) is *owned by the graph*: when its group is freed it is not put
back in the idle list (an eager step could otherwise overwrite what a replay reloads later); it
stays held, and counted, for the life of the arena. Under capture nothing is allocated (pinning
would synchronise the device, which capture forbids) and nothing is trimmed (that waits on events
on the host): a capture takes idle blocks left by an earlier eager step, or fails with an error
that says so.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass
from typing import Any, Optional

import psutil
import torch

from .layout import align_up

# Blocks are sized in whole 64 KiB pages, so regions of nearly equal size share blocks.
BLOCK_GRANULE = 64 * 1024
# A free block is reused for a request only if it is at most this much larger than the request,
# so one huge idle block doesn't get tied up by a small group.
REUSE_SLACK = 2.0


def default_host_budget_bytes() -> int:
    """Three quarters of the host RAM available now (psutil)."""
    return int(psutil.virtual_memory().available * 0.75)


class CaptureError(RuntimeError):
    """Offloading cannot proceed under the CUDA-graph capture in progress (the message says why)."""


@dataclass(eq=False)
class Region:
    """A host block lent to one group. ``ready`` is the event the next writer must wait on."""

    block: torch.Tensor
    ready: Any = None
    used_in_step: int = -1
    graph_owned: bool = False  # acquired under CUDA-graph capture: replays keep using it


@dataclass
class ArenaCounters:
    pinned_allocations: int = 0   # blocks allocated (pin_memory=True on CUDA) since creation
    bytes_held: int = 0           # bytes of all blocks, in use or idle
    bytes_in_use: int = 0
    failures: int = 0             # requests refused (budget or allocation failure)
    freed_blocks: int = 0
    graph_owned_blocks: int = 0   # blocks kept for captured CUDA graphs (never reused eagerly)


class HostArena:
    """Hands out host blocks for group regions and takes them back for reuse."""

    def __init__(self, *, pinned: bool, budget_bytes: Optional[int], retain: bool) -> None:
        self.pinned = pinned
        self.budget_bytes = default_host_budget_bytes() if budget_bytes is None else int(budget_bytes)
        if self.budget_bytes < 0:
            raise ValueError(f"host_budget_bytes must be >= 0, got {budget_bytes}")
        self.retain = retain
        self.counters = ArenaCounters()
        self.reserved = 0  # bytes promised at pack time to tensors of groups not yet laid out
        # Idle blocks sorted by size: parallel lists for bisect.
        self._free_sizes: list[int] = []
        self._free: list[Region] = []
        # Release happens from Group.__del__, which can run on autograd's device threads.
        self._lock = threading.Lock()
        self._graph_owned: list[Region] = []
        self._last_acquiring_step = -1  # the latest step that asked for a region

    # -- pack-time budget ------------------------------------------------------------------------
    def reserve(self, nbytes: int) -> bool:
        """Promise ``nbytes`` of host space to a tensor being packed; False if over budget."""
        if self.counters.bytes_in_use + self.reserved + nbytes > self.budget_bytes:
            return False
        self.reserved += nbytes
        return True

    def unreserve(self, nbytes: int) -> None:
        """Return a promise made by :meth:`reserve` (the group got its region, or gave up)."""
        self.reserved = max(0, self.reserved - nbytes)

    # -- regions ---------------------------------------------------------------------------------
    def has_idle_blocks(self) -> bool:
        """Whether a block is waiting to be reused (what a CUDA-graph capture needs)."""
        return bool(self._free)

    def acquire(self, nbytes: int, step: int, *, captured: bool = False) -> Optional[Region]:
        """A block of at least ``nbytes``, or None when the budget or the allocator says no.

        ``captured``: the caller is capturing a CUDA graph. Only an idle block can be handed out
        (raises ``CaptureError`` when none fits), and the graph owns it from now on.
        """
        size = align_up(max(nbytes, 1), BLOCK_GRANULE)
        with self._lock:
            self._last_acquiring_step = max(self._last_acquiring_step, step)
            i = bisect.bisect_left(self._free_sizes, size)
            # Under capture any idle block that fits will do: the slack rule only keeps big
            # blocks for big groups, and failing the capture would be worse.
            fits = i < len(self._free) and (captured or self._free_sizes[i] <= size * REUSE_SLACK)
            if fits:
                self._free_sizes.pop(i)
                region = self._free.pop(i)
                self.counters.bytes_in_use += region.block.numel()
                region.used_in_step = step
                region.graph_owned = captured
                self.counters.graph_owned_blocks += captured
                return region
            if captured:
                idle = ", ".join(str(n) for n in self._free_sizes) or "none"
                raise CaptureError(
                    f"offload: a pinned host region of {size} bytes is needed while a CUDA graph is "
                    f"being captured, and no idle block fits (idle block sizes: {idle}). Pinned "
                    "memory cannot be allocated under capture. Run one eager step (or warm-up "
                    "iteration) with offloading on right before capturing, with "
                    "retain_pinned_cpu_buffers=True so its blocks are kept for the capture."
                )
            # Make room from idle blocks, largest first, before giving up on the budget.
            while self._free and self.counters.bytes_held + size > self.budget_bytes:
                self._drop_free(len(self._free) - 1)
            if self.counters.bytes_held + size > self.budget_bytes:
                self.counters.failures += 1
                return None
        try:
            block = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
        except RuntimeError:
            with self._lock:
                self.counters.failures += 1
            return None
        with self._lock:
            self.counters.pinned_allocations += 1
            self.counters.bytes_held += size
            self.counters.bytes_in_use += size
        return Region(block=block, used_in_step=step)

    def release(self, region: Region, ready: Any) -> None:
        """Take ``region`` back; its next writer waits on ``ready`` (None: nothing in flight).

        A graph-owned region is kept aside instead: replays of its graph still use it.
        """
        size = region.block.numel()
        with self._lock:
            self.counters.bytes_in_use -= size
            if region.graph_owned:
                self._graph_owned.append(region)
                return
            region.ready = ready
            i = bisect.bisect_right(self._free_sizes, size)
            self._free_sizes.insert(i, size)
            self._free.insert(i, region)

    def end_step(self, finished_step: int) -> None:
        """Free idle blocks the finished step did not use, unless buffers are retained.

        Only a step that asked for regions says anything about the blocks needed: an evaluation
        forward (no_grad) saves nothing, and trimming after it would make the next training step
        allocate (and, on a GPU, pin) every block again.
        """
        if self.retain or self._last_acquiring_step != finished_step:
            return
        with self._lock:
            for i in range(len(self._free) - 1, -1, -1):
                if self._free[i].used_in_step < finished_step:
                    self._drop_free(i)

    def _drop_free(self, i: int) -> None:
        # Called with the lock held. A dropped block may still be the source of an H2D copy in
        # flight; the event tells when it is safe, and the copy engine's reference ends then.
        # Synchronising on that event here is acceptable: this runs only when shrinking.
        region = self._free.pop(i)
        self._free_sizes.pop(i)
        if region.ready is not None:
            region.ready.synchronize()
        self.counters.bytes_held -= region.block.numel()
        self.counters.freed_blocks += 1
