"""Moving a group's bytes: streams, events and the one copy path per direction.

D2H: one batched submission per group, each storage slot copied into its offset of the group's
host region (the native extension submits the whole batch in one call; the fallback loops over
``copy_``). H2D: ONE copy of the whole region into one GPU buffer.

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
The current stream is looked up at each use, never cached.

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

from typing import Any, Optional

import contextlib
import time

import torch

from . import native
from .arena import Region
from .group import Group
from .stats import StepCounters


def _byte_view(storage: Any, offset: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` of ``storage`` from byte ``offset`` (fallback path only)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, offset, (nbytes,), (1,))


def copy_slots(group: Group, region: Region, *, use_native: bool, device: torch.device, stream: Optional["torch.cuda.Stream"]) -> None:
    """The one offload copy path: every storage slot of ``group`` into its offset of ``region``.

    Native: one batched submission (``cuMemcpyBatchAsync`` on ``stream``, or ``memcpy`` for host
    memory when ``stream`` is None). Fallback: one ``copy_`` per slot.
    """
    sizes = group.slot_sizes()
    if use_native:
        base = region.block.data_ptr()
        native.copy_batch(
            [base + off for off in group.slot_offsets],
            [s.data_ptr() + lo for s, lo in zip(group.slot_storages, group.slot_lo)],
            sizes,
            None if stream is None else stream.cuda_stream,
        )
        return
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for storage, lo, off, n in zip(group.slot_storages, group.slot_lo, group.slot_offsets, sizes):
            region.block.narrow(0, off, n).copy_(_byte_view(storage, lo, n, device), non_blocking=stream is not None)


def copy_region(buffer: torch.Tensor, group: Group, *, use_native: bool, stream: Optional["torch.cuda.Stream"]) -> None:
    """The one reload copy path: the group's whole host region into ``buffer`` in ONE copy."""
    src = group.host.block
    if use_native:
        native.copy_batch([buffer.data_ptr()], [src.data_ptr()], [group.nbytes], None if stream is None else stream.cuda_stream)
        return
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        buffer[: group.nbytes].copy_(src[: group.nbytes], non_blocking=stream is not None)


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

    def __init__(self, *, use_native: bool) -> None:
        self.device = torch.device("cpu")
        self.device_index = -1
        self.use_native = use_native

    def capturing(self) -> bool:
        """Host copies are never captured."""
        return False

    def join(self, *, d2h: bool, h2d: bool) -> None:
        """Nothing to join: the host transport has no side streams."""

    def offload(self, group: Group, region: Region, counters: StepCounters) -> Any:
        """Copy the group's slots into ``region``; returns the copy's end event (None here)."""
        start = WallMark()
        copy_slots(group, region, use_native=self.use_native, device=self.device, stream=None)
        counters.copies.append(("d2h", start, WallMark()))
        return None

    def wait_offloaded(self, group: Group, counters: StepCounters) -> None:
        """Order reuse of the originals' memory after the D2H (synchronous here: nothing)."""

    def offload_finished(self, group: Group) -> bool:
        """Whether the group's D2H is done (always: host copies are synchronous)."""
        return True

    def reload(self, group: Group, counters: StepCounters, into: Optional[torch.Tensor] = None, *, wait_d2h: bool = True) -> tuple[torch.Tensor, Any]:
        """Copy the group's region into a fresh (or the given) buffer; returns (buffer, event)."""
        buffer = into if into is not None else torch.empty(group.nbytes, dtype=torch.uint8)
        start = WallMark()
        copy_region(buffer, group, use_native=self.use_native, stream=None)
        counters.copies.append(("h2d", start, WallMark()))
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

    def __init__(self, device: torch.device, *, use_native: bool, d2h_stream: Optional[torch.cuda.Stream] = None) -> None:
        self.device = device
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        self.use_native = use_native
        # PCIe is full duplex: separate streams let reloads of one step overlap offloads.
        self.d2h_stream = d2h_stream if d2h_stream is not None else torch.cuda.Stream(device)
        self.h2d_stream = torch.cuda.Stream(device)

    def capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph (one cheap runtime query)."""
        return torch.cuda.is_current_stream_capturing()

    def join(self, *, d2h: bool, h2d: bool) -> None:
        """Make the current stream wait for everything queued on the side streams so far.

        A capture must end with every stream it forked joined back; a captured step calls this
        for the streams it used, so a copy nobody waited on cannot leave the capture unjoined.
        """
        current = torch.cuda.current_stream(self.device)
        if d2h:
            current.wait_stream(self.d2h_stream)
        if h2d:
            current.wait_stream(self.h2d_stream)

    def _timed(self, stream: torch.cuda.Stream) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def _copy_started(self, stream: torch.cuda.Stream, captured: bool) -> Any:
        # A timing event before the copy; none under capture (a captured event is never timed).
        return None if captured else self._timed(stream)

    def _copy_done(self, stream: torch.cuda.Stream, captured: bool, counters: StepCounters, direction: str, start: Any) -> Any:
        """The copy's end event: timed and counted eagerly, a plain ordering event under capture."""
        if captured:
            event = torch.cuda.Event()
            event.record(stream)
            return event
        end = self._timed(stream)
        counters.copies.append((direction, start, end))
        return end

    def _stall(self, event: Any, counters: StepCounters, captured: bool) -> None:
        current = torch.cuda.current_stream(self.device)
        if captured:
            current.wait_event(event)
            return
        # A copy that already finished needs no wait (query is a non-blocking host call), which
        # saves a wait and two timing events on the common path where copies keep up.
        if event.query():
            return
        # Events around the wait on the compute stream measure how long it stalled.
        before = self._timed(current)
        current.wait_event(event)
        counters.waits.append((before, self._timed(current)))

    def offload(self, group: Group, region: Region, counters: StepCounters) -> Any:
        """Submit the group's D2H into ``region`` on the D2H stream; returns its end event."""
        stream = self.d2h_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        captured = group.captured
        if region.ready is not None and not captured:
            stream.wait_event(region.ready)
        start = self._copy_started(stream, captured)
        copy_slots(group, region, use_native=self.use_native, device=self.device, stream=stream)
        return self._copy_done(stream, captured, counters, "d2h", start)

    def wait_offloaded(self, group: Group, counters: StepCounters) -> None:
        """Make the compute stream wait for the group's D2H before its originals are dropped."""
        self._stall(group.d2h_done, counters, group.captured)

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
        buffer = into if into is not None else torch.empty(group.nbytes, dtype=torch.uint8, device=self.device)
        stream = self.h2d_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if wait_d2h:
            stream.wait_event(group.d2h_done)
        captured = group.reload_captured
        start = self._copy_started(stream, captured)
        copy_region(buffer, group, use_native=self.use_native, stream=stream)
        return buffer, self._copy_done(stream, captured, counters, "h2d", start)

    def wait_reloaded(self, group: Group, counters: StepCounters) -> None:
        """Make the compute stream wait for the group's H2D before it reads the buffer."""
        self._stall(group.h2d_done, counters, group.reload_captured)

    def last_host_use(self, group: Group) -> Any:
        """The event after which the group's host region may be overwritten."""
        return group.h2d_done if group.h2d_done is not None else group.d2h_done
