"""Host blocks for the arena: how one is allocated, and a thread that allocates ahead of need.

Why not ``torch.empty(pin_memory=True)``: torch pins through ``cudaHostAlloc`` at 1.3-2.3 GB/s
on our H100 host (a 64 MiB block takes 40 ms, 1 GiB 0.8 s), the first step of a large model froze
for seconds, and its caching host allocator rounds each request up to a power of two, so the bytes
really pinned were not the bytes the arena counted. The native extension instead maps anonymous
memory, faults it in from several threads (the kernel zeroes each page on first touch: that is
the slow part, and it parallelises), and registers it with ``cuMemHostRegister``. With
transparent huge pages the registration walks 512x fewer pages. Measured on our H100 host, one
block at a time (``benchmarks/first_step.py`` shows what a first step pays with them):

=============  ==========  ==========  ==========
method         64 MiB      1 GiB       4 GiB
=============  ==========  ==========  ==========
torch          1.7 GB/s    1.3 GB/s    2.3 GB/s
host_alloc     1.5 GB/s    2.2 GB/s    1.6 GB/s
register       1.4 GB/s    2.8 GB/s    9.1 GB/s
register_huge  6.1 GB/s    11.3 GB/s   22.4 GB/s
=============  ==========  ==========  ==========

On a fresh cloud VM (the H200 hosts we are lent) the first touch of guest memory is what costs:
the first 8 GiB pinned at 25 GB/s, the next 88 GiB at 3.4-7 GB/s whatever the method, and the same
32 GiB again, freed and pinned anew, at 20 GB/s (the hypervisor backs each guest page on its
first touch, once). A long-lived node pins at the faster rate.

Copies to and from the registered memory run at the same 52-55 GB/s as to torch's. But the
driver's submission cost depends on the pages: a 1 MiB copy is submitted in 5-6 us to or from
``host_alloc`` and huge-page memory, and in 13-31 us to or from 4 KiB-page registered memory
(it walks the pages). So blocks of ``HUGE_PAGE_MIN_BYTES`` and more use huge pages (a huge page
rounds a block up by at most 2 MiB, under 25% from that size on, 3% from 64 MiB), and smaller
ones ``cuMemHostAlloc`` (slow to pin, but a small block pins in a few milliseconds, once).
Without the extension, torch's pinned allocator is the fallback, and its power-of-two rounding
is what is counted as held. That allocator *caches*: a pinned block whose tensor dies stays
pinned in its cache (shared memory, to the kernel) until ``torch._C._host_emptyCache()``, and
is reused only for a request of the same power of two. An arena that freed its blocks would
leave them all pinned, and contexts one after another (other sizes, other powers of two) would
pile up pinned memory that no budget counts, until the OOM killer ends the process. So the
arena empties that cache after it frees blocks (:func:`release_cached_pinned`), and the
fallback empties it before each pin (blocks of an arena dropped without ``close()``): the
fallback's blocks then hold their bytes exactly while they live, as the extension's do, and
the process-wide ledger (``offload.host.ledger``) counts what is really pinned.

Background allocation (:class:`BackgroundPinner`): worker threads allocate blocks queued ahead
(``HostArena.preallocate(..., background=True)``, and the growth forecast on a step's first miss),
so pinning overlaps compute. The native allocation releases the GIL. The worker is a
``concurrent.futures`` thread: the interpreter joins it at exit, after the block in progress, so an
allocation still running when a context is dropped or the program ends finishes cleanly instead of
touching a torn-down CUDA context; blocks still only queued are cancelled by :meth:`close`.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import itertools
import threading
import time
from typing import Callable, Optional

import torch

from . import native
from .numa import NumaPlacement

HUGE_PAGE_MIN_BYTES = 8 << 20
# Threads pinning blocks in the background. ``cuMemHostRegister`` holds the driver's lock while
# it pins, and every driver call of the process waits behind it: the training thread's launches,
# synchronisations and cudaMalloc. Work the GPU has queued runs on, so a step loses what its thread
# could not queue ahead. Measured on an H200 (``benchmarks/first_step.py --registration 12``, 1 GiB
# blocks; the share of the pinning's wall time lost by a loop that synchronises every 13 ms / by a
# loop of 400 launches): two workers 0.93 / 0.45, one 0.27-0.31 / 0.26-0.32, pinning 12 GiB in
# about the same wall time. Two keep the lock almost always held; one leaves the training thread
# gaps. Registering a block in smaller pieces would shorten each hold, but the driver refuses a
# copy whose host range spans two registrations (CUDA_ERROR_INVALID_VALUE, measured), and a
# group's tensors are laid out across its whole block: blocks are registered whole.
PINNER_WORKERS = 1
# The longest a held block waits (BackgroundPinner.hold): a hold lasts one step, and a step
# longer than this would otherwise put off the plans' blocks by a whole step.
HOLD_MAX_S = 3.0

# (block, bytes really locked) for a request of ``nbytes``.
Allocator = Callable[[int], tuple[torch.Tensor, int]]

# cuThreadExchangeStreamCaptureMode's mode under which a thread's driver calls never fail, nor
# invalidate, a CUDA-graph capture running on another thread.
_CAPTURE_MODE_RELAXED = 2


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def expected_held_bytes(nbytes: int, *, pinned: bool, native_live: bool) -> int:
    """The bytes :func:`allocate_host_block` will really hold for ``nbytes``, known before it
    runs (so that a budget can be charged first): the extension's page rounding (2 MiB huge
    pages from ``HUGE_PAGE_MIN_BYTES``, 4 KiB below), torch's power of two, or the request."""
    if not pinned:
        return nbytes
    if not native_live:
        return _power_of_two_at_least(nbytes)
    return _round_up(nbytes, 2 << 20 if nbytes >= HUGE_PAGE_MIN_BYTES else 4096)


