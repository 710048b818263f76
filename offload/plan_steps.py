"""The planning side of ``OffloadActivations(layers, memory_budget_bytes=... or plan=...)``:
which steps are probe steps, the plan each planned step follows, and each planned step's figures.

The context drives it at three moments of each step whose forward builds a graph:
:meth:`PlannedSteps.enter` at the ``with``'s entry (the previous step, its backward and whatever
the loop did after it, is over), :meth:`PlannedSteps.at_first_layer` at the first layer's entry
(where the batch's shape is read off its input), and :meth:`PlannedSteps.end_forward` at the
``with``'s exit of a probe step. A step is either a probe step (:mod:`offload.planner.sequence`;
its forward runs under the probe, the engine does nothing) or a planned one.

**Ranks decide together.** Under a process group of more than one rank (``plan_group``: the
group that does, e.g. the data-parallel one under pipeline parallelism, or False for none),
every decision that changes the collectives a rank issues is agreed by all ranks of the group at
the same step (:mod:`offload.planner.agree` lists them): how each probe step went, at the next
step's entry (so all take the same probe steps and leave the probe together); whether the model
form probes short, at the model's entry; each planned step's bucket, any rank's out-of-memory
recovery, and a ``BudgetError``, at its first layer's entry. Without a group nothing is
communicated, and a probe step's outcome is acted on at its ``with``'s exit.

**One plan per shape.** The profile the probe steps measured is kept, with the shape it was
measured at. Each planned step reads its batch shape at the first layer's entry, rounds it up to
its bucket (:meth:`~offload.planner.shapes.StepShape.bucket`), and follows that bucket's plan:
made from the profile predicted at the bucket's shape (:mod:`offload.planner.scaling`) the first
time the bucket is seen, then cached. No probe step runs again. Where no plan fits a shape, the
``BudgetError`` comes there, before any layer ran, naming the shape; the context stays as it
was, and a step of a shape that fits goes on. Ranks agree on the bucket first: the largest
batch and length of any rank.

**Out of memory.** A planned step that ran out of device memory (the allocator's OOM count grew
since the previous planned step's entry) lowers the budget plans are made for to 90% of the least of that
plan's predicted peak, its budget and what the device gives now, and the next step is planned again: an OOM-retry loop, or the Trainer's next
step, fits. A warning and the plan's ``budget_reason`` say what happened. Under a process group
every rank plans that step again (the others at their own budgets), so no rank raises a
``BudgetError`` alone.

**Host blocks ahead.** The sizing step's figures give a plan's host regions, pinned from then on
and waited for at the measured step's entry (pinning takes the driver's lock: kernels launched
late would be timed into its layers); with plans ahead, only where no stand-in would fit: else the
first plan's steps follow a stand-in that copies nothing while the plan is made and its blocks
pin in the background, as a new bucket's do, and no probe step waits. What each first step spent where:
:mod:`offload.planner.first_steps` (``OffloadActivations.first_steps`` and its report). With plans per
shape, idle blocks stay between steps (``HostArena.hold_idle``): each shape's plan finds its own.
**Plans ahead** (``plan_ahead``, default on CUDA): a new bucket's steps follow a stand-in while its
own plan is made and pinned in the background, all ranks switching together (:mod:`offload.planner.ahead`).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
import weakref
from typing import Any, Callable, Optional, Sequence, Union

import torch

from .engine.core import OffloadEngine
from .layers.short_probe import ShortStep
from .planner.ahead import NO_STAND_INS
from .planner.ahead_steps import AheadSteps
from .planner.replan_steps import ReplanSteps
from .planner.agree import agree_max, agree_planned_step, ranks_agree_enabled
from .planner.first_steps import FirstSteps
from .planner.link import Once, measure_link
from .planner.make import DEVICE, LOWEST, Budget, check_device_budget, choose, probe_policy, read_device_budget, \
    step_figures, use_expandable_segments
from .planner.probe import ProbeStep
from .planner.scaling import profile_at, profile_shape
from .planner.search import BudgetError
from .planner.sequence import ProbeSequence, StepOutcome, Verdict
from .planner.shapes import StepShape, shape_of
from .planner.tiling import HeadInfo, longest_fitting, lowest_at
from .planner.types import Plan, StepProfile
from .forwards.recompute import checkpoint_inputs
from .engine.schedules.planned import PlannedSchedule
from .engine.stats import format_bytes
from .engine.step_peak import StepPeak

__all__ = ["PlannedSteps", "OOM_BACKOFF"]

# After a planned step ran out of memory, plans are made for this much of its predicted peak.
OOM_BACKOFF = 0.9


class PlannedSteps(AheadSteps, ReplanSteps):
    """Probe steps, then a plan per batch shape, for one engine over ``layers``.

    ``plan``: follow this plan (at other shapes, plans made from its profile at its budget);
    otherwise probe for ``budget``. ``on_plan(recompute, selective)``: the context's method that
    puts the module wrappers plans need on (held weakly: the context owns this object).
    """

    def __init__(
        self,
        engine: OffloadEngine,
        layers: Sequence[torch.nn.Module],
        candidates: Sequence[torch.nn.Module],
        *,
        budget: Budget,
        plan: Optional[Plan],
        probe: str,
        measure_peak: bool,
        on_plan: Callable[[bool, bool], None],  # a bound method
        group: Any = None,
        plan_ahead: Union[bool, tuple[int, ...]] = False,
    ) -> None:
        self.engine = engine
        self.device = engine.transport.device
        self.budget = budget
        self.measure_peak = measure_peak
        # The ranks that agree on each step's shape: the default process group (None), a
        # data-parallel group (pipeline stages must not: they enter their layers at different
        # times), or False for none.
        self._group = group
        self.plan: Optional[Plan] = None
        self.profile: Optional[StepProfile] = None  # the probe's figures, what plans are made from
        self._plans: dict[StepShape, Plan] = {}     # per bucket, at the budget in force
        self._shape: Optional[StepShape] = None     # the bucket of the plan in force
        # The buckets every rank of the group has a plan for (the same set on every rank; this
        # rank's _plans may hold more after another rank ran out of memory): a bucket outside
        # it is planned together, a BudgetError agreed.
        self._agreed: set[StepShape] = set()
        self._cap: Optional[int] = None             # the budget's ceiling after an OOM
        self._lowered = ""                          # why, for the plan's report
        self._ooms: Optional[int] = None            # the allocator's OOM count at the last check
        self._ran_out = False                       # this rank plans again (out of memory, or short of
                                                    # host room): to tell the others, which do too
        self._host_figure: Optional[int] = None     # the host bytes the last plan was made for
        self._host_refusals = 0                     # the arena's host refusals when plans were followed
        self._step_index: Optional[int] = None      # the engine's index of the last planned step
        self._entry_layers = list(layers)           # whose gradients a reading may hold (entry_base)
        self._entry_reading: Optional[int] = None   # what the base stands for (replan_steps)
        self._entry_grads = False                   # and whether that reading held gradients
        self._on_plan = weakref.WeakMethod(on_plan)  # type: ignore[arg-type]
        self.probe: Optional[ProbeStep] = None  # this step's, while it runs measured
        self._probing = False  # this step is one of the probe sequence's (measured or not)
        self._failed: Optional[tuple[StepOutcome, BaseException]] = None  # the probe step raised: how
        self._pinned_ahead = False
        self.planning_s = 0.0  # host seconds spent making plans for new shapes (the report's)
        self._init_ahead(plan_ahead)
        self.costs = FirstSteps(lambda: engine.arena.counters.acquire_s, lambda: engine.arena.pinner.busy_s)
        self._sequence: Optional[ProbeSequence] = None
        self._step_mark: Any = None
        self._entry_step: Optional[int] = None  # the engine step planned at the model's entry
        self.head: Optional[HeadInfo] = None    # the LM head plans may tile (the model form)
        self._last_step: Optional[tuple[Any, Any, Optional[int]]] = None  # (start, end, peak)
        # Each planned step's peak (measure_peak, on CUDA), read by the plans' schedules too.
        self._peak = StepPeak(self.device) if measure_peak and self.device.type == "cuda" else None
        device = self.device
        check_device_budget(budget, device, "OffloadActivations:")
        # "device" is all the GPU can give, and the caching allocator's fragmentation can take a
        # third of it (docs/design.md): expandable segments, unless the process chose.
        self._expandable = use_expandable_segments() if budget == DEVICE else False
        if plan is not None:
            if plan.profile is None:
                raise ValueError(
                    "offload: this plan carries no profile (a plan saved by an older version's "
                    "Plan.to_dict); make it again with offload.plan(...)"
                )
            self.budget = plan.budget_bytes
            self.profile = plan.profile
            self.follow(plan)
            shape = profile_shape(plan.profile)
            if shape is not None:
                self._shape = shape.bucket()
                self._plans[self._shape] = plan  # (not agreed: each rank may be given its own)
        elif budget is not None:
            link = Once(lambda: self.costs.timed("link", lambda: measure_link(device)))
            self._sequence = ProbeSequence(
                layers, probe_policy(device, engine.policy.min_offload_bytes, engine.policy.selection),
                device, probe=probe, candidates=candidates, link=link,
                device_limit=(lambda: self._read_device().budget_bytes) if device.type == "cuda" else None,
                budget_bytes=budget if isinstance(budget, int) else None,
            )

    # -- each step ---------------------------------------------------------------------------------
    def enter(self) -> bool:
        """A step's forward begins. Returns whether it is a probe step (then :attr:`probe` is
        its measured probe, begun, or None for a plain warm-up step)."""
        self.costs.enter()
        self._close_previous_step()
        if self.profile is not None:
            self.costs.kind("planned")
            self._check_out_of_memory()
            self._check_host_room()
            self._check_entry_base()
            if self._ahead is not None:
                self._ahead.poll()  # a plan made since: its blocks pinned from now on
            if self.plan is None:
                if profile_shape(self.profile) is None:
                    # Figures of one shape only: its plan now (BudgetError here, at every entry,
                    # until a budget that fits is set).
                    self.follow(self._make(self.profile, None))
                else:
                    self._wrappers(self.profile)
            return False
        if self._sequence is not None:
            self._probing = True
            kind = "".join(self._sequence.todo[:1])
            self.costs.kind("warm-up" if kind == "plain" else kind)
            if self._pinned_ahead and kind == "measure":
                # The blocks pinned ahead must be done before the measured step: pinning takes the
                # driver's lock, and kernels launched late would be timed into its layers.
                self.costs.timed("pinning", lambda: self.engine.arena.settle(wait=True))
            self.probe = self.costs.timed("allocator", self._sequence.next_step)  # None: run plainly, unmeasured
            if self.probe is not None:
                self.probe.begin()
            return True
        return False

    def at_first_layer(self, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """A planned step enters its first layer: follow the plan of its shape's bucket (made
        now if the bucket is new). Raises :class:`BudgetError` when none fits that shape."""
        profile = self.profile
        if profile is None or profile.shape is None:
            return
        hidden = next((t for t in checkpoint_inputs(args, kwargs) if t.dim() >= 2), None)
        if hidden is None:
            return  # no hidden states to read a shape from: the plan in force goes on
        step = self.engine.step
        if step is not None and step.index == self._entry_step:
            return  # planned at the model's entry already (the model form)
        self._plan_shape(shape_of(hidden.shape))

    def at_model_entry(self, shape: StepShape, short_step: Optional[ShortStep], probe_tokens: int) -> bool:
        """The model's forward begins (``OffloadActivations(..., model=model)``). A probe step of
        more than twice ``probe_tokens`` tokens is not probed at its own length: the probe steps
        run now, as ``short_step(length)`` calls at ``probe_tokens`` (a minute-long step probed
        at full length would cost minutes), and this step becomes a planned one. Returns whether
        it did (the context then starts the engine's step, and calls :meth:`plan_at_entry`).
        Ranks decide together, on the largest batch and length of any rank, and each cuts its
        own batch (never longer than it is); none probes short if any rank cannot: no labels, or
        a step the short probe would not leave unchanged (``short_step.refused``: that rank warns,
        and every rank probes at its full length)."""
        if not self._probing or self.profile is not None:
            return False
        refused = short_step is not None and bool(short_step.refused)
        batch, length, unable = agree_max([shape.batch, shape.length, int(short_step is None or refused)],
                                          self.device, self._group, "short probe")
        agreed = StepShape(batch, length)
        if agreed.tokens <= 2 * probe_tokens:
            return False
        if refused:
            warnings.warn(short_step.refusal_warning(probe_tokens), UserWarning, stacklevel=2)  # type: ignore[union-attr]
        if unable:
            return False
        if self.probe is not None:
            self.probe.end_forward()  # nothing ran under it yet: its hooks come off unused
        self.probe, self._probing = None, False
        cut = max(1, probe_tokens // agreed.batch)
        try:
            self.profile = self._sequence.run(lambda: short_step(cut), "offload (probe at a short length)",  # type: ignore
                                              self._agree_outcome)
        except Exception as exc:
            raise short_step.explain(exc) from exc.__cause__  # type: ignore[union-attr]
        self._pin_ahead()
        self._wrappers(self.profile)
        return True

    def plan_at_entry(self, shape: StepShape) -> int:
        """A planned step's model forward begins: plan for its shape here, before the head runs
        (:meth:`at_first_layer` then finds it done); the tokens per chunk of its tiled head (0:
        untiled, or a probe step)."""
        step = self.engine.step
        if self.profile is None or self.profile.shape is None or step is None or self._probing:
            return 0
        self._plan_shape(shape)
        self._entry_step = step.index
        return self.plan.head_tokens if self.plan is not None else 0

    def _plan_shape(self, shape: StepShape) -> None:
        profile = self.profile
        assert profile is not None
        step = self.engine.step
        self._step_index = step.index if step is not None else None
        started = time.perf_counter()
        ahead = self._plans_ahead()
        # One collective: the bucket all plan for, any rank's out of memory, plans ahead ready or failed.
        behind, failed_at = ahead.values() if ahead is not None else (0, 0)
        bucket, ran_out, behind, failed_at = agree_planned_step(shape.bucket(), self._ran_out, behind, failed_at,
                                                                self.device, self._group)
        self._ran_out, switched = False, False
        if ran_out:
            # Every rank plans again at this step (the one that ran out at its lowered budget,
            # from an emptied cache), so that any BudgetError is raised by all.
            self._agreed.clear()
            if ahead is not None:
                ahead.clear()
        elif ahead is not None:
            made, switched = ahead.switch(bucket, behind, failed_at)
            if made is not None:
                self._adopt(bucket, made)
            if bucket in ahead.failed:
                self._raise_failed_ahead(ahead, bucket, shape)
        together = bucket not in self._agreed
        if ahead is not None:  # a bucket new to the group: its blocks and others' pinned from the next step
            self.engine.arena.pinner.hold(together)
        standing = ahead.stand_in_of(bucket) if ahead is not None and bucket not in self._plans else None
        plan = self._plans.get(bucket) or (standing.plan if standing is not None else None)
        if not (together or switched) and bucket == self._shape and plan is self.plan and plan is not None:
            self._scale(shape, standing.top if standing is not None else bucket)
            self._note(bucket, False, standing, started)
            return
        ahead_now = together and ahead is not None and bucket not in ahead.on_main
        read = self._read_for_bucket() if ahead_now and plan is None else None
        failed, options = None, self._stand_ins(bucket, read) if read is not None else NO_STAND_INS
        standing = standing or options.first()
        plan = plan or (standing.plan if standing is not None else None)
        if plan is None:  # no stand-in fits: planned now, on this thread
            try:
                plan = self._make(profile_at(profile, bucket), bucket, shape)
            except BudgetError as exc:
                failed = exc
        # Every rank meets a bucket new to the group at the same step, whatever its own cache
        # holds: decide together, so no rank raises alone while the others wait in a collective.
        if together:
            failed_any, standing = self._agree_stand_in(failed, options, standing, read)
            plan = standing.plan if standing is not None else plan
            if failed_any and failed is None:
                failed = BudgetError(f"offload: another rank found no plan for a step of {bucket}; see its error")
        if failed is not None:
            raise failed
        if together or switched:  # the same step on every rank: the group's recomputes (planner.agree)
            plan, standing = self._agreed_layers(bucket, plan, standing)  # type: ignore[arg-type]
        self._agreed.add(bucket)
        self._start_ahead(ahead, bucket, standing, ahead_now, read)
        if standing is None and bucket not in self._plans:
            self._plans[bucket] = plan  # type: ignore[assignment]
        if plan is not self.plan:  # (a schedule holds the micro-batches in flight: keep it)
            self.follow(plan)  # type: ignore[arg-type]
        self._shape = bucket
        self._scale(shape, standing.top if standing is not None else bucket)
        self.planning_s += self._note(bucket, together, standing, started)

    def _scale(self, shape: StepShape, bucket: StepShape) -> None:
        # The plan is for the bucket's top (and, across ranks, the largest shape; a stand-in's:
        # the bucket it was made for): its size floors and byte checks scale to this step's tokens.
        schedule = self.engine.schedule
        if isinstance(schedule, PlannedSchedule):
            schedule.scale = shape.tokens / bucket.tokens
            schedule.step_shape = (shape.batch, shape.length)

    def end_forward(self, exc: Optional[BaseException]) -> None:
        """A probe step's forward ended (``exc``: what it raised, if it did)."""
        probe = self.probe
        if probe is None:
            return
        probe.end_forward()
        if exc is None:
            return
        own = self._sequence.judge(probe, exc)  # type: ignore[union-attr]
        self._failed = (own, exc)
        if not ranks_agree_enabled(self._group):
            self._close_probe_step()  # alone: act on it now (a BudgetError comes from this with)
        elif own.verdict == Verdict.NO_FIT:
            exc.add_note("offload: this was the planner's low-memory probe step; every rank of the plan group "
                         "raises BudgetError at the next step's entry (no plan can fit)")

    def _close_probe_step(self) -> None:
        # The ranks agree on how the step went (the worst outcome of any), and all move on by it.
        probe, failed = self.probe, self._failed
        self.probe, self._probing, self._failed = None, False, None
        self._saw(probe.shape if probe is not None and failed is None else None)
        sequence = self._sequence
        assert sequence is not None
        self.profile = self.costs.timed("probe", lambda: self._end_probe_step(sequence, probe, failed))
        if self.profile is not None:
            self._note_entry()
        self._pin_ahead()

    def _end_probe_step(self, sequence: ProbeSequence, probe: Optional[ProbeStep],
                        failed: Optional[tuple[StepOutcome, BaseException]]) -> Optional[StepProfile]:
        if failed is None:
            if probe is not None:
                probe.end_step()
                if probe.step_start is not None and probe.step_end is not None:  # (synchronised: a cheap read)
                    self.costs.device(probe.clock.ms(probe.step_start, probe.step_end) / 1e3,
                                      probe.meter.peak if probe.clock.cuda else None)
            own, exc = sequence.judge(probe), None
        else:
            own, exc = failed
        return sequence.advance(own, self._agree_outcome(own), exc, probe)

    def _agree_outcome(self, own: StepOutcome) -> StepOutcome:
        """The outcome of a probe step all ranks of the plan group move on by: the worst."""
        if not ranks_agree_enabled(self._group):
            return own
        return StepOutcome.from_values(agree_max(own.values(), self.device, self._group, "probe step"))

    def _close_previous_step(self) -> None:
        cuda = self.device.type == "cuda"
        mark = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
        if cuda:
            mark.record()
        if self._probing:
            self.engine.forward.count_step_elsewhere()  # the report numbers every step of the context
            self._close_probe_step()
        elif self._step_mark is not None:
            # Read lazily (report): reading the events now would make the host wait. The peak:
            # the largest of this reading and those the schedule took at the step's forward and
            # backward ends (a loop may reset the counter itself between steps: step_peak.py).
            peak = self._peak.read() if self._peak is not None else None
            self._last_step = (self._step_mark, mark, peak)
        if self._peak is not None:
            self._peak.reset()
        self._step_mark = mark

    # -- plans -------------------------------------------------------------------------------------
    def _read_device(self, emptied: bool = False) -> Any:
        return read_device_budget(self.device, expandable=self._expandable, emptied=emptied)

    def _make(self, profile: StepProfile, shape: Optional[StepShape], step: Optional[StepShape] = None) -> Plan:
        """The plan for ``profile`` (at ``shape``, the bucket of the step's own shape ``step``)
        under the budget in force, lowered after an out-of-memory step."""
        emptied = self._empty_for_first_plan()
        self._host_figure = self.engine.arena.plan_host_bytes()
        try:
            plan = self.costs.timed("search", lambda: choose(
                profile, self.budget, self.device, cap_bytes=self._cap, expandable=self._expandable, emptied=emptied,
                head=self.head, host_budget=self._host_figure, host_limited=self.engine.arena.plan_limited))
        except BudgetError as exc:
            if shape is None:
                raise
            raise self._no_fit(exc, shape, step) from None
        return self._noted(plan)

    def _no_fit(self, exc: BaseException, shape: StepShape, step: Optional[StepShape], where: str = "") -> BudgetError:
        # The step as the user ran it; the shape the plan is made for only as the reason.
        named = shape if step is None or step == shape else f"{step} (planned for " + (
            f"its length bucket, up to length {shape.length})" if step.batch == shape.batch else
            f"{shape}, the largest batch and length bucket of the ranks)")
        return BudgetError(f"offload: no plan fits a step of {named}{where}: {exc}{self._what_fits(shape)}")

    def _what_fits(self, shape: StepShape) -> str:
        # The longest length of this batch size whose lowest plan fits (bisected on the profile
        # at each length): what the user can train instead.
        if self.profile is None or self.profile.shape is None or self.budget is None or self.budget == LOWEST:
            return ""
        budget = self._read_device().budget_bytes if self.budget == DEVICE else int(self.budget)
        if self._cap is not None:
            budget = min(budget, self._cap)
        host_budget = self.engine.arena.plan_host_bytes()
        device, host = lowest_at(self.profile, shape, self.head, host_budget)
        said = (f". Its lowest plan (every layer recomputed, inputs kept where the host budget needs, tiled where it can be) "
                f"needs {format_bytes(device)} of device memory, {format_bytes(host)} of host memory (host budget {format_bytes(host_budget)})")
        longest = longest_fitting(self.profile, shape.batch, budget, self.head, host_budget)
        return said + (f". At batch {shape.batch}, lengths up to about {longest} fit" if longest is not None else "")

    def follow(self, plan: Plan) -> None:
        """Put ``plan`` in force: its schedule on the engine (from the step in progress on, if
        one is: the first layer's entry switches plans), its wrappers on the modules, its host
        blocks pinned in the background."""
        self.plan = plan
        self._host_refusals = self.engine.arena.counters.process_refusals
        schedule = PlannedSchedule(plan, plan.profile)  # type: ignore[arg-type]
        schedule.peak = self._peak
        if self._ahead is not None:
            # A plan made in the background during this step's forward (the first plan's: 0.4 s
            # of search beside the 8B shape's 0.7 s forward) has its blocks asked at its end,
            # pinned beside the backward rather than from the next step on (issue 50 s1, T14).
            schedule.after_forward = self._ahead.poll
        engine = self.engine
        engine.schedule = schedule
        engine.model_layers = len(plan.layers)
        engine.mode = "planned"
        step = engine.step
        if step is not None and not step.forward_done:
            schedule.on_step_start(engine)
            step.counters.mode = "planned"
            pending = engine.forward.pending_group  # saved before the first layer, under the old plan
            if pending is not None:
                pending.min_offload_bytes = schedule.min_offload_bytes(pending.layer)
        self._wrappers(plan.profile, plan)  # type: ignore[arg-type]
        if self._ooms is None:
            self._ooms = _oom_count(self.device)
        # The plan says what each layer will copy: pin those blocks now, on the arena's
        # background thread, so the first planned step does not stall on pinning.
        self._pin(schedule.region_bytes())

    def put_wrappers_on(self) -> None:
        """Put the wrappers the plans need (back) on: after the context's ``close()``."""
        if self.profile is not None:
            self._wrappers(self.profile, self.plan)

    def _wrappers(self, profile: StepProfile, plan: Optional[Plan] = None) -> None:
        # With plans per shape any plan may come at a first layer's entry, after Module.__call__
        # read that layer's forward: every wrapper a plan of this profile may use goes on before
        # the first planned step. A plan of one shape puts on only what it uses (a wrapper costs
        # a Python call per module call).
        on_plan = self._on_plan()
        if on_plan is None:
            return
        tiles = plan is not None and plan.tiles()  # (a tiled plan's profile has no candidates left)
        if profile.shape is not None:
            on_plan(True, tiles or any(layer.selective is not None for layer in profile.layers))
        elif plan is not None:
            on_plan(plan.recomputes(), plan.selects() or tiles)

    def _pin(self, sizes: list[int]) -> None:
        # The plan's regions bound what the arena holds, and those no idle block serves are
        # pinned ahead (HostArena.pin_for_plan). Plans per shape: a block another shape's plan
        # used stays for that shape's next step (trimmed it would be pinned again, seconds a
        # step on LLAMA-1B's shape), within that bound; close() gives them back.
        self.engine.arena.pin_for_plan(sizes, hold_idle=self.profile is not None and self.profile.shape is not None)

    def _pin_ahead(self) -> None:
        # After the sizing step, where a measured plain step follows: its plan's regions pinned meanwhile.
        sizing = self._sequence.sizing if self._sequence is not None else None
        if self._pinned_ahead or sizing is None or self.profile is not None:
            return
        self._pinned_ahead = True
        sizing = dataclasses.replace(sizing, link=self._sequence.link())  # type: ignore[union-attr]
        if self._stand_in_fits(sizing):  # pinned behind the first plan's stand-in: no search for it now
            return
        try:
            plan = self.costs.timed("search", lambda: choose(sizing, self.budget, self.device, expandable=self._expandable,
                                                             host_budget=self.engine.arena.plan_host_bytes()))
        except (BudgetError, ValueError):
            return  # the measured step decides; nothing to pin ahead
        self._pin(PlannedSchedule(plan, sizing).region_bytes())

    def _check_out_of_memory(self) -> None:
        # The allocator's count, read at each planned step's entry (tens of microseconds): the
        # engine cannot tell a step that failed from one that finished when the plan keeps
        # every layer (no group to hand back), and the error may come outside the ``with``.
        index = self._step_index
        if index is None or self._ooms is None or self.plan is None:
            return
        count = _oom_count(self.device)
        if count <= self._ooms:
            return
        self._ooms = count
        plan = self.plan
        peak = plan.prediction.peak_bytes
        # Below what the plan predicted and was allowed (the step found less), and within what
        # the device gives now (a memory cap lowered since, another process grown).
        cap = int(OOM_BACKOFF * min(peak, plan.budget_bytes or peak))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the failed step's split blocks, before the device is read
            cap = min(cap, read_device_budget(self.device, self._expandable, emptied=True).budget_bytes)
        self._cap = cap if self._cap is None else min(self._cap, cap)
        why = (f"lowered to {format_bytes(self._cap)} after step {index} ran out of device "
               f"memory (its plan predicted a peak of {format_bytes(peak)})")
        self._plan_again(why, f"offload: the budget plans are made for is {why}; the next step is planned again")

    def set_budget(self, budget: Budget, where: str) -> None:
        """Plan for another budget, checked by the caller, from the figures measured already (see
        :meth:`offload.OffloadActivations.set_budget`). Made for the shape in force first, so a
        budget no plan fits raises before anything changes."""
        check_device_budget(budget, self.device, where)
        # The next planned step decides together again, whether this call raises or not (on
        # one rank, it may), so that its BudgetError, if any, is every rank's.
        self._agreed.clear()
        if self._ahead is not None:
            self._ahead.clear()
        old = self.budget, self._cap, self._lowered
        self.budget, self._cap, self._lowered = budget, None, ""
        try:
            if self.profile is not None:
                shape = self._shape
                made = self._make(profile_at(self.profile, shape) if shape is not None else self.profile, shape)
        except BaseException:
            self.budget, self._cap, self._lowered = old
            raise
        self._plans.clear()
        if self.profile is not None:
            if shape is not None:
                self._plans[shape] = made
            self.follow(made)

    def measured(self) -> Optional[dict[str, Any]]:
        """The last whole planned step's time (entry to next entry) and peak (``measure_peak``)."""
        return step_figures(*self._last_step) if self._last_step is not None else None


def _oom_count(device: torch.device) -> int:
    """How many times the caching allocator ran out of memory on ``device`` so far (0 off CUDA)."""
    return int(torch.cuda.memory_stats(device).get("num_ooms", 0)) if device.type == "cuda" else 0
