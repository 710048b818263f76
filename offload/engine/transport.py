"""Moving a group's bytes: streams, events and the one copy path per direction.

D2H: one batched submission per group, each storage slot copied into its offset of the group's
host region. H2D: ONE copy of the whole region into one GPU buffer. With the native extension a
group's copy is one call (``submit_copies``): the copy stream's waits, the driver's batched copy
and the event after it. Without it, torch streams, ``copy_`` per slot and ``torch.cuda.Event``.

Stream rules (why each wait is there):
- D2H waits on the compute stream: the tensors were produced there.
- D2H waits on the region's ``ready`` event: the region's previous H2D may still read it.
- Release (``wait_offloaded``): the compute stream waits on the D2H end before the originals are
  dropped. The caching allocator reuses freed blocks in stream order on the stream that allocated
  them (the compute stream); after this wait no later kernel there can overwrite memory the D2H
  stream is still reading. This replaces ``record_stream``, which would delay the reuse until the
  allocator next polls events and hold memory unpredictably long.
- H2D waits on the compute stream: the reload buffer is allocated on the compute stream, and the
  block the allocator hands out may still be in use by compute kernels queued before.
- Unpack (``wait_reloaded``): the compute stream waits on the H2D end before it reads a view.
The current stream is looked up at each use (a raw handle, 0.2 us), never cached: a caller may
switch streams between layers, and autograd runs backward on the forward's streams.

Host cost. Everything here runs once per group, not per tensor. Events come from the extension's
pool (recording a pooled event is a queue write; creating one is a driver allocation), and the
wait on the producer is one pooled event recorded and waited on, where ``Stream.wait_stream``
would create a new event each time. Timing events are only recorded for timed copies
(``timing``): ``True`` times every copy, ``False`` none, ``None`` (the default) the copies of at
least ``AUTO_TIMING_MIN_BYTES``, whose 80 us or more of transfer dwarf the ~2 us the two timing
events cost on the host. Untimed copies still count their bytes; the stats' rates are computed
over the timed ones, and stalls are only measured on timed groups (on the others the compute
stream simply waits, which costs the same as asking whether it has to).

Under CUDA-graph capture (``group.captured`` / ``captured``) the same calls are recorded into the
graph, with three differences. No timing events and no ``query``: a captured event never runs, so
it can be neither timed nor asked whether it finished (querying one during capture is an error).
Every wait is issued: a wait skipped because the copy "already finished" at capture time would be
missing from every replay. And waits on events recorded outside this capture (a region's
``ready``, a graphed layer's D2H seen from its backward graph) are not issued: CUDA refuses
dependencies that cross a capture's boundary, and that work is ordered already (capture starts
after a device synchronisation, and graphs replay in capture order).

``HostTransport`` does the same copies synchronously on host memory, so everything above the
transport runs (and is tested) on CPU-only torch with real copies.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Union

import torch

from ..host import native
from ..host.arena import Region
from .group import Group
from .stats import StepCounters

# Copies of at least this many bytes are timed when ``timing`` is None (automatic).
AUTO_TIMING_MIN_BYTES = 4 << 20
# A group kept on the GPU while its host block is being pinned (``can_keep``) must leave room for
# what the step still allocates besides the groups (later layers, the head, backward's gradients
# and workspaces): this fraction of the device's memory stays free.
KEEP_HEADROOM_FRACTION = 0.10


def slot_copy_lists(group: Group, region: Region) -> tuple[list[int], list[int], list[int]]:
    """The one offload layout, as pointers: ``(dsts, srcs, sizes)``, one entry per storage slot
    of ``group``, each slot's span to its planned offset in ``region``."""
    return group.table.copy_lists(region.block.data_ptr())


def copy_slots_torch(group: Group, region: Region, *, device: torch.device, non_blocking: bool) -> None:
    """The offload copy without the extension: one ``copy_`` per storage slot, on the current
    stream."""
    table = group.table
    offsets, _, sizes = table.copy_lists(0)  # the slots' offsets in the region, and their sizes
    for view, off, n in zip(table.slot_byte_views(device), offsets, sizes):
        region.block.narrow(0, off, n).copy_(view, non_blocking=non_blocking)


