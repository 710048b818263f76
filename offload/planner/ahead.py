"""Plans made ahead: a new length bucket's first steps follow a stand-in while its own plan is
made off the critical path (issue 50 s2).

A bucket's own plan costs a search (0.45 s for 16 layers, 2 s for 32 with selective variants)
and the pinning of its new host blocks (0.5 to 1.1 s on the H200): on its first step that was 2-5x
the bucket's steady step. Instead, a step of a bucket new to the plan group (the first planned
step's too: the plan after the probe steps cost its step 0.17-0.40 s of search on the H200, and
its blocks' pinning came beside it):

- follows a **stand-in** found with no search and no new pinning (:func:`stand_ins`): every
  layer kept (the plain step: nothing recomputed, nothing copied), where its predicted peak at
  this bucket is within the budget (a short bucket's own plan is then the same: LLAMA-1B's
  2048-token step, 150 ms under its own plan, took 456 ms recomputing every layer instead, on
  the H200); else the plan of
  the smallest bucket already planned that covers it (same batch, longer: its blocks are pinned,
  and a plan for a longer step holds for a shorter one), re-checked at this bucket by the cost
  model (one ``simulate``: predicted peak within the budget, host bytes within the room); else
  the most of the last layers kept that fit, the others recomputed with their inputs kept
  (gradient checkpointing with the room to spare used: on the H200 the first plan's stand-in at
  LLAMA-1B's 4096 kept 6 of 16, at 8192 one); else every layer recomputed at this bucket, its
  inputs kept on the GPU where that fits (gradient checkpointing: nothing copied, no host block
  to wait for beside the own plan's pinning), else sent to the host (one ``simulate`` each),
  where that fits; else none, and the bucket is planned now, as without plans ahead. The ranks
  agree on which (the one every rank can follow, with as many layers recomputed as any rank
  must) in the collective they already make at a new bucket ("plan fits");
- has its own plan made on a background thread (:class:`PlansAhead`): the search is pure Python
  on the profile predicted at the bucket (``profile_at``, ``choose`` with the budget read on the
  main thread: nothing there calls into CUDA), then its host blocks are pinned on the arena's
  own pinner, asked from the main thread at a step's entry or its forward's end;
- switches to it at a later step of the bucket, once it is made and its blocks are pinned on
  every rank of the plan group: the ranks agree in the planned step's all-reduce
  (:func:`offload.planner.agree.agree_planned_step`), on the buckets planned ahead in the order
  every rank started them, so all switch at the same step (the min of their readiness);
- a making that failed (``BudgetError``, or any error) is raised at the bucket's next step on every
  rank, before any layer runs; the bucket's steps after that are planned on the main thread.

**Where the search runs.** On CUDA, in a process of its own (:mod:`offload.planner.search_process`):
a search on a thread of the training process takes the interpreter each time a step's thread
dispatches a torch op (every op gives it away while it runs), and the step waits for each. A
search on the worker thread (the fallback, and the CPU default) gives way after each millisecond
of its own work (:class:`Yielding`), which keeps a pure-Python step at its speed but not one that
dispatches ops (``benchmarks/results/plan_search_contention.json``). The same plan comes out
either way.
"""

from __future__ import annotations

import concurrent.futures
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, NamedTuple, Optional, Sequence

import torch

from .actions import Action
from .make import choose
from .model import simulate
from .scaling import profile_at
from .search import plan_for
from .search_process import SearchProcess, SearchProcessError
from .shapes import StepShape
from .tiling import HeadInfo
from .types import LayerPlan, Plan, StepProfile

__all__ = ["Made", "NO_STAND_INS", "PlansAhead", "StandIn", "StandIns", "Yielding", "make_ahead", "some_kept",
           "stand_ins"]

KEPT_STAND_IN = "every layer kept"
SOME_KEPT_STAND_IN = "the last {kept} kept, the others recomputed, inputs kept"
LOWEST_STAND_IN = "every layer recomputed"
LOWEST_KEPT_STAND_IN = "every layer recomputed, inputs kept"


