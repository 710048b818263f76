"""How much host memory the arena may hold for its plans, and how much a plan may count on.

**What the plans need bounds what is held.** A plan says which regions its steps copy into
(:meth:`offload.engine.schedules.planned.PlannedSchedule.region_bytes`); their blocks, as the
allocator holds them, are the plan's *need*. With plans per batch shape, the arena keeps idle
blocks between steps so that each shape's plan finds its own; what it holds (in use, idle and
being pinned) is bounded by the needs of the last :data:`PLANS_REMEMBERED` plans put in force,
added up (one plan runs at a time, and a block that serves two plans is held once, so what is
held is at most that), plus a slack:

    slack = max(PLAN_SLACK_FRACTION x need, PLAN_SLACK_MIN_BYTES)    (25%, at least 256 MiB)

The slack covers what a plan's figures cannot know exactly: its regions are predicted from the
probe's profile at the bucket's shape (the per-shape byte model can be off by tens of percent on
small layers, issue 48), blocks are reused for requests of half their size up to all of it
(``REUSE_SLACK``), and a guessed block has 1/8 headroom. Idle blocks beyond the bound are dropped,
least recently used first (those the newest plan cannot use before those it can), when a plan is
put in force, at the end of a step, and before the pool grows; nothing is pinned ahead beyond it.
A group that needs a region *now* is not refused for the bound (its plan was wrong, and the GPU
may have no room for it): the node's room and the budgets refuse it, or not.

**One host figure feeds the planner** (:class:`HostRoom`): the least of the context's own cap
(``host_budget_bytes`` or its default), the process's budget less what its other contexts hold
(``set_process_host_budget``), and the node's room (available less the floor, plus what this
arena holds: :meth:`offload.host.ledger.HostLedger.node_room`), read when the plan is made. So a
plan never counts on copies the arena would then refuse: it keeps or recomputes instead. Plans
compare it with the bytes they copy; the blocks hold more than that (the allocator's rounding),
so the figure is divided by the allocator's worst rounding (:func:`plan_data_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .ledger import NODE_READ_MAX_AGE_S, HostAccount, HostLedger
from .node import NodeMemory, size_text

PLAN_SLACK_FRACTION = 0.25
PLAN_SLACK_MIN_BYTES = 256 << 20
PLANS_REMEMBERED = 8
# Worst ratio of bytes held to bytes requested, per allocator: torch's pinned allocator rounds
# to a power of two (up to 2x); the native extension to 2 MiB huge pages from 8 MiB (up to 1.25x)
# and 4 KiB below; plain host memory (the ``cpu`` transport) holds what it is asked.
ROUNDING_TORCH_PINNED = 2.0
ROUNDING_NATIVE = 1.25


def plan_slack(need: int) -> int:
    """The bytes the arena may hold beyond a plan's ``need`` (see the module docstring)."""
    return max(int(PLAN_SLACK_FRACTION * need), PLAN_SLACK_MIN_BYTES)


def worst_rounding(*, pinned: bool, native_live: bool, own_allocator: bool = False) -> float:
    """The most a block can hold per byte asked for, with this allocator (a test's own: 1)."""
    if not pinned or own_allocator:
        return 1.0
    return ROUNDING_NATIVE if native_live else ROUNDING_TORCH_PINNED


def plan_data_bytes(held_bytes: int, rounding: float) -> int:
    """The bytes a plan may copy when its blocks may hold ``held_bytes``."""
    return max(0, int(held_bytes / rounding))


def fit_within(sizes: list[int], room: int, held: Callable[[int], int]) -> list[int]:
    """Of ``sizes`` (largest first: the biggest regions cost the most to pin late), those that
    fit in ``room`` bytes together, each holding ``held(size)``."""
    fitting = []
    for size in sizes:
        if held(size) <= room:
            fitting.append(size)
            room -= held(size)
    return fitting


class PlanNeeds:
    """The blocks of the plans put in force lately, newest first, and the bound they set.
    ``held(size)``: the bytes a block of ``size`` holds (the allocator's rounding)."""

    def __init__(self, held: Callable[[int], int] = lambda n: n) -> None:
        self._needs: list[tuple[tuple[int, ...], int]] = []
        self._held = held

    def note(self, blocks: tuple[int, ...]) -> None:
        """A plan whose regions take ``blocks`` (sorted sizes) is in force."""
        need = sum(self._held(size) for size in blocks)
        self._needs = [(blocks, need)] + [entry for entry in self._needs if entry[0] != blocks]
        del self._needs[PLANS_REMEMBERED:]

    @property
    def latest(self) -> Optional[int]:
        """The need of the plan in force: the bytes its blocks hold (None: no plan yet)."""
        return self._needs[0][1] if self._needs else None

    @property
    def cap(self) -> Optional[int]:
        """The bytes the arena may hold: the needs of the plans remembered together, plus a
        slack (None: no plan yet, no bound but the budgets and the node). The plans of a stream
        of length buckets run in turn; each finds its blocks held, whichever it shares with
        another (a bound of the largest need alone dropped the other buckets' blocks, and their
        next steps pinned them again on the step's thread: issue 50 s2, up to 2.1 s of a 0.32 s
        step)."""
        if not self._needs:
            return None
        need = sum(n for _, n in self._needs)
        return need + plan_slack(need)