class WallMark:
    """A host-clock stand-in for a CUDA timing event (the host transport copies synchronously)."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        """Nothing to wait for: the copy it marks is already done."""

    def elapsed_time(self, end: "WallMark") -> float:
        """Milliseconds from this mark to ``end``, like ``torch.cuda.Event.elapsed_time``."""
        return (end.t - self.t) * 1e3


class HostTransport:
    """Synchronous host-memory copies (``device="cpu"``)."""

    name = "cpu"
    pinned = False

    def __init__(self, *, use_native: bool, timing: Optional[bool] = None) -> None:
        self.device = torch.device("cpu")
        self.device_index = -1
        self.use_native = use_native
        self._ext = native.extension() if use_native else None
        # Host copies are timed with the host clock, which costs nothing measurable.
        self.timing = timing is not False

    def capturing(self) -> bool:
        """Host copies are never captured."""
        return False

    def join(self, *, d2h: bool, h2d: bool) -> None:
        """Nothing to join: the host transport has no side streams."""

    def offload(self, group: Group, region: Region, counters: StepCounters) -> Any:
        """Copy the group's slots into ``region``; returns the copy's end event (None here)."""
        start = WallMark() if self.timing else None
        if self._ext is not None:
            dsts, srcs, sizes = slot_copy_lists(group, region)
            self._ext.copy_batch(dsts, srcs, sizes, None, False)
        else:
            copy_slots_torch(group, region, device=self.device, non_blocking=False)
        if start is not None:
            counters.copies.append(("d2h", group.copy_bytes, start, WallMark()))
        return None

    def wait_offloaded(self, group: Group, counters: StepCounters) -> None:
        """Order reuse of the originals' memory after the D2H (synchronous here: nothing)."""

    def offload_finished(self, group: Group) -> bool:
        """Whether the group's D2H is done (always: host copies are synchronous)."""
        return True

    def reload(self, group: Group, counters: StepCounters, into: Optional[torch.Tensor] = None, *, wait_d2h: bool = True) -> tuple[torch.Tensor, Any]:
        """Copy the group's region into a fresh (or the given) buffer; returns (buffer, event)."""
        buffer = into if into is not None else torch.empty(group.nbytes, dtype=torch.uint8)
        start = WallMark() if self.timing else None
        buffer[: group.nbytes].copy_(group.host.block[: group.nbytes])
        if start is not None:
            counters.copies.append(("h2d", group.nbytes, start, WallMark()))
        return buffer, None

    def wait_reloaded(self, group: Group, counters: StepCounters) -> None:
        """Order reads of the reload buffer after the H2D (synchronous here: nothing)."""

    def last_host_use(self, group: Group) -> Any:
        """The event after which the group's host region may be overwritten."""
        return None