class Yielding:
    """A search's ``pause`` on a background thread (see the module notes): after each
    ``work_s`` of the search's own time, sleep ``sleep_s`` so the step's thread takes the
    interpreter. :attr:`yields` counts the times it gave way."""

    def __init__(self, work_s: float = 1e-3, sleep_s: float = 1e-4) -> None:
        self.work_s, self.sleep_s = work_s, sleep_s
        self.yields = 0
        self._since = time.perf_counter()

    def __call__(self) -> None:
        if time.perf_counter() - self._since >= self.work_s:
            time.sleep(self.sleep_s)  # releases the interpreter; taking it back waits for the step's thread
            self.yields += 1
            self._since = time.perf_counter()


@dataclass(frozen=True)
class StandIn:
    """A plan a new bucket's steps follow while its own is made: ``kind`` says which (for the
    report), ``top`` is the shape it was made for (its size floors scale from there)."""

    plan: Plan
    kind: str
    top: StepShape
    recomputed: int = 0  # the layers the "last layers kept" stand-in recomputes (the ranks agree on the most)


class StandIns(NamedTuple):
    """The stand-ins a new bucket's step may follow, fastest first (None: it does not fit):
    every layer kept, the covering bucket's plan, the last layers kept and the others
    recomputed, every layer recomputed."""

    kept: Optional[StandIn]
    cover: Optional[StandIn]
    some: Optional[StandIn]
    lowest: Optional[StandIn]

    def first(self) -> Optional[StandIn]:
        """The fastest that fits this rank."""
        return next((option for option in self if option is not None), None)

    def unfit(self) -> list[bool]:
        """For each, whether it does not fit this rank (what the ranks agree on)."""
        return [option is None for option in self]

    def recomputed(self) -> int:
        """The layers the "last layers kept" stand-in recomputes here (0: none fits): the ranks
        follow the most any of them must, so that every rank's recomputes are the same layers."""
        return self.some.recomputed if self.some is not None else 0

    def agreed(self, unfit_on_any: Sequence[int]) -> Optional[StandIn]:
        """The fastest that fits every rank, from each one's ``unfit`` agreed by the ranks' max
        (None: none does). Every rank then follows a plan of one shape: recomputing on one and
        not on another would change the collectives a sharded model's layers issue."""
        return next((option for option, unfit in zip(self, unfit_on_any) if not unfit), None)


NO_STAND_INS = StandIns(None, None, None, None)


def stand_ins(profile: StepProfile, bucket: StepShape, plans: Mapping[StepShape, Plan], budget_bytes: Optional[int],
              host_bytes: int) -> StandIns:
    """The plans a step of ``bucket`` may follow now, with no search and no new pinning: every
    layer kept at ``bucket``; the plan of the smallest of ``plans``, the buckets every rank has
    planned, of the same batch that covers ``bucket``; the most of the last layers kept that
    fit, the others recomputed with their inputs kept (:func:`_most_kept`); every layer
    recomputed at ``bucket``, its inputs kept where that fits. Each None unless its predicted
    peak at ``bucket`` is within ``budget_bytes`` (None: the plain step's peak there) and its
    copies within ``host_bytes``. A ``simulate`` or a few each, no search; the same candidates
    on every rank."""
    at = profile_at(profile, bucket)
    budget = at.plain_peak_bytes if budget_bytes is None else budget_bytes

    def fits(plan: Plan) -> bool:
        predicted = simulate(at, plan.layers, budget)
        return predicted.peak_bytes <= budget and predicted.d2h_bytes <= host_bytes

    def at_bucket(layer: LayerPlan, kind: str) -> StandIn:
        plan = plan_for(at, [layer] * len(at.layers), budget)
        return StandIn(replace(plan, budget_reason=f"a stand-in while this bucket's own plan is made: {kind}"), kind, bucket)

    kept = at_bucket(LayerPlan(Action.KEEP), KEPT_STAND_IN)
    kept = kept if fits(kept.plan) else None
    covering = min((s for s in plans if s.batch == bucket.batch and s.length > bucket.length),
                   key=lambda s: s.length, default=None)
    cover = None
    # (A tiled plan's figures are its variant's: not re-checked at another shape.)
    if covering is not None and not plans[covering].tiles() and fits(plans[covering]):
        cover = StandIn(plans[covering], f"bucket {covering.length}'s plan", covering)
    low = None
    for kind, kept_inputs in ((LOWEST_KEPT_STAND_IN, True), (LOWEST_STAND_IN, False)):
        lowest = at_bucket(LayerPlan(Action.RECOMPUTE, keep_inputs=kept_inputs), kind)
        if fits(lowest.plan):
            low = lowest
            break
    some = None
    if low is not None and low.kind == LOWEST_KEPT_STAND_IN:  # (beside "kept": a rank may not fit that one)
        most = _most_kept(len(at.layers), lambda layers: fits(plan_for(at, layers, budget)))
        some = _some_kept(at, bucket, budget, most) if most else None
    return StandIns(kept, cover, some, low)


