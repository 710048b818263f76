"""``OffloadActivations``: one ``with`` around the whole forward; layers found by module hooks.

The saved-tensor hooks are pushed once for the whole forward (see ``engine.py``), and forward
pre-hooks / hooks on the given layer modules move the engine from one layer's group to the next.
Because the hooks stay *outside* the layers, a ``torch.utils.checkpoint`` inside or around a layer
keeps its own hooks innermost, and only the checkpoint's inputs reach the engine.

The module hooks are registered on first entry and removed by :meth:`OffloadActivations.close`.
Outside the ``with`` they return at once. They hold the context only through a weak reference, and
a copy of them (``copy.deepcopy(model)``, pickling) is an inert hook, so a model that carries them
can still be copied or saved.
"""

from __future__ import annotations

import copy
import time
import weakref
from typing import Any, Iterable, Optional

import torch
from torch.utils.checkpoint import checkpoint

from .api import build_engine
from .eager import run_eagerly
from .step import first_grad_tensor
from .planner.make import Budget, check_budget, choose, probe_policy, step_figures
from .planner.probe import ProbeStep, measure_link
from .planner.types import Plan
from .schedules.planned import PlannedSchedule


class _LayerHook:
    """A forward pre-hook (``after=False``) or forward hook on a layer module.

    Holds a weak reference to its ``OffloadActivations`` and nothing else, so the module stays
    copyable; its copies are inert (``owner`` None).
    """

    __slots__ = ("_owner", "_after")

    def __init__(self, owner: Optional["OffloadActivations"], after: bool) -> None:
        self._owner = weakref.ref(owner) if owner is not None else None
        self._after = after

    @run_eagerly
    def __call__(self, module: torch.nn.Module, args: Any, output: Any = None) -> None:
        owner = self._owner() if self._owner is not None else None
        if owner is None or not owner.active:
            return
        if self._after:
            owner._after_layer(output)
        else:
            owner._before_layer()

    def __deepcopy__(self, memo: dict[int, Any]) -> "_LayerHook":
        return _LayerHook(None, self._after)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_LayerHook, (None, self._after))


class _RecomputeForward:
    """Stands in for a layer's ``forward`` and runs it under non-reentrant checkpointing when
    the plan recomputes the layer being run (a weight-shared module is decided per call).

    Like the hooks, it holds its context weakly, and its copies simply call the copied forward.
    """

    __slots__ = ("_owner", "fn")

    def __init__(self, owner: Optional["OffloadActivations"], fn: Any) -> None:
        self._owner = weakref.ref(owner) if owner is not None else None
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self._owner() if self._owner is not None else None
        if owner is not None and owner.active and owner._recompute_current():
            # The pre-hook has opened the layer's group: checkpoint's inputs are saved into it
            # (and offloaded), everything inside goes to checkpoint's own hooks.
            return checkpoint(self.fn, *args, use_reentrant=False, **kwargs)
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> "_RecomputeForward":
        return _RecomputeForward(None, copy.deepcopy(self.fn, memo))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_RecomputeForward, (None, self.fn))


