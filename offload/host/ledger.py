"""One account of the host memory offload holds in this process, shared by every arena, held
within what the node can give.

Why: each context's arena caps what it holds (``host_budget_bytes``), but a process may run several
contexts, one after another (a fixed count, then plans) or side by side (a context per model or
thread), and contexts that each stay within their own cap can together lock more than the host
has. And the node is shared with other processes (other jobs, notebooks, dataloader workers).
Pinned memory cannot be swapped out, so the kernel's OOM killer then ends a process instead of
anything raising. The ledger is where the bytes of every arena add up against two bounds:

- the process's budget: ``set_process_host_budget(nbytes)``, or by default the node's total less
  the floor left for others (:mod:`offload.host.node`), shared by the node's ranks of this job
  (``LOCAL_WORLD_SIZE``);
- the node's room, read again (:meth:`HostLedger.read_node`) whenever the pool grows: what the
  node has available now, less the floor; the bytes this process holds already count as its own
  (they are gone from ``available``). Bytes charged for blocks still being pinned
  (``pending_bytes``) are not gone from it yet, and are counted against it.

How it is kept: an arena charges its account (:class:`HostAccount`) *before* it allocates a
block or queues one on the background pinner, with the bytes the allocator will really hold
(page and power-of-two rounding included, :func:`offload.host.pinning.expected_held_bytes`), adjusts
the charge to the block's real bytes once it exists, and refunds it when it frees the block. A
charge the ledger refuses is a refusal like the arena's own budget: the group stays on the GPU
(``kept["budget"]``), nothing is lost. The account remembers its own charge, so an arena
garbage-collected without ``close()`` refunds everything it still held.

The ledger counts offload's arenas only, whatever allocator is behind them (the native
extension's registered memory, torch's pinned allocator without it, plain host memory on the
``cpu`` transport), not other pinned memory of the process (a DataLoader's pinned batches: the
node's ``available`` sees those). It knows amounts, never the arenas: no registry of contexts is
kept.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Mapping, Optional

from .node import NodeMemory, NodeSource, node_source_from_env, size_text

LOCAL_RANKS_ENV_VAR = "LOCAL_WORLD_SIZE"  # set by torchrun (and most launchers) on every rank
# A node read this recent is reused: a growth queues several blocks in a row, and reading the
# node (/proc/meminfo and the cgroup's files) costs tens of microseconds each time.
NODE_READ_MAX_AGE_S = 0.005


def default_host_budget(environ: Optional[Mapping[str, str]] = None,
                        node: Optional[NodeMemory] = None) -> tuple[int, str]:
    """The host budget of a context given none, and where it came from.

    The node's total (its memory cgroup's limit where lower) less the floor left for the OS and
    others (:func:`offload.host.node.node_floor`), divided among this job's processes on the node
    (``LOCAL_WORLD_SIZE``, 1 when unset): the most the process may ever hold. Total, not available:
    what happens to be free when a process starts depends on what ran before it. What it may
    hold *now* is bounded again by the node's room, read whenever the pool grows (the ledger).
    ``node``: the figures to use (default: read the real node now).
    """
    environ = os.environ if environ is None else environ
    text = environ.get(LOCAL_RANKS_ENV_VAR, "").strip()
    ranks = 1
    if text:
        try:
            ranks = int(text)
        except ValueError:
            ranks = 0
        if ranks < 1:
            raise ValueError(
                f"offload: {LOCAL_RANKS_ENV_VAR}={text!r} is not a number of processes >= 1; fix the "
                "launcher's environment, or pass host_budget_bytes explicitly (and set the "
                "process's with offload.host.ledger.set_process_host_budget)"
            )
    if node is None:
        node = node_source_from_env(environ).read()
    budget = max(0, node.total_bytes - node.floor_bytes) // ranks
    return budget, (f"node total {size_text(node.total_bytes)} less {size_text(node.floor_bytes)} left "
                    f"for others ({node.source}) / {LOCAL_RANKS_ENV_VAR}={ranks}, within what the node "
                    "has available at each growth")


class HostLedger:
    """Host bytes held by every arena of the process, against its budget and the node's room.

    The budget is :func:`default_host_budget` (read again each time an arena opens an account,
    so it follows ``LOCAL_WORLD_SIZE``) unless :meth:`set_budget` fixed it. ``node``: where the
    node's memory is read (default: ``OFFLOAD_SIMULATED_NODE`` if set, else the real node; see
    :mod:`offload.host.node`).
    """

    def __init__(self, node: Optional[NodeSource] = None) -> None:
        # Charges come from the forward thread, the pinner thread and Group.__del__ (autograd's
        # threads): one lock for the ledger and all its accounts.
        self._lock = threading.Lock()
        self._fixed: Optional[int] = None
        self._node_source = node
        self.budget_bytes = 0
        self.budget_source = "not read yet (no arena opened)"
        self.held_bytes = 0     # charged: blocks held, and blocks queued or being pinned
        self.pending_bytes = 0  # of those, the blocks not allocated yet (not gone from "available")
        self.peak_bytes = 0
        self.refusals = 0       # charges refused, by the budget or the node
        self.node_refusals = 0  # of those, by the node's room
        self.node: Optional[NodeMemory] = None  # the last read
        self._node_read_at = -1.0
        # What the node lets the process add, as of the last read, less what was charged since.
        self._node_free = 1 << 62

    @property
    def node_source(self) -> NodeSource:
        """Where the node's memory is read (chosen at first use, so a test's environment counts)."""
        if self._node_source is None:
            self._node_source = node_source_from_env()
        return self._node_source

    def set_node_source(self, source: Optional[NodeSource]) -> None:
        """Read the node from ``source`` from now on (None: as the environment says, the real node
        unless ``OFFLOAD_SIMULATED_NODE`` is set): tests and benchmarks simulate a node so."""
        with self._lock:
            self._node_source, self.node, self._node_read_at = source, None, -1.0
            if source is not None:
                source.note_held(self.held_bytes - self.pending_bytes)  # what this process holds

    def read_node(self, max_age_s: float = 0.0) -> NodeMemory:
        """Read the node's memory now (unless a read is at most ``max_age_s`` old): the pool is
        about to grow, or a plan is being made."""
        now = time.monotonic()
        if self.node is not None and now - self._node_read_at <= max_age_s:
            return self.node
        node = self.node_source.read()
        with self._lock:
            self.node, self._node_read_at = node, now
            self._node_free = node.available_bytes - node.floor_bytes - self.pending_bytes
        return node

    @property
    def free_bytes(self) -> int:
        """What the budget and the node (as last read) still allow (0 when below what is held).

        Read without the lock on the pack path: a few int reads, at worst one charge stale, and
        the charge itself (:meth:`HostAccount.try_charge`) is checked under the lock.
        """
        return max(0, min(self.budget_bytes - self.held_bytes, self._node_free))

    def node_room(self, own_held: int = 0, own_pending: int = 0) -> int:
        """What an account holding ``own_held`` bytes (``own_pending`` more being pinned) may hold
        in all by the node as last read: available, less the floor, less what the process's other
        accounts are still pinning, plus its own bytes (already gone from available)."""
        node = self.node if self.node is not None else self.read_node()
        others_pending = self.pending_bytes - own_pending
        return max(0, node.available_bytes - node.floor_bytes - others_pending + own_held)

    def set_budget(self, nbytes: Optional[int], source: str = "set_process_host_budget") -> None:
        """Fix the budget at ``nbytes`` (None: back to the default). Lowering it below what is
        held frees nothing: later charges are refused until enough is given back."""
        if nbytes is None:
            self._fixed = None
            self.read_default()
            return
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(
                f"offload: set_process_host_budget takes None (the default) or a number of bytes "
                f">= 0, got {nbytes!r}"
            )
        with self._lock:
            self._fixed = nbytes
            self.budget_bytes, self.budget_source = nbytes, source

    def read_default(self) -> None:
        """Read the default budget again, unless :meth:`set_budget` fixed one."""
        if self._fixed is not None:
            return
        budget, source = default_host_budget(node=self.read_node())
        with self._lock:
            if self._fixed is None:
                self.budget_bytes, self.budget_source = budget, source

    def open_account(self) -> "HostAccount":
        """A new arena's account (the default budget is read now, unless fixed)."""
        self.read_default()
        return HostAccount(self)

    def snapshot(self) -> dict[str, object]:
        """``held_bytes``, ``pending_bytes``, ``peak_bytes``, ``budget_bytes``, ``budget_source``,
        ``refusals``, ``node_refusals``, and the node as last read: ``node_total_bytes``,
        ``node_available_bytes``, ``node_floor_bytes``, ``node_source`` (None before any read)."""
        with self._lock:
            node = self.node
            return {
                "held_bytes": self.held_bytes,
                "pending_bytes": self.pending_bytes,
                "peak_bytes": self.peak_bytes,
                "budget_bytes": self.budget_bytes,
                "budget_source": self.budget_source,
                "refusals": self.refusals,
                "node_refusals": self.node_refusals,
                "node_total_bytes": node.total_bytes if node else None,
                "node_available_bytes": node.available_bytes if node else None,
                "node_floor_bytes": node.floor_bytes if node else None,
                "node_source": node.source if node else None,
            }

    def reset_peak(self) -> None:
        """Start the peak again from what is held now (tests, benchmarks)."""
        with self._lock:
            self.peak_bytes = self.held_bytes