class CudaTransport:
    """Side-stream copies between a CUDA device and pinned host memory."""

    name = "cuda"
    pinned = True

    def __init__(
        self,
        device: torch.device,
        *,
        use_native: bool,
        d2h_stream: Optional[torch.cuda.Stream] = None,
        timing: Optional[bool] = None,
    ) -> None:
        self.device = device
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        self.use_native = use_native
        self.timing = timing
        # PCIe is full duplex: separate streams let reloads of one step overlap offloads.
        self.d2h_stream = d2h_stream if d2h_stream is not None else torch.cuda.Stream(device)
        self.h2d_stream = torch.cuda.Stream(device)
        self._ext = native.extension() if use_native else None
        self._raw_current: Callable[[int], int] = torch._C._cuda_getCurrentRawStream
        # The capture query itself, without torch.cuda's Python wrapper: asked at every layer
        # entry and every reload.
        self._is_capturing: Callable[[], bool] = torch._C._cuda_isCurrentStreamCapturing
        # Streams as the event calls want them: raw handles for the extension, objects for torch.
        native_streams = self._ext is not None
        self._d2h = self.d2h_stream.cuda_stream if native_streams else self.d2h_stream
        self._h2d = self.h2d_stream.cuda_stream if native_streams else self.h2d_stream

    # -- stream and event primitives (extension, or torch without it) ------------------------------
    def _current(self) -> Any:
        if self._ext is not None:
            return self._raw_current(self.device_index)
        return torch.cuda.current_stream(self.device)

    def _record(self, stream: Any, timing: bool) -> Any:
        if self._ext is not None:
            return self._ext.record_event(stream, timing)
        event = torch.cuda.Event(enable_timing=timing)
        event.record(stream)
        return event

    def _wait_event(self, stream: Any, event: Any) -> None:
        if self._ext is not None:
            event.wait(stream)
        else:
            stream.wait_event(event)

    def _wait_stream(self, waiter: Any, producer: Any) -> None:
        if self._ext is not None:
            self._ext.stream_wait_stream(waiter, producer)
        else:
            waiter.wait_stream(producer)

    def _timed(self, nbytes: int, captured: bool) -> bool:
        if captured:
            return False  # a captured event never runs: it cannot be timed
        timing = self.timing
        return timing is True or (timing is None and nbytes >= AUTO_TIMING_MIN_BYTES)

    def _submit(
        self,
        copy_stream: Any,
        after: Optional[Any],
        timed: bool,
        lists: Optional[tuple[list[int], list[int], list[int]]],
        torch_copy: Optional[Callable[[], None]],
    ) -> tuple[Any, Any]:
        """One group's copy on ``copy_stream``, after the current stream and ``after``:
        returns (start event or None, end event).

        The copy is ``lists`` (dsts, srcs, sizes) with the extension, else ``torch_copy()``; the
        caller builds only the one its path uses, instead of two closures per copy of which one
        was never called.
        """
        current = self._current()
        if lists is not None:
            dsts, srcs, sizes = lists
            return self._ext.submit_copies(dsts, srcs, sizes, copy_stream, current, after, timed)  # type: ignore[union-attr]
        self._wait_stream(copy_stream, current)
        if after is not None:
            copy_stream.wait_event(after)
        start = self._record(copy_stream, True) if timed else None
        with torch.cuda.stream(copy_stream):
            torch_copy()
        return start, self._record(copy_stream, timed)

    def _wait(self, event: Any, counters: StepCounters, timed: bool) -> None:
        current = self._current()
        if not timed:
            self._wait_event(current, event)
            return
        # A copy that already finished needs no wait (query is a non-blocking host call); else
        # events around the wait on the compute stream measure how long it stalled.
        if event.query():
            return
        before = self._record(current, True)
        self._wait_event(current, event)
        counters.waits.append((before, self._record(current, True)))

    # -- the transport interface ---------------------------------------------------------------------
    def capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph (one cheap runtime query)."""
        return self._is_capturing()

    def join(self, *, d2h: bool, h2d: bool) -> None:
        """Make the current stream wait for everything queued on the side streams so far.

        A capture must end with every stream it forked joined back; a captured step calls this
        for the streams it used, so a copy nobody waited on cannot leave the capture unjoined.
        """
        current = self._current()
        if d2h:
            self._wait_stream(current, self._d2h)
        if h2d:
            self._wait_stream(current, self._h2d)

    def offload(self, group: Group, region: Region, counters: StepCounters) -> Any:
        """Submit the group's D2H into ``region`` on the D2H stream; returns its end event."""
        captured = group.captured
        timed = self._timed(group.copy_bytes, captured)
        after = None if captured else region.ready
        if self._ext is not None:
            start, done = self._submit(self._d2h, after, timed, slot_copy_lists(group, region), None)
        else:
            start, done = self._submit(
                self._d2h, after, timed, None,
                lambda: copy_slots_torch(group, region, device=self.device, non_blocking=True),
            )
        if timed:
            counters.copies.append(("d2h", group.copy_bytes, start, done))
        return done

    def wait_offloaded(self, group: Group, counters: StepCounters) -> None:
        """Make the compute stream wait for the group's D2H before its originals are dropped."""
        timed = self._timed(group.copy_bytes, group.captured)
        if not timed and self._ext is not None:
            # The untimed wait with the extension written out (_wait, _current and _wait_event
            # in one): once per group, where those Python calls cost more than the driver call.
            group.d2h_done.wait(self._raw_current(self.device_index))
            return
        self._wait(group.d2h_done, counters, timed)

    def offload_finished(self, group: Group) -> bool:
        """Whether the group's D2H has completed (a non-blocking query; never under capture,
        where nothing has run yet and querying is an error)."""
        return not group.captured and group.d2h_done.query()

    def reload(self, group: Group, counters: StepCounters, into: Optional[torch.Tensor] = None, *, wait_d2h: bool = True) -> tuple[torch.Tensor, Any]:
        """Submit ONE H2D of the group's region into a buffer from the compute stream's pool.

        Under capture the buffer comes from the graph's private pool (the allocator routes
        allocations on a capturing stream there), so replays find it at the same address.
        ``wait_d2h=False``: the D2H was recorded in another graph (see the module notes).
        """
        nbytes = group.nbytes
        buffer = into if into is not None else torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        src = group.host.block
        timed = self._timed(nbytes, group.reload_captured)
        after = group.d2h_done if wait_d2h else None
        if self._ext is not None:
            start, done = self._submit(
                self._h2d, after, timed, ([buffer.data_ptr()], [src.data_ptr()], [nbytes]), None
            )
        else:
            start, done = self._submit(
                self._h2d, after, timed, None, lambda: buffer[:nbytes].copy_(src[:nbytes], non_blocking=True)
            )
        if timed:
            counters.copies.append(("h2d", nbytes, start, done))
        return buffer, done

    def wait_reloaded(self, group: Group, counters: StepCounters) -> None:
        """Make the compute stream wait for the group's H2D before it reads the buffer."""
        timed = self._timed(group.nbytes, group.reload_captured)
        if not timed and self._ext is not None:
            group.h2d_done.wait(self._raw_current(self.device_index))  # as in wait_offloaded
            return
        self._wait(group.h2d_done, counters, timed)

    def last_host_use(self, group: Group) -> Any:
        """The event after which the group's host region may be overwritten."""
        return group.h2d_done if group.h2d_done is not None else group.d2h_done

    def can_keep(self, nbytes: int) -> bool:
        """Whether the device can keep ``nbytes`` more (a group whose host block is still being
        pinned) and still have ``KEEP_HEADROOM_FRACTION`` of its memory free.

        Free as :func:`device_room_bytes` counts it; asked only on a pinning miss.
        """
        free, total = device_room_bytes(self.device)
        return free - nbytes >= KEEP_HEADROOM_FRACTION * total


def device_room_bytes(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device, free counting what the driver has free plus what
    torch's caching allocator holds unused. Two driver queries (microseconds): never per tensor."""
    free, total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device), total

# The engine's transport: copies between CUDA streams, or host copies on CPU-only machines.
Transport = Union[CudaTransport, HostTransport]