class OffloadActivations:
    """One ``with`` around the whole forward; layer boundaries come from module hooks.

    ``layers`` are the modules that form the repeated layers (e.g. ``model.layers``), in call
    order; a module listed several times (weight-shared layers, ALBERT-style) is one layer per
    call. By default all but the last are offloaded (``num_offload_layers=len(layers) - 1``).
    ``enabled=False`` turns offloading off (the ``with`` does nothing). The other options are
    those of :func:`offload.get_cpu_offload_context`.

    Checkpointing composes: layers run under ``torch.utils.checkpoint`` (reentrant or not,
    around ``forward`` or ``__call__``, e.g. HF ``gradient_checkpointing_enable``) offload only
    their checkpoint inputs, which come back before the layer's recompute.

    Plans (per layer keep / offload / recompute, see ``offload.planner``):
    ``memory_budget_bytes=N`` (or ``"lowest"``) runs its first step plainly (warm-up), the
    second with one layer recomputed (calibration), probes the third (plainly), then plans and
    follows the fastest plan whose predicted peak fits ``N`` from the fourth step on;
    ``plan=offload.plan(...)`` follows a plan made beforehand. Recomputed layers are run under
    non-reentrant checkpointing here: leave the model's own checkpointing off.
    :attr:`plan` is the plan in force and :meth:`plan_report` its table with the measured step
    time (and peak with ``measure_peak=True``, which resets CUDA's peak-memory counter at each
    planned step's entry to read the step's own peak).
    """

    def __init__(
        self,
        layers: Iterable[torch.nn.Module],
        num_offload_layers: Optional[int] = None,
        *,
        enabled: bool = True,
        plan: Optional[Plan] = None,
        memory_budget_bytes: Budget = None,
        measure_peak: bool = False,
        **options: Any,
    ) -> None:
        self.layers = list(layers)
        if not self.layers or not all(isinstance(m, torch.nn.Module) for m in self.layers):
            raise ValueError(
                "offload: OffloadActivations needs a non-empty list of nn.Module layers (e.g. model.layers)"
            )
        count = len(self.layers)
        self.budget = check_budget(memory_budget_bytes, "OffloadActivations:")
        planned = plan is not None or self.budget is not None
        if planned:
            if plan is not None and self.budget is not None:
                raise ValueError("offload: OffloadActivations takes plan or memory_budget_bytes, not both")
            if num_offload_layers is not None or "num_layers" in options:
                raise ValueError(
                    "offload: OffloadActivations takes num_offload_layers (a fixed count) or a plan / "
                    "memory_budget_bytes (per-layer actions), not both"
                )
            if plan is not None and len(plan.layers) != count:
                raise ValueError(
                    f"offload: the plan was made for {len(plan.layers)} layers, but {count} layers "
                    "were given; make the plan for this model (offload.plan(layers, step_fn, ...))"
                )
            num_offload_layers = 0  # until the plan's schedule takes over
        if num_offload_layers is None:
            num_offload_layers = count - 1
        options.setdefault("num_layers", num_offload_layers)
        if options["num_layers"] != num_offload_layers:
            raise ValueError("offload: OffloadActivations takes num_offload_layers or num_layers, not both")
        options.setdefault("model_layers", count)
        # The layers' parameters and buffers (and views of them) are never copied.
        options.setdefault("params_from", self.layers)
        self.enabled = bool(enabled)
        self.engine = build_engine(layer_contexts=False, **options) if self.enabled else None
        self.measure_peak = bool(measure_peak)
        self.plan: Optional[Plan] = None
        self._last_step: Optional[tuple[Any, Any, Optional[int]]] = None  # (start, end, peak)
        self._probe: Optional[ProbeStep] = None
        self._warmup_left = 2  # steps before the probe (a budget without a plan): plain, calibration
        self._recompute_peak: Optional[tuple[int, int, float]] = None  # from the calibration step
        self._step_mark: Any = None
        if self.engine is not None and plan is not None:
            self._follow(plan)
        self.active = False
        self._tracking = False  # this forward is tracked (grad enabled at entry)
        self._handles: list[Any] = []

    # -- the with ----------------------------------------------------------------------------------
    @run_eagerly
    def __enter__(self) -> "OffloadActivations":
        if self.active:
            raise RuntimeError("offload: this OffloadActivations is already active; it does not nest")
        if self.engine is None:
            return self
        planning = self.budget is not None or self.plan is not None
        if planning and torch.is_grad_enabled():
            self._between_steps()
            if self.plan is None:
                # A cold step would skew the probe: the first runs plainly, the second too but
                # recomputes one layer to calibrate what recompute costs, the third (plain) is
                # measured.
                if self._warmup_left > 1:
                    self._warmup_left -= 1
                    return self
                calibrate = self._warmup_left > 0
                self._warmup_left -= calibrate
                device = self.engine.transport.device
                policy = probe_policy(device, self.engine.policy.min_offload_bytes, self.engine.policy.selection)
                self._probe = ProbeStep(self.layers, policy, device, calibrate_recompute=calibrate)
                self._probe.begin()
                self._tracking = True
                return self
        if not self._handles:
            self._register_hooks()
        self._tracking = self.engine.begin_forward()
        self.active = self._tracking
        return self

    @run_eagerly
    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.engine is None or not self._tracking:
            return
        self.active = False
        self._tracking = False
        if self._probe is not None and self.plan is None:
            self._probe.end_forward()
            if exc_type is not None:
                self._probe = None  # probe again on the next step
                self._warmup_left = 1
            return
        if exc_type is not None:
            self.engine.abort_step()
            return
        counted = self.engine.step.layers_started if self.engine.step is not None else 0
        self.engine.finish_forward()
        if counted != len(self.layers):
            self.engine.warn_once(
                "count",
                f"offload: the forward ran {counted} of the {len(self.layers)} layers given to "
                "OffloadActivations; pass the modules one forward really calls, in call order",
            )

    # -- plans -------------------------------------------------------------------------------------
    def _between_steps(self) -> None:
        # Called at the entry of a planned step: the previous step (forward, backward and
        # whatever the loop did after it) is over, so its figures are final.
        device = self.engine.transport.device  # type: ignore[union-attr]
        cuda = device.type == "cuda"
        mark = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
        if cuda:
            mark.record()
        probe, self._probe = self._probe, None
        if probe is not None and probe.calibrating:  # the warm-up step
            probe.end_step()
            self._recompute_peak = probe.recompute_peak()
        elif probe is not None:
            probe.end_step()
            profile = probe.profile(measure_link(device), recompute_peak=self._recompute_peak)
            self._follow(choose(profile, self.budget))
        elif self._step_mark is not None:
            # Read lazily (plan_report): reading the events now would make the host wait.
            peak = torch.cuda.max_memory_allocated(device) if cuda and self.measure_peak else None
            self._last_step = (self._step_mark, mark, peak)
        if cuda and self.measure_peak:
            torch.cuda.reset_peak_memory_stats(device)
        self._step_mark = mark

    def _follow(self, plan: Plan) -> None:
        if plan.profile is None:
            raise ValueError("offload: this plan carries no profile; make it with offload.plan(...)")
        self.plan = plan
        self.engine.schedule = PlannedSchedule(plan, plan.profile)  # type: ignore[union-attr]
        self.engine.model_layers = len(plan.layers)  # type: ignore[union-attr]
        self.engine.mode = "planned"  # type: ignore[union-attr]
        if plan.recomputes():
            self._install_recompute()

    @run_eagerly  # reads engine state: a plain value for the compiled forward, not a guard
    def _recompute_current(self) -> bool:
        engine = self.engine
        return engine is not None and engine.in_layer and engine.schedule.recomputes(engine.current_layer)

    def _install_recompute(self) -> None:
        for module in dict.fromkeys(self.layers):
            if not isinstance(module.__dict__.get("forward"), _RecomputeForward):
                module.forward = _RecomputeForward(self, module.forward)

    def plan_report(self) -> str:
        """The plan in force, layer by layer, with predicted and (after a step) measured figures."""
        if self.plan is None:
            return "offload: no plan yet (the first step of a memory budget is the probe)"
        return self.plan.table(measured=self.measured)

    @property
    def measured(self) -> Optional[dict[str, Any]]:
        """The last whole planned step's time (entry to next entry) and peak (``measure_peak``)."""
        if self._last_step is None:
            return None
        return step_figures(*self._last_step)

    def _register_hooks(self) -> None:
        # One pair of hooks per distinct module: a module listed twice is called twice.
        for module in dict.fromkeys(self.layers):
            self._handles.append(module.register_forward_pre_hook(_LayerHook(self, after=False)))
            self._handles.append(module.register_forward_hook(_LayerHook(self, after=True)))

    def close(self) -> None:
        """Remove the module hooks and checkpoint wrappers (inert outside the ``with`` anyway)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module in dict.fromkeys(self.layers):
            if isinstance(module.__dict__.get("forward"), _RecomputeForward):
                del module.forward

    # -- layer boundaries --------------------------------------------------------------------------
    def _before_layer(self) -> None:
        self.engine.begin_layer()  # type: ignore[union-attr]

    def _after_layer(self, output: Any) -> None:
        layer = self.engine.end_layer()  # type: ignore[union-attr]
        if layer is None:
            return
        marked = first_grad_tensor(output)
        if marked is not None:
            self.engine.attach_backward_marker(marked, layer)  # type: ignore[union-attr]

    # -- figures -----------------------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, Any]:
        """Figures of the last finished step (see ``offload.stats.snapshot``); ``{}`` when disabled."""
        return self.engine.stats() if self.engine is not None else {}

    def report(self) -> str:
        """A readable table of :attr:`stats`."""
        if self.engine is None:
            return "offload report: disabled (enabled=False)"
        return self.engine.report()
