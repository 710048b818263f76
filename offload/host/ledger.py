"""One account of the host memory offload holds in this process, shared by every arena.

Why: each context's arena caps what it holds (``host_budget_bytes``), and its default cap is the
whole share of the node (:func:`default_host_budget`). But a process may run several contexts,
one after another (a fixed count, then plans) or side by side (a context per model or thread),
and contexts that each stay within their own cap can together lock more than the host has.
Pinned memory cannot be swapped out, so the kernel's OOM killer then ends the process instead of
anything raising. The ledger is where the bytes of every arena add up against one budget.

How it is kept: an arena charges its account (:class:`HostAccount`) *before* it allocates a
block or queues one on the background pinner, with the bytes the allocator will really hold
(page and power-of-two rounding included, :func:`offload.host.pinning.expected_held_bytes`), adjusts
the charge to the block's real bytes once it exists, and refunds it when it frees the block. A
charge the ledger refuses is a refusal like the arena's own budget: the group stays on the GPU
(``kept["budget"]``), nothing is lost. The account remembers its own charge, so an arena
garbage-collected without ``close()`` refunds everything it still held.

The ledger counts offload's arenas only, whatever allocator is behind them (the native
extension's registered memory, torch's pinned allocator without it, plain host memory on the
``cpu`` transport), not other pinned memory of the process (a DataLoader's pinned batches). It
knows amounts, never the arenas: no registry of contexts is kept.
"""

from __future__ import annotations

import os
import threading
from typing import Mapping, Optional

import psutil

HOST_BUDGET_FRACTION = 0.75
LOCAL_RANKS_ENV_VAR = "LOCAL_WORLD_SIZE"  # set by torchrun (and most launchers) on every rank


def default_host_budget(environ: Optional[Mapping[str, str]] = None) -> tuple[int, str]:
    """The host budget of a context given none, and where it came from.

    Three quarters of the host's *total* RAM, divided among the processes of this node
    (``LOCAL_WORLD_SIZE``, 1 when unset). Total, not available: what happens to be free when a
    process starts depends on what ran before it, and eight ranks each taking 75% of what is
    free would together lock more than the node has (pinned memory cannot be swapped out).
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
    total = psutil.virtual_memory().total
    budget = int(total * HOST_BUDGET_FRACTION) // ranks
    gib = total / (1 << 30)
    return budget, f"{HOST_BUDGET_FRACTION:.0%} of total RAM ({gib:.1f} GiB) / {LOCAL_RANKS_ENV_VAR}={ranks}"


class HostLedger:
    """Host bytes held by every arena of the process, against one budget.

    The budget is :func:`default_host_budget` (read again each time an arena opens an account,
    so it follows ``LOCAL_WORLD_SIZE``) unless :meth:`set_budget` fixed it.
    """

    def __init__(self) -> None:
        # Charges come from the forward thread, the pinner thread and Group.__del__ (autograd's
        # threads): one lock for the ledger and all its accounts.
        self._lock = threading.Lock()
        self._fixed: Optional[int] = None
        self.budget_bytes = 0
        self.budget_source = "not read yet (no arena opened)"
        self.held_bytes = 0
        self.peak_bytes = 0
        self.refusals = 0

    @property
    def free_bytes(self) -> int:
        """What the budget still allows (0 when a lowered budget is below what is held).

        Read without the lock on the pack path: two int reads, at worst one charge stale, and
        the charge itself (:meth:`HostAccount.try_charge`) is checked under the lock.
        """
        return max(0, self.budget_bytes - self.held_bytes)

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
        budget, source = default_host_budget()
        with self._lock:
            if self._fixed is None:
                self.budget_bytes, self.budget_source = budget, source

    def open_account(self) -> "HostAccount":
        """A new arena's account (the default budget is read now, unless fixed)."""
        self.read_default()
        return HostAccount(self)

    def snapshot(self) -> dict[str, object]:
        """``held_bytes``, ``peak_bytes``, ``budget_bytes``, ``budget_source``, ``refusals``."""
        with self._lock:
            return {
                "held_bytes": self.held_bytes,
                "peak_bytes": self.peak_bytes,
                "budget_bytes": self.budget_bytes,
                "budget_source": self.budget_source,
                "refusals": self.refusals,
            }

    def reset_peak(self) -> None:
        """Start the peak again from what is held now (tests, benchmarks)."""
        with self._lock:
            self.peak_bytes = self.held_bytes


class HostAccount:
    """One arena's share of the ledger: what it has charged, so that it can all be refunded."""

    def __init__(self, ledger: HostLedger) -> None:
        self.ledger = ledger
        self.charged = 0

    def try_charge(self, nbytes: int) -> bool:
        """Charge ``nbytes`` if the process budget has room for them; False (nothing charged)
        if not."""
        ledger = self.ledger
        with ledger._lock:
            if ledger.held_bytes + nbytes > ledger.budget_bytes:
                ledger.refusals += 1
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

    def close(self) -> None:
        """Refund everything still charged (the arena is gone, and its blocks with it)."""
        with self.ledger._lock:
            self._add(-self.charged)

    def _add(self, delta: int) -> None:
        # Called with the ledger's lock held.
        ledger = self.ledger
        self.charged += delta
        ledger.held_bytes += delta
        if ledger.held_bytes > ledger.peak_bytes:
            ledger.peak_bytes = ledger.held_bytes


# The process's one ledger: host memory is a process-wide resource, so its account is too.
_PROCESS_LEDGER = HostLedger()


def process_ledger() -> HostLedger:
    """The ledger every arena of this process charges (unless it was given its own)."""
    return _PROCESS_LEDGER


def set_process_host_budget(nbytes: Optional[int]) -> None:
    """Cap the host memory all offload contexts of this process hold together at ``nbytes``;
    None restores the default (75% of total RAM / ``LOCAL_WORLD_SIZE``). A context's own
    ``host_budget_bytes`` still caps that context within it."""
    _PROCESS_LEDGER.set_budget(nbytes)


def process_host_memory() -> dict[str, object]:
    """The process's figures: host bytes held by all offload arenas now and at peak, the
    budget and where it came from, and how many charges it refused."""
    return _PROCESS_LEDGER.snapshot()
