"""The engine's copy primitives: what a schedule calls to move a closed group to the host and back.

Separate because this is the interface between the engine and its schedules: a schedule decides
*when* (``offload.engine.schedules``), these methods do the work, through the transport (the copies)
and the arena (the host regions). A group goes

    RESIDENT --start_offload--> OFFLOADING --release--> OFFLOADED --start_reload--> RELOADED

(KEPT instead when no host region can be had; back to OFFLOADED once unpack has handed every
entry back), and each primitive does nothing to a group in any other state, so a schedule may
call it without checking first. When a group is freed (autograd
let go of its handles), its host region goes back to the arena here.

Captured steps (a CUDA graph records the copies): a copy must be made the way its group was
(captured or eager), and a capture that fails here joins the side streams it forked first, so
that the capture can end and the error raised is the one the caller sees.
"""

from __future__ import annotations

from time import perf_counter
from typing import TYPE_CHECKING, Optional

import torch
from torch.autograd.profiler import record_function

from ..host.arena import CaptureError, HostArena
from .group import Group, GroupState
from .policy import KEEP_BUDGET, KEEP_PINNING

if TYPE_CHECKING:
    from .schedules.base import Schedule
    from .stats import StepCounters
    from .forward import ForwardState
    from .step import InFlight, StepState
    from .transport import Transport

# One C call (~50 ns): the profiler ranges below cost nothing while no profiler runs.
_profiling = torch._C._autograd._profiler_enabled


