"""The context's side of plans made ahead (:mod:`offload.planner.ahead`): what
:class:`offload.plan_steps.PlannedSteps` does when a planned step meets a bucket new to the plan
group with ``plan_ahead`` on, the first one after the probe steps included. The stand-in is found
and the bucket's own plan queued on the main thread, with the budget read here (the "device"
budget asks CUDA, the search never does); the plan is put in force at the step every rank agreed
it ready; a making that failed is raised at the bucket's next step on every rank. What each step
followed is written to :attr:`last_plan` and, per event, to the plans' log the plan report ends
with.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Iterable, Optional, Union

import torch

from ..engine.schedules.planned import PlannedSchedule
from .actions import Action
from .agree import agree_layers, agree_max, follow_layers
from .ahead import Made, PlansAhead, StandIn, StandIns, some_kept, stand_ins
from .budget import DEVICE
from .make import LOWEST
from .scaling import profile_shape
from .search import BudgetError
from .search_process import process_wanted
from .shapes import StepShape
from .types import Plan, StepProfile

__all__ = ["AheadSteps", "check_plan_ahead"]

# The budget a bucket's plans are made for, in bytes (None: the plain step's peak), and how it
# was worked out (the plan's ``budget_reason``; empty: as given).
BudgetRead = tuple[Optional[int], str]
# How many of the measured probe steps' shapes are planned ahead (the auto probe measures at most two).
SEEN_SHAPES = 2


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
        def pin(plan: Plan) -> list[int]:
            sizes = PlannedSchedule(plan, plan.profile).region_bytes()
            arena.pin_for_plan(sizes, hold_idle=True)
            return sizes

        # A plan is ready once idle blocks serve its regions, or nothing is being pinned (what did
        # not fit the host's room is copied nowhere: the plan was made for that room); not only
        # once every plan's blocks are: the first plan's would wait behind the blocks of the
        # buckets queued after it. On CUDA the searches run in a process of their own.
        self._ahead = PlansAhead(
            pin, lambda sizes: arena.settle() or arena.counters.bytes_pending == 0 or not arena.unserved(sizes, pending=False),
            process=process_wanted(self.engine.transport.device.type == "cuda"),
        ) if plan_ahead is not False else None
        # Lengths whose buckets are planned ahead as soon as a first plan is in force.
        self._known = plan_ahead if isinstance(plan_ahead, tuple) else ()
        # The shapes the measured probe steps ran (the stream's first batches): their buckets are
        # planned ahead too, as soon as a first plan is in force.
        self._seen: list[StepShape] = []
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
    def _budget_read(self, emptied: bool = False) -> BudgetRead:
        # The budget plans are made for now, read here on the main thread (the "device" budget
        # asks CUDA; ``emptied``: just after the cache was emptied, see _read_for_bucket).
        if self.budget == DEVICE:
            read = self._read_device(emptied)  # type: ignore[attr-defined]
            return read.budget_bytes, read.describe() + (" (expandable segments turned on)" if self._expandable else "")
        return (int(self.budget) if self.budget is not None else None), ""

    def _read_for_bucket(self) -> BudgetRead:
        # A new bucket's budget, from an emptied cache for the first plan of a budget.
        return self._budget_read(self._empty_for_first_plan())

    def _empty_for_first_plan(self) -> bool:
        """Empty the allocator's cache where the plan about to be made is the first of its budget
        (after the probe steps, an out-of-memory step or ``set_budget``) under "device" or an
        out-of-memory step's ceiling; returns whether it did (the device is then read with
        ``emptied``). The probe steps' (or the failed step's) cached blocks go back, so the
        plan's memory comes from fresh (expandable) segments rather than split ones, and what
        stays reserved is known to be unusable. Not for later buckets: emptying waits for the
        device, and a new bucket's step would pay it on its critical path (issue 50 s2)."""
        emptied = self.engine.transport.device.type == "cuda" and not self._agreed and \
            (self.budget == DEVICE or self._cap is not None)
        if emptied:
            self.costs.timed("empty_cache", torch.cuda.empty_cache)
        return emptied

    def _stand_ins(self, bucket: StepShape, read: BudgetRead) -> StandIns:
        # The stand-ins a new bucket's step may follow (offload.planner.ahead.stand_ins), at the
        # budget read and the host room there are now.
        budget = self._capped(read[0])
        host = self.engine.arena.plan_host_bytes()
        agreed = {s: p for s, p in self._plans.items() if s in self._agreed}
        options = stand_ins(self.profile, bucket, agreed, budget, host)
        if options.first() is not None:
            self._host_figure = host
        return StandIns(*map(self._noted_stand_in, options))

    def _capped(self, budget: Optional[int]) -> Optional[int]:
        # A budget read, under the ceiling an out-of-memory step set.
        if self._cap is None:
            return budget
        return self._cap if budget is None else min(budget, self._cap)

    def _noted(self, plan: Plan) -> Plan:
        """``plan`` with the reason the budget was lowered (an out-of-memory step, less host room),
        if it was, after its own budget reason: what the user reads in ``oa.plan.budget_reason``."""
        if not self._lowered:
            return plan
        return dataclasses.replace(plan, budget_reason=f"{plan.budget_reason}; {self._lowered}")

    def _noted_stand_in(self, option: Optional[StandIn]) -> Optional[StandIn]:
        # A stand-in whose plan says why the budget was lowered, if it was (see _noted).
        return dataclasses.replace(option, plan=self._noted(option.plan)) if option is not None and self._lowered else option

    def _agree_stand_in(self, failed: Optional[BaseException], options: StandIns, standing: Optional[StandIn],
                        read: Optional[BudgetRead]) -> tuple[bool, Optional[StandIn]]:
        # One collective where the group meets a new bucket (the "plan fits" point): whether any
        # rank found no plan, and the fastest stand-in every rank can follow (StandIns.agreed),
        # with as many layers recomputed as any rank must, so the ranks follow plans of one
        # shape; where none is, a rank keeps its own (plans may differ between ranks:
        # offload.planner.agree).
        failed_any, *unfit, recomputed = agree_max(
            [failed is not None, *options.unfit(), options.recomputed()], self.engine.transport.device,
            self._group, "plan fits")  # type: ignore[attr-defined]
        agreed = options.agreed(unfit)
        if agreed is not None and agreed is options.some and agreed.recomputed != recomputed and read is not None:
            agreed = self._noted_stand_in(some_kept(self.profile, agreed.top, self._capped(read[0]), recomputed))
        if standing is not None and agreed is not None:
            standing = agreed
        return bool(failed_any), standing

    def _start_ahead(self, ahead: Optional[PlansAhead], bucket: StepShape, standing: Optional[StandIn],
                     ahead_now: bool, read: Optional[BudgetRead]) -> None:
        # On every rank alike: a new bucket's stand-in with its own plan made behind it, or its
        # plan made now; after the first plan (again after an out-of-memory step or a new
        # budget), the known lengths' buckets queued at its batch, at the budget ``read``.
        if ahead is None or not ahead_now:
            return
        # After the first plan, the known and seen buckets are queued too, largest first, and
        # those longer than this bucket before it: a longer bucket's blocks serve a shorter
        # one's regions (not the other way round), so pinned in that order the blocks of every
        # plan are a few more than the largest plan's, where the first plan's own blocks pinned
        # first would serve none of the longer ones' (T22: 12.6 GB pinned beside its steps, 6.8
        # enough). Pinning beside steps costs them far more than the first plan's stand-in does.
        queued = self._queued_with_first(bucket) if len(self._agreed) == 1 else []
        for top in [t for t in queued if t.tokens > bucket.tokens]:
            read = read or self._budget_read()
            ahead.start(top, None, None, self._maker(top, read))
        ahead.start(bucket, self._step_index, standing,
                    self._maker(bucket, read) if standing is not None and read is not None else None)
        for top in [t for t in queued if t.tokens <= bucket.tokens]:
            read = read or self._budget_read()
            ahead.start(top, None, None, self._maker(top, read))

    def _queued_with_first(self, first: StepShape) -> list[StepShape]:
        # The known lengths' (at the first plan's batch) and the seen shapes' buckets not planned
        # yet, largest first.
        ahead = self._ahead
        assert ahead is not None
        known = [StepShape(first.batch, n).bucket() for n in self._known] + self._seen_buckets()
        fresh = [top for top in dict.fromkeys(known) if top != first and top not in self._agreed and
                 top not in ahead.on_main and all(e.bucket != top for e in ahead.started)]
        return sorted(fresh, key=lambda shape: -shape.tokens)

    def _saw(self, shape: Optional[StepShape]) -> None:
        """A measured probe step ran at ``shape`` (None: it read none)."""
        if shape is not None:
            self._seen.append(shape)

    def _seen_buckets(self) -> list[StepShape]:
        # The buckets of the probe steps' shapes, largest first: a stream's first batches are
        # lengths it will see again, and planning them behind the first plan takes their
        # stand-in steps (and the pinning beside them) off their first steps. A longer bucket's
        # blocks serve a shorter one's regions, not the other way round: the largest first.
        # The ranks agree on them (each place the largest of any rank's), in one all-reduce at
        # the first plan's step, which every rank reaches together.
        values = [n for shape in self._seen[:SEEN_SHAPES] for n in (shape.batch, shape.length)]
        agreed = agree_max(values + [0] * (2 * SEEN_SHAPES - len(values)), self.engine.transport.device,
                           self._group, "probe shapes")  # type: ignore[attr-defined]
        seen = {StepShape(batch, length).bucket() for batch, length in zip(agreed[::2], agreed[1::2]) if batch}
        return sorted(seen, key=lambda shape: -shape.tokens)

    def _plans_ahead(self) -> Optional[PlansAhead]:
        # The plans made ahead in force now ("lowest" reads the device to tile: planned on this thread).
        return self._ahead if self.budget != LOWEST else None

    def _stand_in_fits(self, sizing: StepProfile) -> bool:
        """Whether, on the sizing step's figures, the first plan's step could follow a stand-in
        while its own plan is made and pinned (plans ahead): then nothing is pinned beside the
        probe steps, and the measured step waits for nothing; else its blocks are pinned ahead,
        as without. No search: the stand-ins are simulated."""
        shape = profile_shape(sizing)
        if self._plans_ahead() is None or shape is None:
            return False
        budget = self._capped(self._budget_read()[0])
        return stand_ins(sizing, shape, {}, budget, self.engine.arena.plan_host_bytes()).first() is not None

    def _maker(self, bucket: StepShape, read: BudgetRead) -> Callable[[], Made]:
        budget, reason = read
        return functools.partial(self._ahead.make, self.profile, bucket, budget, self._cap,  # type: ignore[union-attr]
                                 self.head, self.engine.arena.plan_host_bytes(), reason)

    def _agreed_layers(self, bucket: StepShape, plan: Plan,
                       standing: Optional[StandIn]) -> tuple[Plan, Optional[StandIn]]:
        # A plan put in force at a step all ranks reach together (a bucket new to the group, or
        # its own plan switched to): every rank recomputes the same layers and keeps attention in
        # the same ones (offload.planner.agree: under context parallelism a recompute runs the
        # ring's collectives again). The agreed plan is what later steps of the bucket follow:
        # the stand-in's, or the bucket's own.
        recomputed, keeping = agree_layers([lp.action is Action.RECOMPUTE for lp in plan.layers],
                                           [lp.keep_attention for lp in plan.layers],
                                           self.engine.transport.device, self._group)  # type: ignore[attr-defined]
        agreed = follow_layers(plan, recomputed, keeping)
        if agreed is plan:
            return plan, standing
        if standing is not None:
            return agreed, dataclasses.replace(standing, plan=agreed)
        self._plans[bucket] = agreed
        return agreed, None

    def _adopt(self, bucket: StepShape, made: Made) -> None:
        # Every rank has the bucket's own plan made and pinned: it is put in force from this step.
        plan = self._noted(made.plan)
        self._plans[bucket] = plan
        self._host_figure = made.host_bytes
        if made.limited is not None:
            self.engine.arena.plan_limited(*made.limited)
        self._ahead.log.append(f"step {self._step_index}: {bucket} follows its own plan from here "  # type: ignore[union-attr]
                               f"(made in the background in {made.seconds:.2f} s of search, {made.made_after:.2f} s "
                               f"after it was asked; its blocks pinned {made.ready_after - made.made_after:.2f} s later)")

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