def some_kept(profile: StepProfile, bucket: StepShape, budget_bytes: Optional[int], recomputed: int) -> StandIn:
    """The "last layers kept" stand-in at ``bucket`` recomputing ``recomputed`` layers (the most
    the ranks agreed on: fewer kept than this rank's own fits it too, a peak only grows with each
    layer kept)."""
    at = profile_at(profile, bucket)
    return _some_kept(at, bucket, at.plain_peak_bytes if budget_bytes is None else budget_bytes,
                      len(at.layers) - recomputed)


def _some_kept(at: StepProfile, bucket: StepShape, budget: int, kept: int) -> StandIn:
    kind = SOME_KEPT_STAND_IN.format(kept="layer" if kept == 1 else f"{kept} layers")
    plan = plan_for(at, _last_kept(len(at.layers), kept), budget)
    return StandIn(replace(plan, budget_reason=f"a stand-in while this bucket's own plan is made: {kind}"), kind, bucket,
                   len(at.layers) - kept)


def _last_kept(layers: int, kept: int) -> list[LayerPlan]:
    """The last ``kept`` of ``layers`` kept, the others recomputed with their inputs kept: what
    gradient checkpointing does with room to spare, nothing copied. The last ones because the
    backward frees them first, before the recomputes' peaks of the layers before them."""
    return [LayerPlan(Action.RECOMPUTE, keep_inputs=True)] * (layers - kept) + [LayerPlan(Action.KEEP)] * kept


def _most_kept(layers: int, fits: Callable[[list[LayerPlan]], bool]) -> int:
    """The most of the last layers :func:`_last_kept` can keep with ``fits`` (0 where keeping
    one does not fit): bisected, a peak grows with each layer kept (log2 of the layers'
    simulations: 5 for 32 layers)."""
    low, high = 0, layers - 1  # (every layer kept is the "kept" stand-in)
    while low < high:
        middle = (low + high + 1) // 2
        if fits(_last_kept(layers, middle)):
            low = middle
        else:
            high = middle - 1
    return low


@dataclass
class Made:
    """What a background making gave: the plan, the host figure it was made for, and the
    (wanted, planned) bytes when that figure bound it (``host_limited``)."""

    plan: Plan
    host_bytes: int
    limited: Optional[tuple[int, int]]
    seconds: float  # the search's own
    # Seconds from being asked to made (the queue before it and the search), and to its blocks
    # pinned: set where it is taken up (PlansAhead.poll), for the plans' log.
    made_after: float = field(default=0.0, compare=False)
    ready_after: float = field(default=0.0, compare=False)


