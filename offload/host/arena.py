"""Pinned host arena: reusable host blocks for group regions, capped by a host-RAM budget.

Why an arena: pinning costs milliseconds per 100 MB even with the fastest method we have (see
``offload.host.pinning``), so pinning per tensor or per step would dominate the step. The arena pins a
block the first time a region of that size is needed and hands the same block out again in later
steps, so an unchanged model makes no pinned allocation after its first step, and the region
addresses stay stable (what a CUDA-graph replay needs).

The first step, or a step whose groups grew, still has to pin. ``preallocate`` pins ahead when
the sizes are known (``ctx.reserve``, a plan's regions), on the caller's thread or in the
background; the first miss of a step queues blocks of its size for the step's remaining layers
on the background pinner. A released block remembers the event of its last copy, and the next
user's copy stream waits on it (``Region.ready``) instead of the host synchronising.

A step need not wait for pinning at all: ``keep_while_pinning(size)`` is asked when the sole way
to a block is to wait for one being pinned or to pin one now; when it says yes (the GPU has room
to keep the group), ``acquire`` returns None and the group stays on the GPU this step
(``kept["pinning"]``); a later step finds the block pinned.

The bytes the arena holds (in use + idle + being pinned, as really locked) are bounded by its
budget, by the process's ledger (``offload.host.ledger``: every arena's charges against the
process's budget and the node's room, read whenever the pool grows), and by what its plans need
plus a slack (``offload.host.room``: idle blocks beyond it go, least recently used first; nothing
is pinned ahead beyond it). Tensors are also counted at pack time (``claim``), so that a step that
would overrun a bound keeps the excess tensors on the GPU instead of failing later. A block the
host refuses (out of memory, locked-memory limit) is the same as a bound saying no: the group
stays on the GPU, counted under ``kept["budget"]``, and nothing is lost. After freeing blocks the
arena empties torch's pinned-memory cache (the fallback allocator's blocks would stay).

CUDA-graph capture: a replay copies to and from the host address its capture named, with no
Python running. So a region acquired under capture (``acquire(..., captured=True)``) is *owned by
the graph*: when its group is freed it stays held and counted for the arena's life, never idle
(an eager step could overwrite what a replay reloads later). Under capture nothing is allocated
(pinning synchronises the device) nor trimmed (that waits on events): a capture takes idle blocks
left by an earlier eager step, or fails with an error that says so.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import threading
import warnings
import weakref
from typing import Any, Callable, Iterable, Optional, Union

import torch

from . import native
from .ledger import NODE_READ_MAX_AGE_S, HostLedger, default_host_budget, process_ledger
from .room import HostRoom, PlanNeeds, fit_within, least_room, ledger_refusal, plan_data_bytes, plan_limited_message, worst_rounding
from .blocks import BLOCK_GRANULE, REUSE_SLACK, ArenaCounters, CaptureError, Region, repeat_sizes, with_headroom
from .idle import IdleBlocks
from .layout import align_up
from .numa import NumaPlacement
from .pinning import Allocator, BackgroundPinner, allocate_host_block, expected_held_bytes, release_cached_pinned


class HostArena:
    """Hands out host blocks for group regions and takes them back for reuse."""

    def __init__(
        self,
        *,
        pinned: bool,
        budget_bytes: Optional[int],
        retain: bool,
        device_index: Optional[int] = None,
        allocate: Optional[Allocator] = None,
        numa: Optional[NumaPlacement] = None,
        keep_while_pinning: Optional[Callable[[int], bool]] = None,
        ledger: Optional[HostLedger] = None,
    ) -> None:
        self.pinned = pinned
        # Keep idle blocks past a step that did not use them, as ``retain`` does, but set by the
        # planner: a stream of batch shapes' plans need other regions in turn (plan_steps).
        self.hold_idle = False
        # Asked on a miss that would wait for pinning: may the group stay on the device? (None: wait.)
        self.keep_while_pinning = keep_while_pinning
        # The NUMA node of the blocks (the GPU's, see offload.host.numa), and why.
        self.numa = numa if numa is not None else NumaPlacement(None, "not bound")
        placement = self.numa
        # ``allocate(nbytes) -> (block, bytes held)``; tests replace it to make the host refuse.
        self.allocate: Allocator = allocate or (lambda n: allocate_host_block(n, pinned=pinned, placement=placement))
        # What a block of a request will really hold, charged to the ledger before it exists
        # (then adjusted to its real bytes). A given allocator's rounding is not known: its
        # request is charged, and the adjustment follows once the block exists.
        native_live = native.extension() is not None
        self._expect: Callable[[int], int] = (
            (lambda n: expected_held_bytes(n, pinned=pinned, native_live=native_live)) if allocate is None
            else (lambda n: n)
        )
        self._rounding = worst_rounding(pinned=pinned, native_live=native_live, own_allocator=allocate is not None)
        # The pinner's thread holds the arena weakly: queued blocks must not keep a dropped
        # context's arena alive, and dropping it cancels them.
        arena_ref = weakref.ref(self)

        def allocate_for_arena(nbytes: int) -> tuple[torch.Tensor, int]:
            arena = arena_ref()
            if arena is None:
                raise RuntimeError("offload: the host arena was dropped before its block was pinned")
            return arena.allocate(nbytes)

        self.pinner = BackgroundPinner(allocate_for_arena, device_index if pinned else None)
        weakref.finalize(self, self.pinner.close)
        self._step_sizes: list[int] = []  # block sizes asked for by the latest acquiring step
        # Blocks being pinned in the background: (size, future), sorted by size.
        self._pending: list[tuple[int, concurrent.futures.Future]] = []
        # This arena's share of the process's ledger; refunded in full when the arena is
        # collected (its blocks go with it), so a context dropped without close() leaks no budget.
        self.ledger = ledger if ledger is not None else process_ledger()
        if budget_bytes is None:
            self.budget_bytes, self.budget_source = default_host_budget(node=self.ledger.read_node())
        else:
            self.budget_bytes, self.budget_source = int(budget_bytes), "host_budget_bytes"
        if self.budget_bytes < 0:
            raise ValueError(f"host_budget_bytes must be >= 0, got {budget_bytes}")
        self.retain = retain
        self._account = self.ledger.open_account()
        weakref.finalize(self, self._account.close)
        self._warned: set[object] = set()  # the refusals (by the node or not) and limits said once
        self.needs = PlanNeeds(self._expect)  # what the plans put in force lately need, and the bound it sets
        self.counters = ArenaCounters()
        self.claimed = 0  # bytes promised at pack time to tensors of groups not yet laid out
        self._free = IdleBlocks()
        self._lock = threading.Lock()  # release runs in Group.__del__, maybe on autograd's threads
        self._graph_owned: list[Region] = []
        self._last_acquiring_step = -1  # the latest step that asked for a region
        # Blocks being pinned that a group of the latest acquiring step, kept on the device
        # meanwhile, counts on (ids of their futures): no other group of that step may count on
        # the same one, or the next step would find one block for two groups.
        self._promised: set[int] = set()

    # -- pack-time budget ------------------------------------------------------------------------
    def claim(self, nbytes: int) -> bool:
        """Promise ``nbytes`` of host space to a tensor being packed; False if over this arena's
        budget, or over what it holds plus what the process's ledger has free."""
        counters = self.counters
        wanted = counters.bytes_in_use + self.claimed + nbytes
        if wanted > self.budget_bytes:
            return False
        # Own blocks first (a steady step stops there), then the process's free bytes (unlocked),
        # with the node read again (at most every few ms) before a refusal.
        held = counters.bytes_held + counters.bytes_pending
        if wanted > held and wanted > held + self.ledger.free_bytes:
            self.ledger.read_node(NODE_READ_MAX_AGE_S)
            if wanted > held + self.ledger.free_bytes:
                self._refused_by_process(wanted - held)
                return False
        self.claimed += nbytes
        return True

    def claim_ahead(self, nbytes: int, ahead: int) -> int:
        """:meth:`claim` ``nbytes`` and up to ``ahead`` more that fit without reading the node (a credit
        for the group's next tensors, given back by :meth:`unclaim`): the bytes promised, 0 if refused."""
        if not self.claim(nbytes):
            return 0
        counters = self.counters
        room = min(self.budget_bytes, counters.bytes_held + counters.bytes_pending + self.ledger.free_bytes)
        extra = max(0, min(ahead, room - counters.bytes_in_use - self.claimed))
        self.claimed += extra
        return nbytes + extra

    def _refused_by_process(self, nbytes: int) -> None:
        # Off the fast path (a refusal): count it, and say why (the budget or the node) once.
        self.counters.process_refusals += 1
        by_node, message = ledger_refusal(self.ledger, nbytes, self.counters.bytes_held)
        self.counters.node_refusals += by_node
        if by_node not in self._warned:
            self._warned.add(by_node)
            warnings.warn(message, stacklevel=3)

    def unclaim(self, nbytes: int) -> None:
        """Return a promise made by :meth:`claim` (the group got its region, or gave up)."""
        self.claimed = max(0, self.claimed - nbytes)

    # -- pinning ahead ---------------------------------------------------------------------------
    def preallocate(self, sizes: Iterable[int], *, background: bool = False) -> int:
        """Pin idle blocks of these sizes now (or queue them on the background pinner).

        Returns the bytes added or queued. Raises ``ValueError`` naming the budget when they do
        not fit in it, before anything is allocated, and ``RuntimeError`` when the host refuses
        a block (the blocks pinned before it are kept).
        """
        blocks = [align_up(max(int(n), 1), BLOCK_GRANULE) for n in sizes]
        total = sum(blocks)
        charges = [self._expect(size) for size in blocks]
        with self._lock:
            held = self.counters.bytes_held + self.counters.bytes_pending
            if held + total > self.budget_bytes:
                raise ValueError(
                    f"offload: reserving {total} bytes of pinned host memory would hold {held + total} "
                    f"bytes, over the host budget of {self.budget_bytes} bytes (host_budget_bytes; "
                    f"{held} held already). Reserve less, or raise host_budget_bytes."
                )
            if not self._account.try_charge(sum(charges)):
                raise ValueError(ledger_refusal(self.ledger, sum(charges), self.counters.bytes_held)[1])
        # Charged for all of them: each is queued, or allocated and adjusted to its real bytes.
        for i, (size, charge) in enumerate(zip(blocks, charges)):
            if background:
                self._queue(size, charged=True)
                continue
            try:
                block, pinned_bytes = self.allocate(size)
            except BaseException:
                self._account.refund(sum(charges[i:]))
                raise
            with self._lock:
                self._account.adjust(pinned_bytes - charge)
                self._add_idle(Region(block=block, pinned_bytes=pinned_bytes))
        return total

    def sizes_for(self, nbytes: int, blocks_if_unknown: int) -> list[int]:
        """Block sizes that add up to at least ``nbytes``: the sizes the latest step asked for,
        repeated, or ``blocks_if_unknown`` equal blocks (with headroom) when no step has asked."""
        return repeat_sizes(list(self._step_sizes), nbytes, blocks_if_unknown)

    def _queue(self, size: int, *, charged: bool) -> Optional[concurrent.futures.Future]:
        # ``charged``: the ledger was charged for this block already; else it is charged here,
        # and None returned (nothing queued) when the process has no room for it.
        if not charged and not self._account.try_charge(self._expect(size)):
            return None
        future = self.pinner.submit(size)
        self._account.mark_pending(self._expect(size))  # charged, not gone from the node yet
        with self._lock:
            self.counters.bytes_pending += size
            self._note_peak()
            i = bisect.bisect_right([s for s, _ in self._pending], size)
            self._pending.insert(i, (size, future))
        return future

    def _count_pinned(self, pinned_bytes: int, in_use: int) -> None:
        # Called with the lock held: one more pinned block, ``in_use`` of it handed out now.
        self.counters.pinned_allocations += 1
        self.counters.bytes_held += pinned_bytes
        self.counters.bytes_in_use += in_use
        self._note_peak()

    def _note_peak(self) -> None:
        # Called with the lock held.
        self.counters.peak_bytes_held = max(self.counters.peak_bytes_held, self._committed())

    def _add_idle(self, region: Region) -> None:
        # Called with the lock held: a newly pinned block joins the idle list.
        self._count_pinned(region.pinned_bytes, 0)
        self._free.add(region)

    def _take_idle(self, size: int, step: int, captured: bool) -> Optional[Region]:
        # Called with the lock held: the idle block that serves ``size`` (IdleBlocks.take).
        region = self._free.take(size, captured)
        if region is None:
            return None
        self.counters.bytes_in_use += region.block.numel()
        region.used_in_step = step
        region.graph_owned = captured
        self.counters.graph_owned_blocks += captured
        return region

    def _from_pinner(self, size: int, step: int, keep_while_pinning: Optional[Callable[[int], bool]]) -> Optional[Region]:
        """Move finished background blocks to the idle list and take one that fits; else wait
        for one still being pinned that fits, unless ``keep_while_pinning(size)`` says not to.
        None when none does (or its pinning failed, or the caller keeps its group instead)."""
        with self._lock:
            self._settle_finished()
            region = self._take_idle(size, step, captured=False)
            if region is not None:
                return region
            # The first queued block that fits is ready first (the smallest may be far behind).
            waited = min((e for e in self._pending if size <= e[0] <= size * REUSE_SLACK and id(e[1]) not in
                          self._promised), key=lambda e: getattr(e[1], "queued", 0), default=None)
        if waited is None:
            return None
        # (Pending blocks change only on the thread that acquires; the question may call the
        # driver, so it is asked outside the lock that Group.__del__ also takes.)
        keep = keep_while_pinning is not None and keep_while_pinning(size)
        if not keep:
            self.pinner.hold(False)  # (a held block would be waited for in vain)
        with self._lock:
            if keep:
                self._promised.add(id(waited[1]))  # it joins the idle list when done
                self.counters.kept_while_pinning += 1
                return None
            if waited not in self._pending:  # finished and settled meanwhile (settle())
                return self._take_idle(size, step, captured=False)
            self._pending.remove(waited)
        pending_size, future = waited
        try:
            block, pinned_bytes = future.result()
        except Exception:  # noqa: BLE001 - a refused block is a miss like any other
            with self._lock:
                self._settle(pending_size, future)  # counts the failure, refunds the charge
            return None
        with self._lock:
            self.counters.bytes_pending -= pending_size
            self._account.mark_pending(-self._expect(pending_size))
            self._account.adjust(pinned_bytes - self._expect(pending_size))
            self._count_pinned(pinned_bytes, block.numel())
            self.counters.waited_for_pinning += 1
        return Region(block=block, pinned_bytes=pinned_bytes, used_in_step=step)

    def _settle(self, size: int, future: concurrent.futures.Future) -> None:
        # Called with the lock held, for a finished (or cancelled) background block.
        self.counters.bytes_pending -= size
        self._account.mark_pending(-self._expect(size))
        if future.cancelled() or future.exception() is not None:
            # (Cancelled: close() or free_idle() gave it up before it started; not a failure.)
            self.counters.failures += not future.cancelled()
            self._account.refund(self._expect(size))
            return
        block, pinned_bytes = future.result()
        self._account.adjust(pinned_bytes - self._expect(size))
        # Counted as the latest acquiring step's: it was queued for that step's groups (a
        # forecast, or a group kept on the device while it pinned), and may finish only after
        # that step has ended; the trim at the step's end must not take it back unused.
        self._add_idle(Region(block=block, pinned_bytes=pinned_bytes, used_in_step=self._last_acquiring_step))

    def _settle_finished(self) -> None:
        # Called with the lock held: every finished background block joins the idle list.
        keep = []
        for size, future in self._pending:
            if future.done():
                self._settle(size, future)
            else:
                keep.append((size, future))
        self._pending = keep

    def settle(self, wait: bool = False) -> None:
        """Move the blocks the background pinner has finished to the idle list (``acquire``
        does this itself on a miss); ``wait=True`` first waits for every queued block."""
        if wait:
            self.pinner.hold(False)  # (a held block would be waited for in vain)
            with self._lock:
                # Not the cancelled ones: a future the executor's shutdown cancelled in its
                # queue is never notified, and concurrent.futures.wait would wait for it forever.
                pending = [future for _, future in self._pending if not future.cancelled()]
            concurrent.futures.wait(pending)
        with self._lock:
            self._settle_finished()

    # -- regions ---------------------------------------------------------------------------------
    def unserved(self, sizes: Iterable[int], *, pending: bool = True) -> list[int]:
        """Of these region sizes, those no idle block (or, ``pending``, block being pinned) would
        serve, each block once."""
        with self._lock:
            self._settle_finished()
            return self._serve(sizes)[1] if pending else self._free.serve(sizes, ())[1]

    def _serve(self, sizes: Iterable[int]) -> tuple[frozenset, list[int]]:
        # Called with the lock held: IdleBlocks.serve, blocks being pinned included.
        return self._free.serve(sizes, ((size, id(future)) for size, future in self._pending))

    # -- plans -----------------------------------------------------------------------------------
    def pin_for_plan(self, sizes: Iterable[int], *, hold_idle: bool) -> None:
        """A plan whose steps will ask for regions of these sizes is put in force: with the plans
        remembered, it bounds what the arena holds (:mod:`offload.host.room`); idle blocks beyond
        the bound, or the budgets' room for the blocks it misses, go, least recently used first
        and those the plan cannot use before those it can; the regions no block serves are pinned
        in the background, as far as the bound and the room allow.
        ``hold_idle``: keep idle blocks between steps (plans per shape; pinned arenas only)."""
        sizes = list(sizes)
        blocks = sorted(align_up(max(int(n), 1), BLOCK_GRANULE) for n in sizes)
        self.needs.note(tuple(blocks))
        self.hold_idle = hold_idle and self.pinned
        with self._lock:
            self._settle_finished()
            serving, missing = self._serve(sizes)
            dropped = self._drop_idle_for(sum(missing), sum(self._expect(m) for m in missing), keep=serving)
            room = min(self.needs.cap - self._committed(), self.budget_bytes - self._committed(),  # type: ignore[operator]
                       self.ledger.free_bytes)
        if dropped:
            self._give_back_dropped()
        if not self.pinned:
            return
        fitting = fit_within(missing, room, self._expect)
        if fitting:
            try:
                self.preallocate(fitting, background=True)
            except ValueError:
                pass  # over a budget or the node's room: the step keeps what does not fit on the GPU

    def host_room(self) -> HostRoom:
        """What this arena may hold in all now: the least of its cap, the process's room and the
        node's (read now), named (:func:`offload.host.room.least_room`)."""
        return least_room(self.ledger, (self.budget_bytes, self.budget_source), self.counters.bytes_held,
                          self._account)

    def plan_host_bytes(self) -> int:
        """The host bytes a plan made now may copy: :meth:`host_room` less the allocator's
        rounding (:func:`offload.host.room.plan_data_bytes`). The one host figure plans read."""
        return plan_data_bytes(self.host_room().held_bytes, self._rounding)

    def plan_limited(self, wanted: int, planned: int) -> None:
        """The host room made a plan copy ``planned`` bytes where it would copy ``wanted``: say
        so, once per arena (the planner's ``host_limited``)."""
        if "plan" not in self._warned:
            self._warned.add("plan")
            warnings.warn(plan_limited_message(wanted, planned, self.host_room(), self._rounding), stacklevel=3)

    def has_idle_blocks(self) -> bool:
        """Whether a block is waiting to be reused (what a CUDA-graph capture needs)."""
        return bool(self._free)

    def acquire(
        self,
        nbytes: int,
        step: int,
        *,
        captured: bool = False,
        expected_more: Optional[Callable[[], Union[int, list[int]]]] = None,
    ) -> Optional[Region]:
        """A block of at least ``nbytes``, or None when the budget or the allocator says no.

        ``captured``: under CUDA-graph capture: only an idle block is handed out (``CaptureError``
        when none fits), and the graph owns it from now on. ``expected_more()``, asked on a miss
        with nothing being pinned: how many more regions of about this size the step will ask
        for (that many blocks are queued on the background pinner for the next layers), or the
        sizes of those regions (a plan's: the ones no idle block serves are queued, each at its
        own size with a guessed block's headroom).
        ``self.keep_while_pinning(size)`` is asked only when the block would be waited for or
        pinned now. True: it is pinned in the background, None is returned and
        ``counters.kept_while_pinning`` counts it (a miss, not a refusal: ``counters.failures``).
        """
        keep_while_pinning = self.keep_while_pinning
        size = align_up(max(nbytes, 1), BLOCK_GRANULE)
        with self._lock:
            if step != self._last_acquiring_step:
                self._step_sizes = []
                self._promised.clear()
            self._step_sizes.append(size)
            self._last_acquiring_step = max(self._last_acquiring_step, step)
            region = self._take_idle(size, step, captured)
        if region is not None:
            return region
        if captured:
            idle = ", ".join(str(n) for n in self._free.sizes) or "none"
            raise CaptureError(
                f"offload: a pinned host region of {size} bytes is needed while a CUDA graph is "
                f"being captured, and no idle block fits (idle block sizes: {idle}). Pinned "
                "memory cannot be allocated under capture. Run one eager step (or warm-up "
                "iteration) with offloading on right before capturing, with "
                "retain_pinned_cpu_buffers=True so its blocks are kept for the capture."
            )
        if self._pending:
            kept = self.counters.kept_while_pinning
            region = self._from_pinner(size, step, keep_while_pinning)
            if region is not None or self.counters.kept_while_pinning != kept:
                return region
        charge = self._expect(size)
        ledger = self.ledger
        ledger.read_node(NODE_READ_MAX_AGE_S)  # the pool grows: what the node has now
        with self._lock:
            # Make room from idle blocks, least recently used first, before giving up on the
            # budget (this arena's, the process's or the node's: a freed block is refunded to the
            # ledger), and to stay within what the plans need.
            dropped = self._drop_idle_for(size, charge)
            if self._committed() + size > self.budget_bytes:
                self.counters.failures += 1
                charged = False
            else:
                charged = self._account.try_charge(charge)
                if not charged:
                    self.counters.failures += 1
            if charged:
                # Host blocks that are not pinned cost no more than any allocation: no forecast.
                more = expected_more() if self.pinned and expected_more is not None and not self._pending else 0
                guesses = ([with_headroom(n) for n in self._serve(more)[1]] if isinstance(more, list)
                           else [with_headroom(size)] * more)
                cap = self.needs.cap  # (nothing pinned ahead beyond what the plans need)
                room = min(self.budget_bytes - self._committed() - size, ledger.free_bytes,
                           cap - self._committed() - size if cap is not None else ledger.free_bytes)
                forecast = fit_within(guesses, room, self._expect)
        if dropped:
            self._give_back_dropped()
        if not charged:
            if self.counters.bytes_held + self.counters.bytes_pending + size <= self.budget_bytes:
                self._refused_by_process(size)
            return None
        for guess in forecast:
            if self._queue(guess, charged=False) is None:
                break
        if keep_while_pinning is not None and keep_while_pinning(size):
            # Pin this one in the background too (it fits both budgets: charged above), for the
            # next step; this step keeps its group on the GPU.
            future = self._queue(size, charged=True)
            with self._lock:
                self._promised.add(id(future))
                self.counters.kept_while_pinning += 1
            return None
        try:
            block, pinned_bytes = self.allocate(size)
        except RuntimeError:
            with self._lock:
                self._account.refund(charge)
                self.counters.failures += 1
            return None
        with self._lock:
            self._account.adjust(pinned_bytes - charge)
            self._count_pinned(pinned_bytes, size)
        return Region(block=block, pinned_bytes=pinned_bytes, used_in_step=step)

    def _drop_idle_for(self, size: int = 0, charge: int = 0, keep: frozenset = frozenset()) -> bool:
        # Called with the lock held: drop idle blocks, least recently used first (those in
        # ``keep``, ids of regions, last), while ``size`` more bytes (``charge`` to the ledger)
        # would not fit the budget, the plans' bound, or the process's and node's room (those only
        # if dropping all would make room: other contexts may hold the rest, and ours would go for
        # nothing). Whether any was dropped; those dropped for the plans' bound are counted.
        ledger = self.ledger
        reachable = ledger.free_bytes + self._free.pinned_bytes() >= charge
        cap = self.needs.cap
        dropped = False
        while self._free:
            over_plans = cap is not None and self._committed() + charge > cap
            if not (over_plans or self._committed() + size > self.budget_bytes
                    or (reachable and ledger.free_bytes < charge)):
                break
            self._drop_free(self._free.least_recent(keep))
            self.counters.trimmed_for_plan += over_plans
            dropped = True
        return dropped

    def _committed(self) -> int:
        # Called with the lock held: bytes held plus bytes being pinned.
        return self.counters.bytes_held + self.counters.bytes_pending

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
            self._free.add(region)

    def end_step(self, finished_step: int, first_step: Optional[int] = None) -> None:
        """Free idle blocks that no step from ``first_step`` (default ``finished_step``) on used,
        unless buffers are retained.

        ``first_step``: the first of the micro-batches in flight with the finished one (a
        pipeline's wave), whose blocks the next wave wants again. Only a wave that asked for
        regions says what blocks are needed: an evaluation forward (no_grad) saves nothing, and
        trimming after it would make the next training step pin every block again.
        """
        first = finished_step if first_step is None else first_step
        if self.hold_idle and not self.retain:
            with self._lock:
                dropped = self._drop_idle_for()  # idle blocks of no remembered plan, within the bound
            if dropped:
                self._give_back_dropped()
        if self.retain or self.hold_idle or self._last_acquiring_step < first:
            return
        dropped = False
        with self._lock:
            for i in range(len(self._free) - 1, -1, -1):
                if self._free[i].used_in_step < first:
                    self._drop_free(i)
                    dropped = True
        if dropped:
            self._give_back_dropped()

    def free_idle(self) -> int:
        """Free every idle block, and those queued or being pinned in the background (blocks
        lent to groups still alive, and those CUDA graphs own, stay); returns the bytes freed.
        For a context that is done with: the next step pins again. A block being pinned cannot
        be stopped halfway: this waits for it, then frees it."""
        self.pinner.close()  # cancels the queued blocks
        self.settle(wait=True)
        with self._lock:
            held = self.counters.bytes_held
            for i in range(len(self._free) - 1, -1, -1):
                self._drop_free(i)
            freed = held - self.counters.bytes_held
        self._give_back_dropped()
        return freed

    def _give_back_dropped(self) -> None:
        # Called without the lock, once dropped regions are gone. torch's pinned allocator (the
        # fallback without the extension) caches freed blocks pinned: empty it, so the bytes
        # refunded are really unpinned. Only then: the extension's blocks unpin when freed, and
        # the cache holds the user's pinned blocks too (a DataLoader's), whose reuse it costs.
        if self.pinned and native.extension() is None:
            release_cached_pinned()

    def _drop_free(self, i: int) -> None:
        # Called with the lock held. A dropped block may still be the source of an H2D copy in
        # flight; the event tells when it is safe, and the copy engine's reference ends then.
        # Synchronising on that event here is acceptable: this runs only when shrinking.
        region = self._free.pop(i)
        if region.ready is not None:
            region.ready.synchronize()
        self._account.refund(region.pinned_bytes)
        self.counters.bytes_held -= region.pinned_bytes
        self.counters.freed_blocks += 1