class HostAccount:
    """One arena's share of the ledger: what it has charged (``charged``; ``pending`` of it for
    blocks queued or being pinned), so that it can all be refunded."""

    def __init__(self, ledger: HostLedger) -> None:
        self.ledger = ledger
        self.charged = 0
        self.pending = 0

    def try_charge(self, nbytes: int) -> bool:
        """Charge ``nbytes`` if the process budget and the node (read now) have room for them;
        False (nothing charged) if not."""
        ledger = self.ledger
        ledger.read_node(NODE_READ_MAX_AGE_S)
        with ledger._lock:
            if ledger.held_bytes + nbytes > ledger.budget_bytes:
                ledger.refusals += 1
                return False
            if nbytes > ledger._node_free:
                ledger.refusals += 1
                ledger.node_refusals += 1
                return False
            self._add(nbytes)
            return True

    def adjust(self, delta: int) -> None:
        """Charge (``delta`` > 0) or refund (< 0) unconditionally: a block turned out to hold
        more or fewer bytes than charged for it."""
        with self.ledger._lock:
            self._add(delta)

    def refund(self, nbytes: int) -> None:
        """Give back ``nbytes`` of this account's charge (a block freed, a request given up)."""
        with self.ledger._lock:
            self._add(-nbytes)

    def mark_pending(self, nbytes: int) -> None:
        """``nbytes`` of the charge are for a block queued on the pinner (> 0), or no longer (< 0:
        it exists now, or was given up; a refund or adjustment of the charge comes separately)."""
        with self.ledger._lock:
            self.pending += nbytes
            self.ledger.pending_bytes += nbytes
            self._publish()

    def close(self) -> None:
        """Refund everything still charged (the arena is gone, and its blocks with it)."""
        with self.ledger._lock:
            self.ledger.pending_bytes -= self.pending
            self.pending = 0
            self._add(-self.charged)

    def _add(self, delta: int) -> None:
        # Called with the ledger's lock held.
        ledger = self.ledger
        self.charged += delta
        ledger.held_bytes += delta
        ledger._node_free -= delta  # a charge takes from the node's room, a refund gives back
        if ledger.held_bytes > ledger.peak_bytes:
            ledger.peak_bytes = ledger.held_bytes
        self._publish()

    def _publish(self) -> None:
        # Called with the ledger's lock held: what the process really holds, for a node that
        # must be told (a simulated one; the real node's kernel counts pages itself).
        ledger = self.ledger
        source = ledger._node_source
        if source is not None:
            source.note_held(ledger.held_bytes - ledger.pending_bytes)


# The process's one ledger: host memory is a process-wide resource, so its account is too.
_PROCESS_LEDGER = HostLedger()


def process_ledger() -> HostLedger:
    """The ledger every arena of this process charges (unless it was given its own)."""
    return _PROCESS_LEDGER


def set_process_host_budget(nbytes: Optional[int]) -> None:
    """Cap the host memory all offload contexts of this process hold together at ``nbytes``;
    None restores the default (the node's total less the floor left for others, divided by
    ``LOCAL_WORLD_SIZE``). A context's own ``host_budget_bytes`` still caps that context within
    it, the node's room (what it has available, less the floor) bounds both, and plans are made
    for the least of the three."""
    _PROCESS_LEDGER.set_budget(nbytes)


def process_host_memory() -> dict[str, object]:
    """The process's figures: host bytes held by all offload arenas now and at peak, the
    budget and where it came from, how many charges it refused, and the node as last read
    (:meth:`HostLedger.snapshot`)."""
    return _PROCESS_LEDGER.snapshot()