@dataclass(frozen=True)
class HostRoom:
    """What the arena may hold in all when a plan is made, which bound set it, and the node."""

    held_bytes: int
    binding: str
    node: NodeMemory

    def describe(self) -> str:
        """E.g. ``9.6 GiB held at most (the node's room: ...; node 64.0 GiB, 25.6 GiB available, ...)``."""
        return f"{size_text(self.held_bytes)} held at most ({self.binding}; {self.node.describe()})"


def least_room(ledger: HostLedger, cap: tuple[int, str], own_held: int, account: HostAccount) -> HostRoom:
    """What an arena may hold in all now: the least of its own ``cap`` (bytes, source), the
    process's budget less what its other arenas hold, and the node's room (read now) counting
    the ``own_held`` bytes of its blocks as its own; named by the one that binds."""
    node = ledger.read_node()
    process = ledger.budget_bytes - (ledger.held_bytes - account.charged)
    held, binding = min([cap, (process, f"the process's host budget, {ledger.budget_source}, less its other contexts'"),
                         (ledger.node_room(own_held, account.pending), "the node's room: available less the floor")],
                        key=lambda entry: entry[0])
    return HostRoom(max(0, held), binding, node)


def node_refusal_message(nbytes: int, node: NodeMemory, own_held: int) -> str:
    """The warning when the node has no room for ``nbytes`` more: the figures, and what to do."""
    return (
        f"offload: {nbytes} more bytes of host memory would leave the node less than its floor "
        f"of {node.floor_bytes} bytes for the OS and other processes ({node.available_bytes} "
        f"bytes available of {node.total_bytes}, {node.source}; this context holds {own_held}). "
        "Pinned memory cannot be swapped out: taking it could end this job or another through "
        "the kernel's OOM killer. What does not fit stays on the GPU (stats kept['budget']); "
        "plans made from now on keep or recompute instead. To offload more, free host memory on "
        "the node (other jobs, notebooks, dataloader workers), or run fewer jobs per node."
    )


def ledger_refusal(ledger: HostLedger, nbytes: int, own_held: int) -> tuple[bool, str]:
    """Why ``ledger`` refused ``nbytes`` more to an account holding ``own_held``: (whether the
    node's room did, not the process's budget; the message that says so and what to do)."""
    # Whichever bound is the tighter one refused: compared with each other, not with ``nbytes``
    # (the charge may be rounded up by the allocator past what the caller asked for).
    ledger.read_node(NODE_READ_MAX_AGE_S)
    if ledger.node_room() < ledger.budget_bytes - ledger.held_bytes:
        return True, node_refusal_message(nbytes, ledger.read_node(NODE_READ_MAX_AGE_S), own_held)
    return False, (
        f"offload: {nbytes} more bytes of host memory would take this process over its host "
        f"budget of {ledger.budget_bytes} bytes ({ledger.budget_source}), shared by every "
        f"offload context of the process ({ledger.held_bytes} held, {own_held} of them by this "
        "context): what does not fit stays on the GPU (stats kept['budget']). close() the "
        "contexts you are done with (or drop them), reserve less, or raise the budget with "
        "offload.host.ledger.set_process_host_budget(nbytes)."
    )


def plan_limited_message(wanted: int, planned: int, room: HostRoom, rounding: float) -> str:
    """The warning when the host room made a plan copy less than it would have."""
    return (
        f"offload: the host room limits the plan: it would copy {wanted} bytes to the host, but "
        f"the arena may hold {room.held_bytes} bytes ({room.binding}; {room.node.describe()}"
        + (f"; blocks may hold up to {rounding:g}x what they are asked" if rounding > 1 else "")
        + f"), so it copies {planned} and keeps or recomputes the rest (slower, never refused). "
        "To let it offload more: free host memory on the node (other jobs, notebooks, dataloader "
        "workers), run fewer jobs per node, or raise the bound named."
    )


def host_figures(needs: PlanNeeds, peak_bytes: int, ledger: HostLedger) -> dict[str, Optional[int]]:
    """An arena's host figures for its stats (``offload.engine.stats.StepStats`` documents the keys)."""
    node = ledger.node
    return {
        "host_needed_bytes": needs.latest,
        "host_bound_bytes": needs.cap,
        "host_peak_bytes": peak_bytes,
        "host_node_available_bytes": node.available_bytes if node is not None else None,
        "host_node_floor_bytes": node.floor_bytes if node is not None else None,
    }
