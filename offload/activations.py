"""``OffloadActivations``: one ``with`` around the whole forward; layers found by module hooks.

The saved-tensor hooks are pushed once for the whole forward (see ``lifecycle.py``), and forward
pre-hooks / hooks on the given layer modules move the engine from one layer's group to the next.
Because the hooks stay *outside* the layers, a ``torch.utils.checkpoint`` inside or around a layer
keeps its own hooks innermost, and only the checkpoint's inputs reach the engine.

The module hooks are registered on first entry and removed by :meth:`OffloadActivations.close`.
Outside the ``with`` they return at once. They hold the context only through a weak reference, and
a copy of them (``copy.deepcopy(model)``, pickling) is an inert hook, so a model that carries them
can still be copied or saved.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Iterable, Optional, Union

import torch

from .api import ENGINE_OPTIONS, _check_bool, build_engine, check_option_values, check_unknown_options
from .layers.args import (
    COMPILED_FIRST, NO_LAYER_RAN, check_bytes_form, check_offload_count, check_plan, check_torchtune_options,
    default_budget, default_inputs, dynamo_compiled_code, layer_list, prune_dead_hooks, second_entry_error,
    second_forward_error,
)
from .engine.schedules.auto import ScheduleAuto
from .engine.stats import DISABLED_REPORT, StepStats, disabled_stats
from .engine.eager import run_eagerly
from .engine.step import first_grad_tensor
from .planner.make import Budget, check_budget
from .planner.sequence import AUTO, check_probe
from .planner.types import Plan
from .plan_steps import PlannedSteps
from .planner.ahead_steps import check_plan_ahead
from .forwards.plan_wrappers import install_plan_wrappers, remove_plan_wrappers
from .forwards.selective import Candidates, describe_candidates, selective_candidates
from .layers.attention_graphs import AttentionGraphs, attention_graphs_wanted
from .layers.hooks import GroupBoundary as _GroupBoundary, LayerHook as _LayerHook
from .layers import model_form
from .sizes import byte_count, byte_options


# Copies in flight before the oldest group is released: one group computing while the previous
# one's copy finishes, as in v2's layer budget.
DEFAULT_STASH_GROUPS = 2


class OffloadActivations:
    """One ``with`` around the whole forward: ``layers`` given, or groups found by bytes.

    **With layers** (``OffloadActivations(model.layers)``): layer boundaries come from module
    hooks on ``layers``, the modules that form the repeated layers, in call order; a module listed
    several times (weight-shared layers, ALBERT-style) is one layer per call. Given no count, plan
    or budget, it plans for ``memory_budget_bytes="device"`` on CUDA (below; its first steps are
    probe steps) and offloads all layers but the last on the CPU, with the v1 schedule or
    ``manual_synchronization``, and for layers the model checkpoints itself
    (:func:`offload.layers.args.default_budget`); :attr:`budget` says which. ``num_offload_layers=N``
    offloads layers ``0..N-1`` everywhere; with it, layers that save less than ``group_bytes``
    (default 32 MiB; 0: off) share one copy with the next (as in
    :func:`offload.get_cpu_offload_context`).

    **Without layers** (``OffloadActivations()``, torchtune's form): the forward is cut into
    groups by bytes. A group closes at the end of the first module call (any ``nn.Module``) after
    it holds ``group_bytes`` (default 32 MiB) of offloadable tensors, and the output of that call
    carries the group's backward marker. A group's D2H starts when ``keep_last_groups`` (default 1)
    later groups have closed, so the last group(s) of the forward never leave the GPU (backward
    needs them first); a group is released once ``max_fwd_stash_size`` (default 2) later copies
    have started, and all are released when the forward ends. In backward, reaching a group's
    marker reloads it and prefetches the two before it; a group needed earlier is reloaded on its
    first unpack. Code that calls no module (pure functions) makes one group, which is the tail:
    nothing is offloaded, and a warning says so. ``NVTE_CPU_OFFLOAD_V1=1`` (or ``mode="v1"``)
    only changes the default selection to opt-in (``mark_activation_offload``) here.

    torchtune's options keep their meanings (``min_offload_size`` is ``min_offload_bytes``; ``max_fwd_stash_size``
    counts groups here); ``use_pin_memory=False`` and ``use_streams=False`` are refused. Use
    :class:`offload.keep_on_gpu` for torchtune's ``NoOpManager``.

    The ``with`` goes around the forward; a ``loss.backward()`` inside it is harmless (same
    gradients and memory), a second ``with`` around the backward alone is refused or warned of.

    ``enabled=False`` turns offloading off (the ``with`` does nothing). The other options are
    those of :func:`offload.get_cpu_offload_context`; ``device=None`` is the current CUDA device,
    or, on a machine without CUDA, ``"cpu"`` (the host transport). ``num_layers`` is accepted as
    the alias of ``num_offload_layers``.

    Threads: one context runs one forward at a time, but each thread may have its own context on
    the same model; the module hooks of each act only in the thread whose ``with`` is open.
    ``torch.compile``: create the context before the first compiled call (code compiled before
    the module hooks existed never calls them; a warning says how to recompile). Layers under
    ``torch.utils.checkpoint`` (HF's included) offload only their checkpoint inputs.

    Plans (per layer keep / offload / recompute, each kept or offloaded layer with or without its
    MLP under selective recompute; see ``offload.planner``; with layers only):
    ``memory_budget_bytes=N`` (bytes: an int, a float, or a size such as ``"20GB"`` or
    ``"20 GiB"``, read as :func:`offload.get_cpu_offload_context` reads its byte counts; or
    ``"device"``, ``"lowest"``) measures its first steps (probe
    steps, :mod:`offload.planner.sequence`: with ``probe="auto"`` the first runs every layer
    checkpointed, so it fits wherever checkpointing fits, and the plain step is probed only where
    it is predicted to fit the GPU and a budget in bytes: every step stays within ``N``), then
    follows the fastest plan whose predicted peak fits ``N``: from the fourth step on, or the
    third when the plain step does not fit. ``selective``: the
    submodules a plan may run selectively (default each layer's ``mlp``; False: none; see
    :func:`offload.forwards.selective.selective_candidates`); pass the same to ``offload.plan`` and here.
    ``plan=offload.plan(...)`` follows a plan made beforehand. Each batch shape gets its plan, made
    in the background (``plan_ahead``, default on CUDA); ranks of ``plan_group`` (default all; False:
    none) agree on it. Recomputed layers run under non-reentrant checkpointing: leave the model's own
    off. :attr:`plan` is the plan in force, :meth:`plan_report` its table with measured time and peak
    (``measure_peak``, default on CUDA). ``model=`` (a HF ``*ForCausalLM``): plans may also tile its
    LM head and loss and the MLPs where nothing untiled fits (long context), and a long first batch is
    probed short (:mod:`offload.layers.model_form`; ``short_probe=False``: at its full length).
    """

    def __init__(
        self,
        layers: Optional[Iterable[torch.nn.Module]] = None,
        num_offload_layers: Optional[int] = None,
        *,
        enabled: bool = True,
        plan: Optional[Plan] = None,
        memory_budget_bytes: Budget = None,
        measure_peak: Optional[bool] = None,
        probe: Optional[str] = None,
        selective: Candidates = None,
        plan_group: Any = None,
        model: Optional[torch.nn.Module] = None,
        short_probe: bool = True,
        plan_ahead: Union[None, bool, Iterable[int]] = None,
        group_bytes: Optional[int] = None,
        keep_last_groups: Optional[int] = None,
        use_pin_memory: bool = True,
        use_streams: Optional[bool] = None,
        max_fwd_stash_size: Optional[int] = None,
        min_offload_size: Optional[int] = None,
        **options: Any,
    ) -> None:
        api = "OffloadActivations"
        # Every name is checked first, enabled or not: a misspelt option would otherwise go
        # unnoticed until offloading is turned on.
        check_unknown_options(api, [name for name in options if name not in ENGINE_OPTIONS])
        _check_bool(api, "enabled", enabled)
        _check_bool(api, "short_probe", short_probe)
        if measure_peak is not None:
            _check_bool(api, "measure_peak", measure_peak)
        plan_ahead = check_plan_ahead(api, plan_ahead)
        min_offload_size = check_torchtune_options(use_pin_memory, use_streams, max_fwd_stash_size, min_offload_size)
        # Byte counts as whole bytes from here on ("20GB", 20e9: offload.sizes), checked once.
        options = byte_options(api, options)
        if group_bytes is not None:
            group_bytes = byte_count(api, "group_bytes", group_bytes, 0, extra=" or None (the default)")
        if min_offload_size is not None:
            if "min_offload_bytes" in options:
                raise ValueError(
                    "offload: OffloadActivations takes min_offload_size (torchtune's name) or "
                    "min_offload_bytes, not both; they are the same option"
                )
            options["min_offload_bytes"] = min_offload_size
        self.enabled = enabled
        self.auto = layers is None
        self.measure_peak = bool(measure_peak)  # resolved below for planned steps (None: on CUDA)
        # Plans and probe steps (with layers, given a plan or a budget, and enabled).
        self._planned: Optional[PlannedSteps] = None
        self._probe_step = False  # the step in progress runs under a probe, not the engine
        self._budget: Budget = None  # as given or defaulted (a disabled context keeps it too)
        self._budget_default = False  # _budget is the default's "device", not the caller's
        self._candidates: list[torch.nn.Module] = []
        self.active = False
        self._tracking = False  # this forward is tracked (grad enabled at entry)
        self._handles: list[Any] = []
        self._boundary: Any = None  # the global module hook of the no-layers form, while open
        self._thread = 0
        self._entered = False  # inside this context's with (any step: probe, planned, fixed)
        self._model: Optional[torch.nn.Module] = None  # model=: its forward is seen (model_form)
        self._short_probe = short_probe  # model=: a long first batch is probed cut short
        # Disabled: the modules whose FP8 weight copies stats counts (params_from's, as enabled).
        self._weight_modules: list[torch.nn.Module] = []
        self._attention = AttentionGraphs(False)  # on CUDA with layers: set below
        if self.auto:
            planner = {"plan": plan is not None, "memory_budget_bytes": memory_budget_bytes is not None,
                       "probe": probe is not None, "selective": selective is not None, "measure_peak": measure_peak,
                       "plan_group": plan_group is not None, "model": model is not None,
                       "short_probe": not short_probe, "plan_ahead": plan_ahead is not None}
            self._init_auto(num_offload_layers, [name for name, given in planner.items() if given], group_bytes,
                            keep_last_groups, max_fwd_stash_size, options)
            return
        for name, value in (("keep_last_groups", keep_last_groups), ("max_fwd_stash_size", max_fwd_stash_size)):
            if value is not None:
                raise ValueError(
                    f"offload: OffloadActivations: {name} applies to the form without layers, where "
                    "groups are found by bytes; with layers, num_offload_layers (or a plan) decides "
                    "what is offloaded and the layer budget how long copies may run"
                )
        self.layers = layer_list(layers)
        count = len(self.layers)
        self._budget = check_budget(memory_budget_bytes, "OffloadActivations:")
        probe = check_probe(AUTO if probe is None else probe, "OffloadActivations:")
        check_plan(plan)
        self._candidates = selective_candidates(self.layers, selective)
        if plan is not None and plan.selects() and not self._candidates:
            raise ValueError(
                "offload: the plan runs some layers' candidates under selective recompute, but "
                f"selective={describe_candidates(selective)} finds none here; pass the selective= given to offload.plan"
            )
        # num_layers is accepted as an alias (TransformerEngine's name): errors name the one given.
        name, count_given = "num_offload_layers", num_offload_layers
        if "num_layers" in options:
            alias = options.pop("num_layers")
            if num_offload_layers is not None and alias != num_offload_layers:
                raise ValueError("offload: OffloadActivations takes num_offload_layers or num_layers, not both")
            if num_offload_layers is None:
                name, count_given = "num_layers", alias
        # Told no count, plan or budget: "device" on CUDA, the fixed count elsewhere (default_budget).
        self._budget = default_budget(count_given=count_given is not None, plan_given=plan is not None,
                                      budget=self._budget, **default_inputs(self.layers, options))
        self._budget_default = memory_budget_bytes is None and self._budget is not None
        planned = plan is not None or self._budget is not None
        if group_bytes is not None:
            if planned and group_bytes != 0:  # 0 (off) is what a plan does anyway
                raise ValueError(
                    "offload: OffloadActivations: group_bytes with layers lets small layers share "
                    "one copy under a fixed num_offload_layers; a plan or memory budget decides per "
                    "layer instead: drop group_bytes, or pass num_offload_layers"
                )
            if not planned:
                options["group_bytes"] = group_bytes
        if planned:
            if plan is not None and self._budget is not None:
                raise ValueError("offload: OffloadActivations takes plan or memory_budget_bytes, not both")
            if count_given is not None:
                raise ValueError(
                    f"offload: OffloadActivations takes {name} (a fixed count) or a plan / "
                    "memory_budget_bytes (per-layer actions), not both"
                )
            if plan is not None and len(plan.layers) != count:
                raise ValueError(
                    f"offload: the plan was made for {len(plan.layers)} layers, but {count} layers "
                    "were given; make the plan for this model (offload.plan(layers, step_fn, ...))"
                )
            count_given = 0  # until the plan's schedule takes over
        elif count_given is None:
            count_given = count - 1
            if count_given == 0 and self.enabled:
                warnings.warn(
                    "offload: OffloadActivations got one layer, and by default it offloads all "
                    "layers but the last (backward needs the last one's activations first), so it "
                    "offloads nothing. Pass all the model's repeated layers (e.g. model.layers), or "
                    "OffloadActivations() without layers to find group boundaries by bytes",
                    UserWarning, stacklevel=2,
                )
        else:
            check_offload_count(name, count_given, count, options)
        options["num_layers"] = count_given
        options.setdefault("model_layers", count)
        # The layers' parameters and buffers (and views of them) are never copied.
        options.setdefault("params_from", self.layers)
        if not self.enabled:  # checked all the same: a wrong value must not wait for enabled=True
            self._weight_modules = check_option_values(api, **options)
        self.engine = build_engine(layer_contexts=False, **options) if self.enabled else None
        # A new input shape's attention backward built while its forward runs (cuDNN's plans).
        self._attention = AttentionGraphs(self.enabled and attention_graphs_wanted(self.engine.transport.device))
        if self.engine is not None and planned:
            if measure_peak is None:
                # Planned steps' peaks for the plan table: one reset of CUDA's peak counter at each
                # planned step's entry, nothing measurable; the CPU has no such counter.
                self.measure_peak = self.engine.transport.device.type == "cuda"
            self._planned = PlannedSteps(
                self.engine, self.layers, self._candidates, budget=self._budget, plan=plan, probe=probe,
                measure_peak=self.measure_peak, on_plan=self._install_plan_wrappers, group=plan_group,
                plan_ahead=self.engine.transport.device.type == "cuda" if plan_ahead is None else plan_ahead)
        if model is not None:
            # Given to any context: plans use it; without plans it is checked and left alone.
            self._model = model_form.check_model(model, self.layers)
            if self._planned is not None:
                self._planned.head = model_form.head_info(model)
                model_form.install(self, model)

    def _init_auto(
        self, num_offload_layers: Optional[int], planner_options: list[str], group_bytes: Optional[int],
        keep_last_groups: Optional[int], stash: Optional[int], options: dict[str, Any],
    ) -> None:
        group_bytes, keep_last_groups = check_bytes_form(num_offload_layers, planner_options, group_bytes,
                                                         keep_last_groups, options)
        self.group_bytes = group_bytes
        self.layers = []
        schedule = ScheduleAuto(
            tail=keep_last_groups, stash=DEFAULT_STASH_GROUPS if stash is None else stash
        )
        if not self.enabled:
            self._weight_modules = check_option_values("OffloadActivations", **options)
        self.engine = (
            build_engine(num_layers=0, model_layers=1, layer_contexts=False, schedule=schedule, **options)
            if self.enabled else None
        )

    # -- the with ----------------------------------------------------------------------------------
    @run_eagerly
    def __enter__(self) -> "OffloadActivations":
        if self.active:
            self._refuse_second_entry()
        if self.engine is None:
            return self
        if self.auto:
            self._enter_auto()
            return self
        self._entered, self._thread = True, threading.get_ident()
        try:
            probing = self._planned is not None and torch.is_grad_enabled() and self._planned.enter()
        except BaseException:  # a BudgetError (the ranks' agreed one, or no plan fits): not entered
            self._entered = False
            raise
        if probing:
            # A probe step (offload.plan_steps): its forward runs under the probe, measured or
            # (a warm-up) plainly.
            self._tracking = self._probe_step = self._planned.probe is not None
            return self
        self._start_step()
        return self

    def _start_step(self) -> None:
        if not self._handles:
            self._register_hooks()
        self._tracking = self.engine.begin_forward()  # type: ignore[union-attr]
        # The thread first: a hook in another thread that sees `active` must already see
        # that this forward is not its own.
        self._thread = threading.get_ident()
        self.active = self._tracking

    def _entered_here(self) -> bool:
        return self._entered and self._thread == threading.get_ident() and torch.is_grad_enabled()

    def _model_entry(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], through_module: bool) -> Any:
        # The model's call begins in this context (model_form): a long first batch is probed short. Its shape.
        planned, model = self._planned, self._model
        shape = model_form.call_shape(fn, args, kwargs)
        if planned is not None and model is not None and shape is not None:
            short = model_form.short_step(model, fn, args, kwargs, shape, through_module, planned.head) \
                if planned.profile is None and self._short_probe else None
            if planned.at_model_entry(shape, short, model_form.probe_tokens(planned.head, planned.device)):
                self._probe_step = False
                self._start_step()
        return shape

    def _model_call(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], entered: bool = False) -> Any:
        # The model's forward in this context (``entered``: its entry was seen ahead of an FSDP2 root's hooks).
        shape = model_form.call_shape(fn, args, kwargs) if entered else self._model_entry(fn, args, kwargs, False)
        planned = self._planned  # a planned step is planned for its shape before its head runs
        head_tokens = planned.plan_at_entry(shape) if self.active and planned is not None and shape is not None else 0
        return model_form.run_call(self._model, fn, args, kwargs, head_tokens, planned.head if planned else None)  # type: ignore[arg-type]

    @run_eagerly
    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._entered = False
        self._attention.wait()  # a one-layer model, or a forward that failed in its first layer
        if self.engine is None or not self._tracking:
            return
        self.active = False
        self._tracking = False
        if self.auto:
            self._exit_auto(failed=exc_type is not None)
            return
        if self._probe_step:
            self._probe_step = False
            self._planned.end_forward(exc if exc_type is not None else None)  # type: ignore[union-attr]
            return
        if exc_type is not None:
            self.engine.abort_step()
            return
        counted = self.engine.step.layers_started if self.engine.step is not None else 0
        self.engine.finish_forward()
        if counted == 0 and dynamo_compiled_code():
            self.engine.warn_once("count", COMPILED_FIRST.format(count=len(self.layers)))
        elif counted == 0:  # most often a `with` around the backward, not the forward
            self.engine.warn_once("count", NO_LAYER_RAN.format(count=len(self.layers)))
        elif counted != len(self.layers):
            self.engine.warn_once(
                "count",
                f"offload: the forward ran {counted} of the {len(self.layers)} layers given to "
                "OffloadActivations; pass the modules one forward really calls, in call order",
            )

    # -- the form without layers ------------------------------------------------------------------
    def _enter_auto(self) -> None:
        engine = self.engine
        self._tracking = engine.begin_forward()  # type: ignore[union-attr]
        if not self._tracking:
            return
        try:
            engine.begin_layer()  # type: ignore[union-attr]
        except BaseException:
            self._tracking = False
            engine.abort_step()  # type: ignore[union-attr]
            raise
        self._thread = threading.get_ident()
        # Global, so that any module of any model is a possible boundary; removed at exit.
        self._boundary = torch.nn.modules.module.register_module_forward_hook(_GroupBoundary(self))
        self.active = True

    def _exit_auto(self, failed: bool) -> None:
        if self._boundary is not None:
            self._boundary.remove()
            self._boundary = None
        engine = self.engine
        if failed:
            engine.abort_step()  # type: ignore[union-attr]
            return
        engine.end_layer()  # type: ignore[union-attr]
        engine.finish_forward()  # type: ignore[union-attr]

    def _module_done(self, output: Any) -> None:
        # After any module call in the forward: cut the group here once it is big enough. Not in
        # other threads, not under no_grad (a frozen module: the next group must open with grad
        # on), not in backward (a checkpoint recomputing).
        if threading.get_ident() != self._thread or not torch.is_grad_enabled() \
                or torch._C._current_graph_task_id() != -1:
            return
        engine = self.engine
        group = engine.forward.open_group  # type: ignore[union-attr]
        if group is None or group.saved_bytes < self.group_bytes:
            return
        layer = engine.end_layer()  # type: ignore[union-attr]
        engine.begin_layer()  # type: ignore[union-attr]
        if layer is not None:
            # Its gradient is computed when backward is about to run the closed group's nodes.
            marked = first_grad_tensor(output)
            if marked is not None:
                engine.attach_backward_marker(marked, layer)  # type: ignore[union-attr]

    # -- plans -------------------------------------------------------------------------------------
    @property
    def plan(self) -> Optional[Plan]:
        """The plan in force (None before the probe steps end, or without a plan or budget)."""
        return self._planned.plan if self._planned is not None else None

    @property
    def budget(self) -> Budget:
        """The memory budget plans are made for (``memory_budget_bytes``, or :meth:`set_budget`'s)."""
        return self._planned.budget if self._planned is not None else self._budget

    def set_budget(self, memory_budget_bytes: Budget) -> None:
        """Plan for another budget (bytes, ``"device"`` or ``"lowest"``) from the figures already
        measured, between steps: no probe step runs again. Raises :class:`BudgetError` when no
        plan fits it, and the context stays as it was; before the probe steps are over, the
        plan they lead to is made for the new budget. Under a process group, call it on every
        rank of the plan group with the same budget."""
        where = "OffloadActivations.set_budget:"
        budget = check_budget(memory_budget_bytes, where)
        if budget is None:
            raise ValueError(f"offload: {where} takes a budget: bytes, 'device' or 'lowest', got None")
        if self.active:
            raise RuntimeError(f"offload: {where} call it between steps, not inside the `with`")
        if self.budget is None and self.plan is None:
            raise ValueError(f"offload: {where} this OffloadActivations offloads a fixed number of layers; "
                             "make it with memory_budget_bytes=... (or plan=...) to follow plans")
        if self._planned is not None:
            self._planned.set_budget(budget, where)
        else:  # enabled=False: nothing to plan, the budget is kept
            self._budget = budget
        self._budget_default = False

    @run_eagerly  # reads engine state: a plain value for the compiled forward, not a guard
    def _recompute_current(self) -> tuple[bool, bool]:
        engine = self.engine
        layer = engine.forward.layer if engine is not None and engine.forward.in_layer else None
        return (False, False) if layer is None else (engine.schedule.recomputes(layer), engine.schedule.keeps_attention(layer))

    @run_eagerly  # as _recompute_current
    def _tile_current(self) -> int:
        engine = self.engine
        if engine is None or not self.active or threading.get_ident() != self._thread or not engine.forward.in_layer:
            return 0
        return engine.schedule.tile_tokens(engine.forward.layer)

    @run_eagerly  # as _recompute_current
    def _selective_current(self) -> bool:
        # Only this context's own forward, in its thread, in a layer the plan makes selective.
        engine = self.engine
        return engine is not None and self.active and threading.get_ident() == self._thread \
            and engine.forward.in_layer and engine.schedule.selective(engine.forward.layer)

    def plan_report(self) -> str:
        """The plan in force, layer by layer, with predicted and (after a step) measured figures."""
        if self.plan is None:
            return "offload: no plan yet (the first step of a memory budget is the probe)"
        return "\n".join([self.plan.table(measured=self.measured), *self._planned.ahead_log()])  # type: ignore[union-attr]

    @property
    def measured(self) -> Optional[dict[str, Any]]:
        """The last whole planned step's time (entry to next entry) and peak (``measure_peak``)."""
        return self._planned.measured() if self._planned is not None else None

    def _install_plan_wrappers(self, recompute: bool, selective: bool) -> None:
        # PlannedSteps says what its plans use (a wrapper costs a Python call per module call).
        install_plan_wrappers(self, self.layers if recompute else (), self._candidates if selective else ())

    def _register_hooks(self) -> None:
        # After close() the plan's wrappers are gone with the hooks: both come back together.
        if self._planned is not None:
            self._planned.put_wrappers_on()
            if self._model is not None:
                model_form.install(self, self._model)
        # One pair of hooks per distinct module: a module listed twice is called twice.
        for module in dict.fromkeys(self.layers):
            prune_dead_hooks(module, _LayerHook)
            self._handles.append(module.register_forward_pre_hook(_LayerHook(self, after=False), with_kwargs=True))
            self._handles.append(module.register_forward_hook(_LayerHook(self, after=True)))

    def close(self) -> None:
        """Remove the module hooks and checkpoint wrappers (inert outside the ``with`` anyway) and
        give back the idle pinned host blocks; entering again re-registers and re-pins."""
        if self.engine is not None:
            self.engine.arena.free_idle()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        remove_plan_wrappers(self, self.layers, self._candidates)
        if self._model is not None:
            model_form.uninstall(self, self._model)

    def _refuse_second_entry(self) -> None:
        # One engine runs one forward at a time: a second forward inside the first (or beside
        # it, from another thread) would mix two micro-batches' layers into one step.
        raise second_entry_error(threading.get_ident() != self._thread)

    # -- layer boundaries --------------------------------------------------------------------------
    def _before_layer(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        engine = self.engine
        position = engine.next_layer()  # type: ignore[union-attr]
        if position is not None and (position >= len(self.layers) or module is not self.layers[position]):
            self._check_order(module, position)
        if position == 0 and self._planned is not None:
            self._planned.at_first_layer(args, kwargs)  # the plan for this batch's shape
        if self._attention.enabled and (position == 0 or self._attention.thread is not None):
            self._attention.before_layer(position, len(self.layers), args, kwargs)
        engine.begin_layer()  # type: ignore[union-attr]

    def _check_order(self, module: torch.nn.Module, position: int) -> None:
        # Off the fast path: the module is not the one listed at this position. Skipping ahead
        # (a layer dropped) is fine; going back to a layer this forward already ran means a
        # second forward runs inside this one's `with` (another micro-batch or model), whose
        # layers would be counted as this step's, or a module called more often than listed.
        earlier = [i for i, m in enumerate(self.layers[:position]) if m is module]
        if earlier and not any(m is module for m in self.layers[position:]):
            raise second_forward_error(earlier[-1], position)

    def _after_layer(self, output: Any) -> None:
        if self._attention.watching is not None:
            self._attention.first_layer_done()
        layer = self.engine.end_layer()  # type: ignore[union-attr]
        if layer is None:
            return
        marked = first_grad_tensor(output)
        if marked is not None:
            self.engine.attach_backward_marker(marked, layer)  # type: ignore[union-attr]

    # -- figures -----------------------------------------------------------------------------------
    def __repr__(self) -> str:
        # What a user checks first, offload_trainer's users above all: which layers were found,
        # and what is done with them.
        if self.auto:
            what = f"no layers: groups of {self.group_bytes} bytes"
        else:
            kinds = sorted({type(m).__name__ for m in self.layers})
            what = f"{len(self.layers)} layer{'' if len(self.layers) == 1 else 's'} ({', '.join(kinds[:3])}{', ...' if len(kinds) > 3 else ''})"
            if self.plan is not None:
                what += f", plan: {self.plan.describe()}"
            elif self.budget is not None:
                default = "the default on CUDA; " if self._budget_default else ""
                what += f", memory_budget_bytes={self.budget!r} ({default}planning)"
            elif self.engine is not None:
                what += f", offloading {self.engine.schedule.num_layers} of them"
        return f"OffloadActivations({what}{'' if self.enabled else ', disabled'})"

    @property
    def stats(self) -> StepStats:
        """Figures of the last finished step (or of the step in progress if none finished): every
        key, its unit and meaning in :class:`offload.engine.stats.StepStats`; with ``enabled=False``
        the same keys, ``mode`` ``"disabled"`` and every figure 0 but ``weight_cache_bytes``."""
        return self.engine.stats() if self.engine is not None else disabled_stats(self._weight_modules)

    def report(self) -> str:
        """A readable table of :attr:`stats`; with plans, then what the first steps cost (:attr:`first_steps`)."""
        if self.engine is None:
            return DISABLED_REPORT
        return self.engine.report() + (self._planned.costs.table() if self._planned is not None else "")

    @property
    def first_steps(self) -> list[dict[str, Any]]:
        """What each of the first steps cost, phase by phase, in seconds (:mod:`offload.planner.first_steps`)."""
        return self._planned.costs.rows() if self._planned is not None else []

    def reserve(self, nbytes: int, *, background: bool = False) -> int:
        """Pin ``nbytes`` of host memory for offloaded groups now, so that the first step does
        not stall on pinning (see :meth:`offload.engine.OffloadEngine.reserve`); 0 when
        disabled. Returns the bytes reserved (or queued, with ``background=True``)."""
        if self.engine is None:
            return 0
        return self.engine.reserve(nbytes, background=background)

