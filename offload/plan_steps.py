"""The planning side of ``OffloadActivations(layers, memory_budget_bytes=... or plan=...)``:
which steps are probe steps, the plan chosen from their profile, and each planned step's figures.

The context drives it at two moments of each step whose forward builds a graph:
:meth:`PlannedSteps.enter` at the ``with``'s entry (the previous step, its backward and whatever
the loop did after it, is over) and :meth:`PlannedSteps.end_forward` at its exit. A step is
either a probe step (:mod:`offload.planner.sequence`; its forward runs under the probe, the engine
does nothing) or a planned one (the engine follows the plan's schedule).

The profile the probe steps measured is kept. The plan is chosen from it at the first entry after
the measured step, and again by :meth:`PlannedSteps.set_budget`; when no plan fits, the
``BudgetError`` comes at that entry and at every later one (the state is left as it was, so a
step outside the ``with`` still runs plainly) until a budget that fits is set.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable, Optional, Sequence

import torch

from .engine import OffloadEngine
from .planner.link import measure_link
from .planner.make import Budget, check_device_budget, choose, probe_policy, read_device_budget, \
    step_figures
from .planner.probe import ProbeStep
from .planner.sequence import ProbeSequence
from .planner.types import Plan, StepProfile
from .schedules.planned import PlannedSchedule

__all__ = ["PlannedSteps"]


class PlannedSteps:
    """Probe steps, then the plan in force, for one engine over ``layers``.

    ``plan``: follow this plan from the first step; otherwise probe for ``budget``.
    ``on_plan``: the context's method called with each plan that comes into force, so that it can put
    the plan's module wrappers on (held weakly: the context owns this object).
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
        on_plan: Callable[[Plan], None],  # a bound method
    ) -> None:
        self.engine = engine
        self.device = engine.transport.device
        self.budget = budget
        self.measure_peak = measure_peak
        self.plan: Optional[Plan] = None
        self.profile: Optional[StepProfile] = None  # what plans are chosen from
        self._on_plan = weakref.WeakMethod(on_plan)  # type: ignore[arg-type]
        self.probe: Optional[ProbeStep] = None  # this step's, while it runs measured
        self._probing = False  # this step is one of the probe sequence's (measured or not)
        self._sequence: Optional[ProbeSequence] = None
        self._step_mark: Any = None
        self._last_step: Optional[tuple[Any, Any, Optional[int]]] = None  # (start, end, peak)
        device = self.device
        check_device_budget(budget, device, "OffloadActivations:")
        if plan is not None:
            self.follow(plan)
        elif budget is not None:
            self._sequence = ProbeSequence(
                layers, probe_policy(device, engine.policy.min_offload_bytes, engine.policy.selection),
                device, probe=probe, candidates=candidates, link=lambda: measure_link(device),
                device_limit=(lambda: read_device_budget(device).budget_bytes) if device.type == "cuda" else None,
            )

    # -- each step ---------------------------------------------------------------------------------
    def enter(self) -> bool:
        """A step's forward begins. Returns whether it is a probe step (then :attr:`probe` is
        its measured probe, begun, or None for a plain warm-up step)."""
        self._close_previous_step()
        if self.plan is None and self.profile is not None:
            # The probe steps are over: choose (BudgetError here, at every entry, until a budget
            # that fits is set, or "device" finds more memory).
            self.follow(choose(self.profile, self.budget, self.device))
        if self.plan is None and self._sequence is not None:
            self._probing = True
            self.probe = self._sequence.next_step()  # None: run plainly, unmeasured
            if self.probe is not None:
                self.probe.begin()
            return True
        return False

    def end_forward(self, exc: Optional[BaseException]) -> None:
        """A probe step's forward ended (``exc``: what it raised, if it did)."""
        probe = self.probe
        if probe is None:
            return
        probe.end_forward()
        if exc is not None:
            self.probe, self._probing = None, False
            # Out of memory moves on to a lower-memory probe (or is a BudgetError at the
            # lowest); the step is probed again either way.
            self._sequence.step_failed(probe, exc)  # type: ignore[union-attr]

    def _close_previous_step(self) -> None:
        cuda = self.device.type == "cuda"
        mark = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
        if cuda:
            mark.record()
        probe, self.probe = self.probe, None
        if self._probing:
            self._probing = False
            if probe is not None:
                probe.end_step()
            self.profile = self._sequence.step_done(probe)  # type: ignore[union-attr]
        elif self._step_mark is not None:
            # Read lazily (report): reading the events now would make the host wait.
            peak = torch.cuda.max_memory_allocated(self.device) if cuda and self.measure_peak else None
            self._last_step = (self._step_mark, mark, peak)
        if cuda and self.measure_peak:
            torch.cuda.reset_peak_memory_stats(self.device)
        self._step_mark = mark

    # -- plans -------------------------------------------------------------------------------------
    def follow(self, plan: Plan) -> None:
        """Put ``plan`` in force: its schedule on the engine, its wrappers on the modules, its
        host blocks pinned in the background."""
        if plan.profile is None:
            raise ValueError(
                "offload: this plan carries no profile (a plan saved by an older version's "
                "Plan.to_dict); make it again with offload.plan(...)"
            )
        self.plan, self.profile = plan, plan.profile
        schedule = PlannedSchedule(plan, plan.profile)
        engine = self.engine
        engine.schedule = schedule
        engine.model_layers = len(plan.layers)
        engine.mode = "planned"
        on_plan = self._on_plan()
        if on_plan is not None:
            on_plan(plan)
        # The plan says what each layer will copy: pin those blocks now, on the arena's
        # background thread, so the first planned step does not stall on pinning.
        arena = engine.arena
        if arena.pinned and not arena.has_idle_blocks():
            try:
                arena.preallocate(schedule.region_bytes(), background=True)
            except ValueError:
                pass  # over the host budget: the step keeps what does not fit on the GPU

    def set_budget(self, budget: Budget, where: str) -> None:
        """Plan for another budget, checked by the caller, from the figures measured already (see
        :meth:`offload.OffloadActivations.set_budget`)."""
        check_device_budget(budget, self.device, where)
        if self.profile is not None:
            self.follow(choose(self.profile, budget, self.device))  # raises before anything changes
        self.budget = budget

    def measured(self) -> Optional[dict[str, Any]]:
        """The last whole planned step's time (entry to next entry) and peak (``measure_peak``)."""
        return step_figures(*self._last_step) if self._last_step is not None else None