def make_ahead(profile: StepProfile, bucket: StepShape, budget: Optional[int], cap: Optional[int],
               head: Optional[HeadInfo], host_bytes: int, reason: str,
               pause: Optional[Callable[[], None]] = None) -> Made:
    """``bucket``'s own plan, as :func:`~offload.planner.make.choose` makes it, for a background
    thread: ``budget`` in bytes (a "device" budget read on the main thread, ``reason`` its
    description) or None, ``cap`` the ceiling after an out-of-memory step; ``pause`` between
    simulations (default a :class:`Yielding`). Touches no CUDA."""
    started = time.perf_counter()
    limited: list[tuple[int, int]] = []
    plan = choose(profile_at(profile, bucket), budget, None, cap_bytes=cap, head=head, host_budget=host_bytes,
                  host_limited=lambda wanted, planned: limited.append((wanted, planned)), pause=pause or Yielding())
    if reason:
        plan = replace(plan, budget_reason=plan.budget_reason.replace("memory_budget_bytes", reason, 1))
    return Made(plan, host_bytes, limited[0] if limited else None, time.perf_counter() - started)


@dataclass
class _Entry:
    """One bucket planned ahead, in the order every rank started it."""

    bucket: StepShape
    future: Optional[concurrent.futures.Future]  # None: its plan was there already (made on the main thread)
    made: Optional[Made] = None
    error: Optional[BaseException] = None
    pin_asked: bool = False
    regions: list[int] = field(default_factory=list)  # the host region sizes its plan asked for
    ready: bool = False  # made (or failed) and its blocks pinned, on this rank: latched
    adopted: bool = False  # its own plan is in force (made ahead, or on the main thread)
    switched: bool = False  # the group's step of its switch has come (on every rank alike)
    step: Optional[int] = None  # the step it was started at
    stand_in: Optional[StandIn] = field(default=None, repr=False)
    asked: float = field(default_factory=time.perf_counter)  # when it was started (perf_counter)
    made_at: Optional[float] = None  # when its making ended (the worker's done callback)


