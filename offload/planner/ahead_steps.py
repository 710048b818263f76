"""The context's side of plans made ahead (:mod:`offload.planner.ahead`): what
:class:`offload.plan_steps.PlannedSteps` does when a planned step meets a bucket new to the plan
group with ``plan_ahead`` on. The stand-in is found and the bucket's own plan queued on the main
thread, with the budget read here (the "device" budget asks CUDA, the search never does); the
plan is put in force at the step every rank agreed it ready; a making that failed is raised at
the bucket's next step on every rank. What each step followed is written to :attr:`last_plan`
and, per event, to the plans' log the plan report ends with.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Iterable, Optional, Union

from ..engine.schedules.planned import PlannedSchedule
from .agree import agree_max
from .ahead import NO_STAND_INS, Made, PlansAhead, StandIn, StandIns, make_ahead, stand_ins
from .budget import DEVICE
from .actions import Action
from .make import LOWEST, choose
from .model import simulate
from .scaling import profile_at
from .search import BudgetError
from .sequence import grow_allocator
from .shapes import StepShape
from .types import LayerPlan, Plan

__all__ = ["AheadSteps", "check_plan_ahead", "FIRST_STAND_IN"]

FIRST_STAND_IN = "few host blocks (keep and recompute)"


def check_plan_ahead(api: str, value: Any) -> Union[None, bool, tuple[int, ...]]:
    """``plan_ahead`` as given: None (the default), True, False, or the sequence lengths whose
    buckets to plan ahead (ints >= 1; a tuple). Raises TypeError saying what it takes."""
    if value is None or isinstance(value, bool):
        return value
    lengths = tuple(value) if isinstance(value, Iterable) and not isinstance(value, (str, bytes)) else None
    if lengths is None or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in lengths):
        raise TypeError(f"offload: {api}: plan_ahead must be True, False or the sequence lengths whose plans to "
                        f"make ahead (ints >= 1), got {value!r}")
    return lengths


class AheadSteps:
    """Plans made ahead, for :class:`offload.plan_steps.PlannedSteps` (which holds the budget,
    the plans per bucket and the engine these methods read)."""

    # Set by PlannedSteps.
    engine: Any
    budget: Any
    profile: Any
    head: Any
    _plans: dict
    _agreed: set
    _cap: Optional[int]
    _lowered: str
    _host_figure: Optional[int]
    _step_index: Optional[int]
    _shape: Optional[StepShape]
    _expandable: bool
    costs: Any  # offload.planner.first_steps.FirstSteps
    _pin: Callable[[list[int]], None]

    def _init_ahead(self, plan_ahead: Union[bool, tuple[int, ...]]) -> None:
        arena = self.engine.arena
        self._ahead = PlansAhead(
            lambda made: arena.pin_for_plan(PlannedSchedule(made, made.profile).region_bytes(), hold_idle=True),
            lambda: arena.settle() or arena.counters.bytes_pending == 0) if plan_ahead is not False else None
        # Lengths whose buckets are planned ahead as soon as a first plan is in force.
        self._known = plan_ahead if isinstance(plan_ahead, tuple) else ()
        self._first: Optional[Made] = None  # the first plan, made on this thread, while its stand-in is agreed
        self._made_at: Optional[int] = None  # the step it was made at (the log's)
        # The last planned step's bucket, whether it was new, its plan ("own" or "stand-in") and
        # the seconds its plan took on this thread (benchmarks/varlen.py records them).
        self.last_plan: dict[str, Any] = {}

    def ahead_log(self) -> list[str]:
        """Which steps ran a stand-in, and when each bucket's own plan came (empty without
        ``plan_ahead``)."""
        return list(self._ahead.log) if self._ahead is not None else []

    def _note(self, bucket: StepShape, new: bool, standing: Optional[StandIn], started: float) -> float:
        # What this step followed, for benchmarks/varlen.py, and the seconds it took here: the
        # report's planning time when the bucket is new to the group (0 otherwise).
        seconds = time.perf_counter() - started
        self.last_plan = {"bucket": (bucket.batch, bucket.length), "new": new, "seconds": seconds,
                          "plan": "stand-in" if standing is not None else "own"}
        if standing is not None:
            self.costs.label("stand-in")  # (the first steps' table: not one of its planned steps)
        return seconds if new else 0.0

    # -- plans made ahead (offload.planner.ahead) --------------------------------------------------
    def _budget_read(self) -> tuple[Optional[int], str]:
        # The budget plans are made for now, in bytes (None: the plain step's peak), read here on
        # the main thread (the "device" budget asks CUDA; the cache is not emptied: issue 50 s2),
        # and how it was worked out.
        if self.budget == DEVICE:
            read = self._read_device()  # type: ignore[attr-defined]
            return read.budget_bytes, read.describe() + (" (expandable segments turned on)" if self._expandable else "")
        return (int(self.budget) if self.budget is not None else None), ""

    def _stand_ins(self, bucket: StepShape) -> StandIns:
        # The stand-ins a new bucket's step may follow (offload.planner.ahead.stand_ins), at the
        # budget and host room there are now.
        budget, _ = self._budget_read()
        if self._cap is not None:
            budget = self._cap if budget is None else min(budget, self._cap)
        host = self.engine.arena.plan_host_bytes()
        agreed = {s: p for s, p in self._plans.items() if s in self._agreed}
        options = stand_ins(self.profile, bucket, agreed, budget, host)
        if options.first() is not None:
            self._host_figure = host
        return options

    def _agree_stand_in(self, failed: Optional[BaseException], options: StandIns,
                        standing: Optional[StandIn]) -> tuple[bool, Optional[StandIn]]:
        # One collective where the group meets a new bucket (the "plan fits" point): whether any
        # rank found no plan, and the fastest stand-in every rank can follow (StandIns.agreed),
        # so the ranks follow plans of one shape; where none is, a rank keeps its own (plans may
        # differ between ranks: offload.planner.agree).
        failed_any, *unfit = agree_max(
            [failed is not None, *options.unfit()], self.engine.transport.device,
            self._group, "plan fits")  # type: ignore[attr-defined]
        agreed = options.agreed(unfit)
        if standing is not None and agreed is not None:
            standing = agreed
        elif self._first is not None:
            standing = None  # the first plan's stand-in: on every rank or on none (PlansAhead's entries agree)
        if failed_any:
            self._first = None  # raised: nothing is started
        return bool(failed_any), standing

    def _start_ahead(self, ahead: Optional[PlansAhead], bucket: StepShape, standing: Optional[StandIn],
                     ahead_now: bool) -> None:
        # On every rank alike: a new bucket's stand-in with its own plan made behind it, or its
        # plan made now; the first plan's stand-in while its blocks are pinned; after the first
        # plan (again after an out-of-memory step or a new budget), the known lengths' buckets
        # queued at its batch.
        first, self._first = self._first, None
        if first is not None and standing is not None:
            self._made_at = self._step_index
            # The first plan emptied the cache: the stand-in's pool is grown before the pinner starts
            # registering, so that its step does not wait in cudaMalloc behind each registration.
            grow_allocator(self.engine.transport.device, standing.plan.prediction.peak_bytes)
            self._pin(self._regions(standing.plan))  # (its few blocks first: the pinner's queue is in order)
            ahead.start(bucket, self._step_index, standing, None, first)  # type: ignore[union-attr]
        if ahead_now:
            ahead.start(bucket, self._step_index, standing,  # type: ignore[union-attr]
                        self._maker(bucket) if standing is not None else None)
        elif ahead is not None and len(self._agreed) == 1:
            for top in dict.fromkeys(StepShape(bucket.batch, n).bucket() for n in self._known):
                if top not in self._agreed and top not in ahead.on_main and all(e.bucket != top for e in ahead.started):
                    ahead.start(top, None, None, self._maker(top))

    def _plans_ahead(self) -> Optional[PlansAhead]:
        # The plans made ahead in force now ("lowest" reads the device to tile: planned on this thread).
        return self._ahead if self.budget != LOWEST else None

    def _needs_pinning(self, plan: Plan) -> bool:
        """Whether ``plan``'s host regions are not all served by blocks held (idle or being
        pinned): a pinned arena would pin them on the step's critical path. (A test's fake
        pinner replaces this and :attr:`PlansAhead._pinned`: the CPU arena pins nothing.)"""
        arena = self.engine.arena
        sizes = self._regions(plan)
        return bool(arena.pinned and sizes and arena.unserved(sizes))

    @staticmethod
    def _regions(plan: Plan) -> list[int]:
        return PlannedSchedule(plan, plan.profile).region_bytes()

    def _first_options(self, ahead: Optional[PlansAhead], bucket: StepShape, own: Plan) -> StandIns:
        # The first plan (after the probe steps, an out-of-memory step or a new budget), made on
        # this thread: where its host blocks are not held, its steps follow a stand-in until they
        # are pinned in the background, and every rank switches together (PlansAhead's readiness
        # agreement). Pinning ~150 GiB at ~5 GB/s is 30 s: off the critical path (issue 50 s1,
        # T14). The stand-in copies what the idle blocks held hold, else no more than every layer
        # recomputed copies (a recomputed layer's inputs go to the host too: ~1/20 of the own
        # plan's bytes on LLAMA shapes), its blocks pinned first, as its copies come. None where
        # nothing needs pinning, or no such plan fits, or it would copy as much as the own plan.
        self._first = None
        if ahead is None or self._agreed or bucket in ahead.on_main:
            return NO_STAND_INS
        self._first = Made(own, self._host_figure or 0, None, 0.0, background=False)
        if not self._needs_pinning(own):
            return NO_STAND_INS
        arena = self.engine.arena
        idle = max(0, arena.counters.bytes_held - arena.counters.bytes_in_use)
        emptied = self.engine.transport.device.type == "cuda" and (self.budget == DEVICE or self._cap is not None)
        plan = self._least_copying(profile_at(self.profile, bucket), idle, emptied)
        if plan is None or plan.prediction.d2h_bytes >= own.prediction.d2h_bytes:
            return NO_STAND_INS  # the own plan at once, as without plans ahead
        reason = f"a stand-in while this plan's host blocks are pinned: {FIRST_STAND_IN}; {own.budget_reason}"
        return StandIns(None, None, StandIn(dataclasses.replace(plan, budget_reason=reason), FIRST_STAND_IN, bucket))

    def _least_copying(self, at: Any, idle: Optional[int] = None, emptied: bool = False) -> Optional[Plan]:
        # The fastest plan of profile ``at`` under the budget that copies no more than ``idle``
        # bytes (the idle blocks held), else no more than every layer recomputed copies (and the
        # host room); None where neither fits. ``emptied``: as for choose (the first plan's _make
        # emptied the cache). With no host bytes, recomputed layers keep their inputs (a stand-in
        # then copies nothing and waits for no block). Strict: a stand-in is optional, so none is
        # followed over the budget (the own plan runs instead); the lowest keep-and-recompute plan
        # a little over it ran out of memory on the H200 (LLAMA-8B shape, 16384, 80 GB cap: 76.9
        # GiB predicted, 75.9 budget).
        device = self.engine.transport.device
        least = min(simulate(at, [LayerPlan(Action.RECOMPUTE)] * len(at.layers), None).d2h_bytes,
                    self.engine.arena.plan_host_bytes())
        for host in dict.fromkeys(h for h in (idle, least) if h is not None):
            try:
                return self.costs.timed("search", lambda: choose(
                    at, self.budget, device, cap_bytes=self._cap, expandable=self._expandable, emptied=emptied,
                    head=self.head, host_budget=host, note_host=False, strict=True))
            except (BudgetError, ValueError):
                pass
        return None

    def _stand_in_fits(self, sizing: Any) -> bool:
        """Whether, on the sizing step's figures, the first plan could follow a stand-in while its
        blocks are pinned (plans ahead): then nothing is pinned beside the probe steps, and the
        measured step waits for nothing; else its blocks are pinned ahead, as without."""
        return self._plans_ahead() is not None and sizing.shape is not None and \
            self._least_copying(sizing) is not None

    def _maker(self, bucket: StepShape) -> Callable[[], Made]:
        budget, reason = self._budget_read()
        return functools.partial(make_ahead, self.profile, bucket, budget, self._cap, self.head,
                                 self.engine.arena.plan_host_bytes(), reason)

    def _adopt(self, bucket: StepShape, made: Made) -> None:
        # Every rank has the bucket's own plan made and pinned: it is put in force from this step.
        plan = made.plan
        if self._lowered:
            plan = dataclasses.replace(plan, budget_reason=f"{plan.budget_reason}; {self._lowered}")
        self._plans[bucket] = plan
        self._host_figure = made.host_bytes
        if made.limited is not None:
            self.engine.arena.plan_limited(*made.limited)
        where = f"in the background in {made.seconds:.2f} s" if made.background else f"at step {self._made_at}"
        self._ahead.log.append(f"step {self._step_index}: {bucket} follows its own plan from here "  # type: ignore[union-attr]
                               f"(made {where}, its blocks pinned)")

    def _raise_failed_ahead(self, ahead: PlansAhead, bucket: StepShape, shape: StepShape) -> None:
        # A making failed on some rank: every rank raises here, before any layer ran, and the
        # bucket's next step is planned on this thread (raising again if nothing fits).
        error = ahead.failed.pop(bucket)
        ahead.on_main.add(bucket)
        self._agreed.discard(bucket)
        self._shape = None if self._shape == bucket else self._shape
        where = " (made in the background while a stand-in ran)"
        if isinstance(error, BudgetError):
            raise self._no_fit(error, bucket, shape, where)  # type: ignore[attr-defined]
        if error is not None:
            raise RuntimeError(f"offload: making the plan for a step of {bucket}{where} failed: {error!r}") from error
        raise BudgetError(f"offload: another rank found no plan for a step of {bucket}{where}; see its error")