class CopyMixin:
    """The copy primitives of :class:`offload.engine.OffloadEngine`, called by its schedule."""

    # The engine's state used here (set up by OffloadEngine.__init__).
    schedule: Schedule
    transport: Transport
    arena: HostArena
    layer_contexts: bool
    forward: ForwardState
    in_flight: InFlight

    def start_offload(self, group: Group) -> None:
        """Copy a closed group to a host region (or keep it on the GPU if none can be had)."""
        if group.state is not GroupState.RESIDENT:
            return
        if _profiling():
            with record_function("offload::offload"):
                return self._start_offload(group)
        return self._start_offload(group)

    def _start_offload(self, group: Group) -> None:
        counters = group.counters
        kept_while_pinning = self.arena.counters.kept_while_pinning
        started = perf_counter()
        try:
            region = self.arena.acquire(
                group.nbytes, group.step, captured=group.captured,
                expected_more=None if group.local else lambda: self.schedule.groups_after(group),
            )
        except CaptureError:
            # Join what this capture forked so that it can end and this error is the one seen.
            self._join_side_streams(counters)
            raise
        # Microseconds when an idle block serves it; a block pinned on the spot, or one waited
        # for, is what a first step pays for pinning (offload.planner.first_steps reads it).
        self.arena.counters.acquire_s += perf_counter() - started
        if region is None:
            group.mark_kept()
            counters.groups_kept += 1
            pinning = self.arena.counters.kept_while_pinning != kept_while_pinning
            counters.keep(KEEP_PINNING if pinning else KEEP_BUDGET, len(group.table))
            return
        group.mark_offloading(region, self.transport.offload(group, region, counters))
        counters.groups_offloaded += 1
        counters.offloaded_tensors += len(group.table)
        counters.offloaded_bytes += group.copy_bytes
        counters.bytes_d2h += group.copy_bytes

    def release(self, group: Group) -> None:
        """Drop the GPU originals of an offloading group once its D2H is ordered before reuse."""
        if group.state is not GroupState.OFFLOADING:
            return
        if _profiling():
            with record_function("offload::release_wait"):
                self.transport.wait_offloaded(group, group.counters)
        else:
            self.transport.wait_offloaded(group, group.counters)
        group.mark_released()
        group.counters.released_bytes += group.copy_bytes

    def start_reload(self, group: Group, into: Optional[torch.Tensor] = None) -> None:
        """Start the one H2D copy of an offloaded group (into a fresh or the given buffer)."""
        if group.state is not GroupState.OFFLOADED:
            return
        if _profiling():
            with record_function("offload::reload"):
                return self._start_reload(group, into)
        return self._start_reload(group, into)

    def _start_reload(self, group: Group, into: Optional[torch.Tensor]) -> None:
        captured = self.transport.capturing()
        if captured != group.captured:
            raise CaptureError(
                f"offload: the saved tensors of layer {group.layer} were offloaded "
                f"{'under CUDA-graph capture' if group.captured else 'eagerly'} but are needed "
                f"{'under capture' if captured else 'eagerly'}; the forward and backward that "
                "use offloading must be captured together (one graph for the step), or graphed "
                "per layer with offload.graphs.make_graphed_callables"
            )
        group.reload_captured = captured
        # A graphed layer's D2H is in its forward graph, its H2D in the backward graph: the
        # H2D cannot wait on an event of another graph (replay order covers it instead).
        wait_d2h = not (captured and group.local)
        buffer, done = self.transport.reload(group, group.counters, into, wait_d2h=wait_d2h)
        group.mark_reloaded(buffer, done)
        group.counters.bytes_h2d += group.nbytes
        group.counters.reloads += 1

    def _join_side_streams(self, counters: StepCounters) -> None:
        # Join the copy streams a captured step (or graphed layer) forked back into the capture
        # stream: a capture cannot end while a stream it forked is still apart.
        self.transport.join(d2h=counters.groups_offloaded > 0, h2d=counters.reloads > 0)

    def _group_freed(self, group: Group) -> None:
        # From Group.__del__: the host region goes back with the event of its last copy, so the
        # next writer waits for it on the GPU instead of the host waiting now.
        if group.state is GroupState.RELOADED and not group.h2d_waited and not group.captured:
            # A reloaded group that dies unread (its graph dropped after a prefetch or a manual
            # reload, a backward that raised): its reload buffer goes back to the allocator right
            # after this, for reuse in the order of the stream that allocated it (the compute
            # stream, current here too), while the H2D may still be writing into it. That stream
            # waits for the copy first. (A group dying with its D2H in flight needs no such wait:
            # the copy only reads the originals, into a region whose next writer waits for that
            # copy anyway.)
            self.transport.wait_reloaded(group, group.counters)
        if group.host is not None:
            self.arena.release(group.host, self.transport.last_host_use(group))
            group.host = None
        step = self.forward.step
        if step is None or group.step != step.index:
            earlier = self.in_flight.get(group.step)
            if earlier is not None and len(group.table) and not group.consumed:
                earlier.unconsumed -= 1  # settled (finished) at the next step's start
            return
        if len(group.table) and not group.consumed and group.state is not GroupState.OPEN:
            step.unconsumed -= 1  # dropped with its graph before backward handed it all back
        if self.layer_contexts and len(group.table) and not step.forward_done:
            # (OffloadActivations knows where each forward starts.)
            step.abandoned = True

    def reserve(self, nbytes: int, *, background: bool = False) -> int:
        """Pin host blocks for ``nbytes`` of offloaded groups ahead of need; returns the bytes.

        The blocks take the sizes the latest step's groups asked for (repeated) when a step has
        run, else ``nbytes`` is cut into one equal block per offloaded layer (an arena block
        serves groups of 44% to all of its size, ``REUSE_SLACK``). ``background=True`` queues them on the
        arena's pinner thread and returns at once. Over the host budget: ``ValueError`` naming
        it, and nothing is pinned.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise TypeError(f"offload: reserve(nbytes) takes an integer number of bytes, got {type(nbytes).__name__}")
        if nbytes < 0:
            raise ValueError(f"offload: reserve(nbytes) takes a number of bytes >= 0, got {nbytes}")
        if nbytes == 0:
            return 0
        sizes = self.arena.sizes_for(nbytes, blocks_if_unknown=self.schedule.num_layers)
        return self.arena.preallocate(sizes, background=background)