class PlansAhead:
    """The buckets planned ahead of one context (see the module notes), and their stand-ins.

    ``pin(plan)``: ask for a made plan's host blocks (the arena pins in the background), and
    return the region sizes it asked for; ``pinned(sizes)``: whether blocks serving those are pinned.
    """

    def __init__(self, pin: Callable[[Plan], list[int]], pinned: Callable[[list[int]], bool], *,
                 process: bool = False) -> None:
        self._pin, self._pinned = pin, pinned
        # The searches' own process (offload.planner.search_process), started now: its imports
        # run beside the probe steps. None: searched on the worker thread, giving way.
        self.process: Optional[SearchProcess] = SearchProcess() if process else None
        # One worker: buckets are made in the order started, so readiness grows as a prefix.
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="offload-plan-ahead")
        self.started: list[_Entry] = []  # the same buckets, in the same order, on every rank
        self.failed: dict[StepShape, Optional[BaseException]] = {}  # agreed failed: raised at its next step
        self.on_main: set[StepShape] = set()  # buckets planned on the main thread from now on (a making failed)
        self.log: list[str] = []  # what the report says: which steps ran a stand-in, when the plan came

    def make(self, *args: object) -> Made:
        """:func:`make_ahead` of these arguments, for the worker thread: in the searches' process
        where there is one, else here, giving way to the step's thread. A process that failed is
        said once (a warning and the plans' log), and every later plan is made here."""
        process = self.process
        if process is not None:
            try:
                return process.make(make_ahead, *args)
            except SearchProcessError as exc:
                self.process = None
                said = f"{exc}: plans made ahead are searched on a thread of this process from here (slower steps beside it)"
                self.log.append(said)
                warnings.warn(said, RuntimeWarning, stacklevel=2)
        return make_ahead(*args)  # type: ignore[arg-type]

    def stand_in_of(self, bucket: StepShape) -> Optional[StandIn]:
        """The stand-in ``bucket``'s steps follow until its own plan is in force."""
        return next((e.stand_in for e in self.started if e.bucket == bucket and not e.adopted), None)

    def start(self, bucket: StepShape, step: Optional[int], stand_in: Optional[StandIn],
              make: Optional[Callable[[], Made]]) -> None:
        """``bucket``, new to the group, follows ``stand_in`` while ``make()`` runs in the
        background; or (both None) its plan was made on the main thread: ready at once; or (no
        stand-in, at no step) it is a known bucket queued ahead of its first step. A bucket
        queued already takes the stand-in (its making goes on). Called on every rank at the
        same step."""
        entry = next((e for e in self.started if e.bucket == bucket), None)
        if entry is not None:
            entry.stand_in, entry.adopted = stand_in, entry.adopted or stand_in is None
        else:
            entry = _Entry(bucket, None, step=step, stand_in=stand_in, ready=make is None, adopted=make is None)
            if make is not None:  # (asked before it is submitted: the timings count from there)
                entry.future = self._pool.submit(make)
                entry.future.add_done_callback(lambda _, entry=entry: setattr(entry, "made_at", time.perf_counter()))
            self.started.append(entry)
        if stand_in is not None:
            self.log.append(f"step {step}: {bucket} (new) follows a stand-in, {stand_in.kind}; its own plan is made "
                            "in the background")

    def poll(self) -> None:
        """Between steps, on the main thread: ask for the blocks of the plans made since, and
        latch the ones made and pinned. Not while a CUDA graph is being captured: asking for
        blocks pins new ones and gives idle ones back, driver calls that a capture forbids (they
        would invalidate it), so a plan made during a captured step is taken up at the first
        poll after the capture."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return
        for entry in self.started:
            if entry.ready or entry.future is None or not entry.future.done():
                continue
            if not entry.pin_asked:
                entry.pin_asked = True
                try:
                    entry.made = entry.future.result()
                except BaseException as exc:  # noqa: BLE001  (raised on the main thread, at the bucket's next step)
                    entry.error = exc
                else:
                    entry.regions = self._pin(entry.made.plan)
            entry.ready = entry.error is not None or self._pinned(entry.regions)
            if entry.ready and entry.made is not None:
                made_at = entry.made_at if entry.made_at is not None else time.perf_counter()
                entry.made = replace(entry.made, made_after=made_at - entry.asked,
                                     ready_after=time.perf_counter() - entry.asked)

    def values(self) -> tuple[int, int]:
        """This rank's ``(behind, failed)`` for :func:`~offload.planner.agree.agree_planned_step`."""
        self.poll()
        ready = next((i for i, e in enumerate(self.started) if not e.ready), len(self.started))
        failed = next((i for i, e in enumerate(self.started[:ready]) if e.error is not None), None)
        return len(self.started) - ready, (len(self.started) - failed if failed is not None else 0)

    def agree(self, behind: int, failed: int) -> list[_Entry]:
        """Act on the group's figures: the first bucket whose making failed on any rank goes to
        :attr:`failed`; returns the entries ready on every rank (those before it, then: a later
        one may have failed on some rank too, which the next step's figures say)."""
        ready = len(self.started) - behind
        if failed:
            # The first failed on any rank, maybe still in flight on another: every rank raises.
            index = len(self.started) - failed
            entry = self.started.pop(index)
            self.failed[entry.bucket] = entry.error  # None: it failed on another rank
            ready = min(ready, index)
        return self.started[:ready]

    def switch(self, bucket: StepShape, behind: int, failed: int) -> tuple[Optional[Made], bool]:
        """After the planned step's all-reduce: ``bucket``'s own plan, made ahead, when every rank
        has it ready and it was not put in force yet (its stand-in is then dropped); and whether
        this is the group's step of that switch, the same on every rank (a rank that planned the
        bucket on its own thread, where another followed a stand-in, switches to nothing then)."""
        for entry in self.agree(behind, failed):
            if entry.bucket == bucket and not entry.switched:
                entry.switched = True
                if entry.adopted or entry.made is None:
                    return None, True
                entry.stand_in, entry.adopted = None, True
                return entry.made, True
        return None, False

    def clear(self) -> None:
        """Forget every bucket (the budget changed, or a rank ran out of memory: every rank plans
        again); a making in flight finishes unused."""
        for entry in self.started:
            if entry.future is not None:
                entry.future.cancel()
        self.started.clear()
        self.failed.clear()
        self.on_main.clear()
