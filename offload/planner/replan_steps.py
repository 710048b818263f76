"""Why every bucket is planned again once plans are in force, for
:class:`offload.plan_steps.PlannedSteps` (which runs these checks at each planned step's entry):

- a step ran out of device memory: the budget is lowered (``PlannedSteps._check_out_of_memory``);
- the host's room shrank since the plans were made (another job on the node took host memory):
  what found no room stayed on the GPU, which the plans did not count on (:meth:`_check_host_room`);
- what a step's entry holds grew past the plans' base (an optimizer's state made after the measured
  step, a model the loop built): the base is raised (:meth:`_check_entry_base`,
  :mod:`offload.planner.entry_base`).

Each plans again the same way (:meth:`_plan_again`): the plans are dropped, the next first layer
plans anew, and the other ranks of the plan group are told at that layer's agreement, so that
they plan again there too (their collectives follow their plans).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

from ..engine.stats import format_bytes
from .budget import DEVICE
from .entry_base import base_drift, grads_held, held_at_entry, rebased

__all__ = ["ReplanSteps"]


class ReplanSteps:
    """Plans made again, for :class:`offload.plan_steps.PlannedSteps` (which holds the plans, the
    budget and the engine these methods read)."""

    # Set by PlannedSteps.
    engine: Any
    device: Any
    budget: Any
    plan: Any
    profile: Any
    _plans: dict
    _shape: Any
    _lowered: str
    _ran_out: bool
    _host_figure: Optional[int]
    _host_refusals: int
    _step_index: Optional[int]
    _entry_layers: list
    _entry_reading: Optional[int]
    _entry_grads: bool

    def _plan_again(self, why: str, warning: str) -> None:
        # Drop every plan: the next first layer plans again, and tells the other ranks, which
        # plan again with it there. ``why`` goes into the plans' budget reason.
        self._lowered = why
        self._plans.clear()
        self.plan, self._shape = None, None
        self._ran_out = True
        warnings.warn(warning, UserWarning, stacklevel=5)

    def _check_host_room(self) -> None:
        # Another job on the node took host memory after the plans were made: the last step's
        # copies that found no room stayed on the device, which its plan did not count on (on a
        # GPU, the way to an out-of-memory step). Plan again, with the room there is now, as
        # after an out-of-memory step (every rank with it). Only where the room did shrink: a
        # refusal the plans' figure already allowed for would be planned the same way again.
        if self.plan is None or self._host_figure is None:
            return
        arena = self.engine.arena
        refusals = arena.counters.process_refusals
        if refusals <= self._host_refusals:
            return
        self._host_refusals = refusals
        room = arena.plan_host_bytes()
        if room >= self._host_figure:
            return
        why = (f"host room {format_bytes(room)} after step {self._step_index} found less than the "
               f"{format_bytes(self._host_figure)} its plan was made for")
        self._plan_again(why, f"offload: the {why} (another process took host memory): what found no room "
                              "stayed on the device, and the next step is planned again for the room there is now")

    def _note_entry(self) -> None:
        """The profile was made now, at a step's entry: what the entry holds is what its base
        stands for."""
        self._entry_reading, self._entry_grads = held_at_entry(self.device), grads_held(self._entry_layers)

    def _check_entry_base(self) -> None:
        # What this entry holds against what the base stands for (a plan given to the context: its
        # first planned step's entry). Past the model's error, the base is raised by the growth.
        # Nothing to overrun without a budget in bytes ("lowest", none): no reading at all.
        if self.plan is None or not (isinstance(self.budget, int) or self.budget == DEVICE):
            return
        now = held_at_entry(self.device)
        if self._entry_reading is None:
            self._note_entry()
            return
        drift = base_drift(self._entry_reading, now, self.plan.budget_bytes)
        if not drift:
            return
        grads = grads_held(self._entry_layers)  # (read only here: the parameters, walked once)
        self.profile = rebased(self.profile, drift, grads and not self._entry_grads)
        self._entry_reading, self._entry_grads = now, grads or self._entry_grads
        why = f"planned again: the memory held at the forward's entry grew by {format_bytes(drift)} since the plans were made"
        self._plan_again(why, f"offload: {why} (an optimizer's state made since, or tensors the loop keeps); "
                              "every step is planned again on that base")