def release_cached_pinned() -> None:
    """Unpin the blocks torch's caching host allocator keeps for tensors that died.

    Only blocks whose copies are done are freed (the allocator checks their events), and
    ``cudaFreeHost`` may synchronise the device: call this where blocks are given back (a
    trim, ``close()``), never on the per-step path and never under CUDA-graph capture. A no-op
    without CUDA, or while torch has not initialised it (then nothing was pinned).
    """
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is None or not torch.cuda.is_initialized() or torch.cuda.is_current_stream_capturing():
        return
    empty()


def relax_capture_mode() -> bool:
    """Let this thread pin and unpin host memory while another thread captures a CUDA graph.

    torch captures in the driver's global mode, where a "potentially unsafe" call from *any*
    thread, pinning among them, fails and invalidates the capture in progress: measured on an
    H200, a worker pinning 256 MiB blocks in a loop broke 229 of 1009 captures on the main
    thread and failed 223 of its own registrations (``cudaErrorStreamCaptureInvalidated``,
    ``cudaErrorAlreadyMapped``); in relaxed mode none of either in 434. Pinning is not stream
    work and no captured graph depends on it, so the pinner's workers run relaxed: this is for
    torch's pinned allocator (the fallback); the extension relaxes each of its own host memory
    calls, on whatever thread (``csrc/cuda_driver.cpp``, ``host_memory_call``). Returns whether
    the driver took the mode (False without a CUDA driver)."""
    try:
        exchange = ctypes.CDLL("libcuda.so.1").cuThreadExchangeStreamCaptureMode
    except (OSError, AttributeError):
        return False
    mode = ctypes.c_int(_CAPTURE_MODE_RELAXED)
    return exchange(ctypes.byref(mode)) == 0


