"""What the first steps of a planning context cost, phase by phase (issue 50 s1, T14).

A context that plans runs probe steps first (:mod:`offload.planner.sequence`), then its first
planned step makes the plan. Each of those steps pays one-off costs on top of the step itself:

``probe``
    the probe's end of step: waiting for the device at its end, reading its per-layer events and
    building the profile from them (:meth:`~offload.planner.probe.ProbeStep.end_step`,
    :meth:`~offload.planner.sequence.ProbeSequence.advance`);
``search``
    the plan search (:func:`offload.planner.make.choose`): the plan pinned ahead from the sizing
    step's figures (without plans ahead), and the plan of the first planned step (with plans
    ahead, its stand-in's too);
``link``
    measuring the host link (once);
``empty_cache``
    giving the allocator's cached blocks back before the device is read for a plan;
``pinning``
    waiting for host blocks: those pinned ahead, waited for before the measured step (without
    plans ahead), and those
    a step's copies had to pin (or wait for) on the spot;
``allocator``
    growing the caching allocator to the plain step's predicted peak before the measured plain
    step, where no calibration step did it (:mod:`offload.planner.sequence`).

Beside the phases, ``background_pin_s`` is the seconds the arena's background pinner spent
pinning while the step ran (summed over its workers; not charged to the step, which does not wait
for it): a step slower than its plan beside a large one points at the driver's registration
contending with the step's own launches or copies.

Every figure is host seconds from ``time.perf_counter`` around the phase (no device
synchronisation of its own). A step's ``wall_s`` runs from its ``with``'s entry to the next
step's, so the costs paid at a step's entry (closing the previous probe step, making the plan)
are that step's, as a loop that times each step sees them; ``other_s`` is the rest of the wall
(the step's own forward and backward, the probe's per-layer hooks, the loop's own work). The
probe steps also carry ``device_s``: the step's span on the device, from the probe's own events.

The records stop after :data:`PLANNED_STEPS` planned steps: the first pins what the plan pins
beyond what was pinned ahead, the second shows whether anything is left. With plans ahead, the
first plan's steps may follow a stand-in while its blocks are pinned in the background (kind
``"stand-in"``, not counted among them; ``ahead_log`` says when the own plan came).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

__all__ = ["FirstSteps", "StepCosts", "PHASES", "PLANNED_STEPS"]

PHASES = ("probe", "search", "link", "empty_cache", "pinning", "allocator")
PLANNED_STEPS = 2


@dataclass
class StepCosts:
    """One step's one-off costs (seconds); ``kind``: the probe step's kind (``"size"``,
    ``"calibrate"``, ``"measure"``, ``"warm-up"``) or ``"planned"``."""

    step: int
    kind: str
    wall_s: Optional[float] = None   # entry to the next step's entry (None: not over yet)
    device_s: Optional[float] = None  # a probe step's span on the device (its events)
    # A probe step's peak of allocated device memory, as its probe read it layer by layer. The
    # probe resets the device's peak counter at each layer to tell the layers' peaks apart, so
    # a loop reading the counter after the step sees only the last layer's stretch.
    peak_bytes: Optional[int] = None
    background_pin_s: float = 0.0     # the background pinner's seconds while the step ran
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def as_dict(self) -> dict[str, Any]:
        """Plain data: ``step``, ``kind``, ``wall_s``, ``device_s``, ``peak_bytes``, ``<phase>_s``
        for each of :data:`PHASES`, ``other_s`` (the wall less the phases; None while the step
        runs) and ``background_pin_s``."""
        spent = sum(self.phases.values())
        return {"step": self.step, "kind": self.kind, "wall_s": self.wall_s, "device_s": self.device_s,
                "peak_bytes": self.peak_bytes,
                **{f"{name}_s": seconds for name, seconds in self.phases.items()},
                "other_s": None if self.wall_s is None else self.wall_s - spent,
                "background_pin_s": self.background_pin_s}


class FirstSteps:
    """The records of the first steps of one context. ``pinned()``: the seconds its arena has
    spent acquiring host blocks so far (``ArenaCounters.acquire_s``), read at each step's entry;
    ``background()``: the seconds its background pinner has spent so far (``BackgroundPinner.busy_s``).
    ``now``: the clock (a test's own, to check what is charged where)."""

    def __init__(self, pinned: Callable[[], float], background: Callable[[], float] = lambda: 0.0,
                 now: Callable[[], float] = time.perf_counter) -> None:
        self.steps: list[StepCosts] = []
        self._pinned, self._background, self._now = pinned, background, now
        self._background_at_start = 0.0
        self._open: Optional[StepCosts] = None
        self._closed: Optional[StepCosts] = None  # the step before the one recorded now
        self._started = 0.0
        self._pinned_at_start = 0.0
        self._planned = 0
        self._inside = 0.0  # seconds the phases timed inside the current one took

    def enter(self) -> None:
        """A step's ``with`` is entered: the previous step is over (its wall time and the host
        blocks its copies acquired), and this one is recorded if still among the first."""
        now = self._now()
        self._close(now)
        if self._planned >= PLANNED_STEPS:
            return
        self._open = StepCosts(len(self.steps) + 1, "")
        self._started, self._pinned_at_start = now, self._pinned()
        self._background_at_start = self._background()
        self.steps.append(self._open)

    def kind(self, kind: str) -> None:
        """Name the step being recorded: a probe kind, or ``"planned"``."""
        if self._open is not None:
            self._open.kind = kind
            self._planned += kind == "planned"

    def label(self, kind: str) -> None:
        """Name the step being recorded again: a planned step that followed a stand-in
        (``"stand-in"``) is not counted among the :data:`PLANNED_STEPS` recorded, so the records
        go on to the steps of the plan it stood in for."""
        if self._open is not None and self._open.kind != kind:
            self._planned -= self._open.kind == "planned"
            self._open.kind = kind

    def add(self, phase: str, seconds: float) -> None:
        """Charge ``seconds`` of ``phase`` (one of :data:`PHASES`) to the step being recorded."""
        if self._open is not None:
            self._open.phases[phase] += seconds

    def timed(self, phase: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, its time charged to ``phase``, less what phases timed inside it took (the
        link measured while the probe's figures are read is the link's, not the probe's)."""
        started, outer = self._now(), self._inside
        self._inside = 0.0
        try:
            return fn()
        finally:
            spent = self._now() - started
            self.add(phase, spent - self._inside)
            self._inside = outer + spent

    def device(self, seconds: float, peak_bytes: Optional[int] = None) -> None:
        """The last step's span on the device and its peak of allocated memory, as its probe
        measured them (read when the step is closed, at the next one's entry)."""
        if self._closed is not None:
            self._closed.device_s = seconds
            self._closed.peak_bytes = peak_bytes

    def _close(self, now: float) -> None:
        step, self._open = self._open, None
        self._closed = step
        if step is None:
            return
        step.wall_s = now - self._started
        # The blocks its copies pinned (or waited for) on the spot; the wait for those pinned
        # ahead was charged at its entry.
        step.phases["pinning"] += max(0.0, self._pinned() - self._pinned_at_start)
        step.background_pin_s = self._background() - self._background_at_start

    def rows(self) -> list[dict[str, Any]]:
        """Each recorded step as :meth:`StepCosts.as_dict`."""
        return [step.as_dict() for step in self.steps]

    def table(self) -> str:
        """The short "first steps" table of the report ('' before any step was recorded)."""
        if not self.steps:
            return ""
        head = f"{'step':>4}  {'kind':<9} {'wall':>7} {'device':>7} " + " ".join(f"{n:>11}" for n in PHASES) + "   other  bg-pin"
        lines = ["first steps (seconds; the one-off costs of planning: offload.planner.first_steps):", head]
        for row in self.rows():
            lines.append(f"{row['step']:>4}  {row['kind']:<9} {_cell(row['wall_s'], 'running'):>7} "
                         f"{_cell(row['device_s']):>7} " + " ".join(f"{row[n + '_s']:>11.3f}" for n in PHASES)
                         + f" {_cell(row['other_s']):>7} {row['background_pin_s']:>7.3f}")
        return "\n\n" + "\n".join(lines)


def _cell(value: Optional[float], blank: str = "") -> str:
    return blank if value is None else f"{value:.3f}"