def allocate_host_block(
    nbytes: int, *, pinned: bool, placement: Optional[NumaPlacement] = None
) -> tuple[torch.Tensor, int]:
    """A uint8 host tensor of ``nbytes`` and the bytes it really holds.

    ``pinned``: page-locked (for a CUDA transport), through the native extension when it is live,
    else torch's pinned allocator. Raises ``RuntimeError`` when the host refuses (out of memory,
    or the locked-memory limit). ``placement``: the NUMA node to put the pages on (pinned native
    blocks only; see ``offload.host.numa``); a node the kernel refuses is noted there, and the block
    is allocated without it.
    """
    if not pinned:
        return torch.empty(nbytes, dtype=torch.uint8), nbytes
    ext = native.extension()
    if ext is None:
        # The cache may still hold blocks that died since the last trim (an arena dropped
        # without close()): unpin them first, so that what is pinned is what the ledger counts.
        release_cached_pinned()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), _power_of_two_at_least(nbytes)
    method = "register_huge" if nbytes >= HUGE_PAGE_MIN_BYTES else "host_alloc"
    node = placement.node if placement is not None else None
    buffer = ext.PinnedBuffer(nbytes, method, numa_node=-1 if node is None else node)
    if node is not None and buffer.numa_node != node:
        placement.refused(buffer.numa_error)  # type: ignore[union-attr]
    # frombuffer keeps ``buffer`` alive as long as the tensor (and its views) live; when the last
    # goes, the buffer's destructor unregisters and unmaps the memory.
    return torch.frombuffer(buffer, dtype=torch.uint8), buffer.pinned_bytes


class BackgroundPinner:
    """Worker threads (:data:`PINNER_WORKERS`) that run ``allocate`` for blocks queued ahead of
    need, in the order queued. ``busy_s``: the seconds the workers have spent allocating, summed
    over them (what pinned beside a step: ``offload.planner.first_steps`` reads it)."""

    def __init__(self, allocate: Allocator, device_index: Optional[int]) -> None:
        self._allocate = allocate
        self._device_index = device_index
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._queued = itertools.count()
        self.busy_s = 0.0
        self._busy_lock = threading.Lock()  # PINNER_WORKERS threads add to busy_s
        # Cleared while the arena holds its pinning (:meth:`hold`): a block not started waits.
        self._go = threading.Event()
        self._go.set()

    def _start_worker(self) -> None:
        # Once per worker thread, before its first block (it never raises: an initializer that
        # did would break the pool for every block).
        if self._device_index is not None and self._device_index >= 0:
            relax_capture_mode()

    def hold(self, held: bool) -> None:
        """Hold the blocks not started yet (True: a step new to the allocator and to cuDNN runs,
        whose ``cudaMalloc`` calls and graph builds would wait behind each registration's hold
        of the driver's lock), or let them go (False; so does the arena before it waits for a
        block). A block in progress finishes; a held one starts :data:`HOLD_MAX_S` after it was
        due at the latest."""
        if held:
            self._go.clear()
        else:
            self._go.set()

    @property
    def held(self) -> bool:
        """Whether the blocks not started yet are held."""
        return not self._go.is_set()

    def _run(self, nbytes: int) -> tuple[torch.Tensor, int]:
        self._go.wait(HOLD_MAX_S)
        if self._device_index is not None and self._device_index >= 0:
            # The driver pins in the calling thread's current context; the worker has none until
            # torch makes the device's primary context current here.
            torch.cuda.set_device(self._device_index)
        started = time.perf_counter()
        try:
            return self._allocate(nbytes)
        finally:
            with self._busy_lock:
                self.busy_s += time.perf_counter() - started

    def submit(self, nbytes: int) -> "concurrent.futures.Future[tuple[torch.Tensor, int]]":
        """Queue one block; its future gives ``(block, bytes held)`` or the allocation's error."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=PINNER_WORKERS, thread_name_prefix="offload-pinner", initializer=self._start_worker)
        future = self._executor.submit(self._run, nbytes)
        # The workers take blocks in this order: a block queued earlier is ready earlier (the
        # arena waits for the first-queued block that fits, see HostArena._from_pinner).
        future.queued = next(self._queued)  # type: ignore[attr-defined]
        return future

    def close(self) -> None:
        """Cancel the queued blocks; the one in progress finishes on its own (never waited for)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
