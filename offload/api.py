"""The two entry points, the mode switch and argument validation.

- ``get_cpu_offload_context(...)``: TransformerEngine's call shape. One context per layer call::

      ctx, sync = get_cpu_offload_context(enabled=True, num_layers=3, model_layers=4)
      for layer in layers:
          with ctx:
              x = layer(x)
          x = sync(x)

- ``OffloadActivations(layers)``: one ``with`` around the whole forward; layer boundaries come from
  forward hooks on the given modules.
"""

from __future__ import annotations

import numbers
import os
import warnings
from typing import Any, Iterable, Optional, Union

import torch

from .host import native
from .host.arena import HostArena
from .host.numa import placement_for_gpu
from .engine.eager import run_eagerly
from .engine.core import OffloadEngine
from .engine.group import GroupState
from .keywords import reject_unknown
from .sizes import byte_options
from .engine.policy import SELECTIONS, SelectionPolicy
from .engine.schedules import DEFAULT_GROUP_BYTES, ManualSchedule, Schedule, ScheduleV1, ScheduleV2
from .engine.stats import DISABLED_REPORT, StepStats, disabled_stats
from .engine.transport import CudaTransport, HostTransport

MODE_ENV_VAR = "NVTE_CPU_OFFLOAD_V1"
_ENV_TRUE = ("1", "true", "yes")
_ENV_FALSE = ("0", "false", "no", "")
MODES = ("v1", "v2")
# Tensors under this size stay on the GPU by default: each costs hook and bookkeeping CPU time
# (~microseconds) while saving little memory (LayerNorm statistics, scalars, masks).
DEFAULT_MIN_OFFLOAD_BYTES = 64 * 1024


def resolve_mode(mode: Optional[str]) -> str:
    """The schedule to use: an explicit ``mode`` wins, else ``NVTE_CPU_OFFLOAD_V1`` decides."""
    if mode is not None:
        if mode not in MODES:
            raise ValueError(f"offload: unknown mode {mode!r}; use 'v1' or 'v2' (or None to follow {MODE_ENV_VAR})")
        return mode
    raw = os.environ.get(MODE_ENV_VAR)
    if raw is None:
        return "v2"
    value = raw.strip().lower()
    if value in _ENV_TRUE:
        return "v1"
    if value in _ENV_FALSE:
        return "v2"
    raise ValueError(
        f"offload: {MODE_ENV_VAR}={raw!r} is not understood; use 1, true or yes for the v1 schedule, "
        "or 0, false, no or empty (or unset) for v2"
    )


def resolve_device(device: Union[None, str, torch.device]) -> torch.device:
    """``None`` is the current CUDA device, or the CPU (the host transport) where CUDA is absent;
    ``"cpu"`` selects the host transport."""
    if device is None:
        if not torch.cuda.is_available():
            # Every entry point runs as written on a CPU-only machine (a laptop, CI): the host
            # transport is the only one that can run there, and the model is on the CPU anyway.
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())
    dev = torch.device(device)
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"offload: device must be a CUDA device or 'cpu', got {device!r}")
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"offload: device={device!r} asks for CUDA, but CUDA is not available here (no GPU or a "
            "CPU-only torch build); pass device='cpu' to use the host transport"
        )
    return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())


# The options every entry point passes to build_engine, in the order users see them.
ENGINE_OPTIONS = (
    "num_layers", "model_layers", "offload_activations", "offload_weights", "double_buffering",
    "manual_synchronization", "retain_pinned_cpu_buffers", "offload_stream", "mode", "device",
    "min_offload_bytes", "host_budget_bytes", "selection", "params_from", "timing",
    "wait_for_pinning", "group_bytes",
)
# torchtune's OffloadActivations options, accepted with their meanings (see activations.py).
TORCHTUNE_OPTIONS = ("use_pin_memory", "use_streams", "max_fwd_stash_size", "min_offload_size")
ACCEPTED_OPTIONS = {
    "get_cpu_offload_context": ("enabled",) + ENGINE_OPTIONS,
    "OffloadActivations": (
        "layers", "num_offload_layers", "enabled", "plan", "memory_budget_bytes", "measure_peak",
        "group_bytes", "keep_last_groups", "model",
    ) + TORCHTUNE_OPTIONS + ENGINE_OPTIONS,
}


def _got(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(api: str, name: str, value: Any, minimum: int, what: str = "an integer") -> None:
    if not _is_int(value):
        raise TypeError(f"offload: {api}: {name} must be {what} >= {minimum}, got {_got(value)}")
    if value < minimum:
        raise ValueError(f"offload: {api}: {name} must be {what} >= {minimum}, got {value}")


def _check_bool(api: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"offload: {api}: {name} must be True or False, got {_got(value)}")


def _check_choice(api: str, name: str, value: Any, choices: tuple[str, ...], none_means: str) -> None:
    if value is None:
        return
    listed = ", ".join(repr(c) for c in choices)
    if not isinstance(value, str):
        raise TypeError(f"offload: {api}: {name} must be one of {listed} or None ({none_means}), got {_got(value)}")
    if value not in choices:
        raise ValueError(f"offload: {api}: {name} must be one of {listed} or None ({none_means}), got {value!r}")


def check_unknown_options(api: str, unknown: Iterable[str], accepted: Optional[Iterable[str]] = None) -> None:
    """Refuse keyword arguments the public function ``api`` does not take, listing the ones it
    does (``accepted``, by default ``ACCEPTED_OPTIONS[api]``), with a close match if any."""
    reject_unknown(api, unknown, ACCEPTED_OPTIONS[api] if accepted is None else accepted)


def _modules_of(api: str, params_from: Any) -> list[torch.nn.Module]:
    if params_from is None:
        return []
    if isinstance(params_from, torch.nn.Module):
        return [params_from]
    modules = list(params_from) if isinstance(params_from, Iterable) and not isinstance(params_from, (str, bytes)) else None
    if modules is None or not all(isinstance(m, torch.nn.Module) for m in modules):
        raise TypeError(
            f"offload: {api}: params_from must be an nn.Module or an iterable of nn.Module (whose "
            f"parameters and buffers stay on the GPU), got {_got(params_from)}"
        )
    return modules


def _check_counts(
    num_layers: Optional[int], model_layers: int, api: str = "get_cpu_offload_context", *,
    mode: str = "v2", manual: bool = False,
) -> None:
    """The layer counts, as TransformerEngine takes them: v2 offloads at most ``model_layers - 1``
    layers (TE asserts the same), v1 up to all of them (TE v1 has no such limit: the last group's
    window is the last layer), and with manual synchronization ``num_layers`` is not used (TE
    ignores it too; it may be None)."""
    _check_int(api, "model_layers", model_layers, 1)
    if manual and num_layers is None:
        return
    _check_int(api, "num_layers", num_layers, 0)
    if manual:
        return
    limit = model_layers if mode == "v1" else model_layers - 1
    if num_layers > limit:  # type: ignore[operator]
        if mode == "v1":
            raise ValueError(
                f"offload: {api}: num_layers={num_layers} is more than model_layers={model_layers}; "
                "pass at most as many offloaded layers as the model has"
            )
        defaults = (
            " get_cpu_offload_context(True) with the defaults num_layers=1, model_layers=1 describes a "
            "one-layer model, which has no layer to offload (TransformerEngine asserts the same)."
            if (api == "get_cpu_offload_context" and num_layers == 1 and model_layers == 1) else ""
        )
        raise ValueError(
            f"offload: {api}: num_layers={num_layers} is more than model_layers - 1 = {model_layers - 1}. "
            "Backward needs the last layer's activations at once, so at most model_layers - 1 "
            f"layers can be offloaded.{defaults} Lower num_layers or pass the model's true layer count "
            f"as model_layers (the v1 schedule, {MODE_ENV_VAR}=1, and manual_synchronization=True "
            "accept num_layers=model_layers)."
        )


def check_option_values(api: str, **options: Any) -> list[torch.nn.Module]:
    """Check the type and range of each engine option given (:data:`ENGINE_OPTIONS`, by name),
    naming ``api`` and the option; returns the modules of ``params_from``. Enabled or not, an
    entry point checks these up front: a wrong value must not wait until offloading is turned on.
    What depends on offloading being on (the layer counts against each other, the device being
    there) is :func:`build_engine`'s."""
    given = options.get
    _check_choice(api, "mode", given("mode"), MODES, f"follow {MODE_ENV_VAR}")
    for name in ("offload_activations", "offload_weights", "double_buffering", "manual_synchronization",
                 "retain_pinned_cpu_buffers", "wait_for_pinning"):
        if name in options:
            _check_bool(api, name, options[name])
    if "model_layers" in options:
        _check_int(api, "model_layers", options["model_layers"], 1)
    if given("num_layers") is not None or ("num_layers" in options and not given("manual_synchronization")):
        _check_int(api, "num_layers", options["num_layers"], 0)
    byte_options(api, options)
    if given("timing") is not None:
        _check_bool(api, "timing", options["timing"])
    _check_choice(api, "selection", given("selection"), SELECTIONS, "'marked' for v1, 'auto' for v2")
    stream, device = given("offload_stream"), given("device")
    if stream is not None and not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"offload: {api}: offload_stream must be a torch.cuda.Stream or None, got {_got(stream)}")
    if device is not None and not isinstance(device, (str, torch.device, int)):
        raise TypeError(f"offload: {api}: device must be None, a torch.device, a string or an index, got {_got(device)}")
    return _modules_of(api, given("params_from"))


def build_engine(
    *,
    num_layers: Optional[int],
    model_layers: int,
    offload_activations: bool = True,
    offload_weights: bool = False,
    double_buffering: bool = False,
    manual_synchronization: bool = False,
    retain_pinned_cpu_buffers: bool = False,
    offload_stream: Optional["torch.cuda.Stream"] = None,
    mode: Optional[str] = None,
    device: Union[None, str, torch.device] = None,
    min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
    host_budget_bytes: Optional[int] = None,
    selection: Optional[str] = None,
    params_from: Any = None,
    timing: Optional[bool] = None,
    wait_for_pinning: bool = True,
    group_bytes: Optional[int] = None,
    layer_contexts: bool = True,
    schedule: Optional[Schedule] = None,
    _api: Optional[str] = None,
    **unknown: Any,
) -> OffloadEngine:
    """Validate the options and assemble policy, schedule, transport and arena.

    Errors name the public entry point (``_api``; by default ``get_cpu_offload_context``, or
    ``OffloadActivations`` for a step ended explicitly) and the option at fault: ``TypeError``
    for a wrong type or an unknown keyword (the accepted ones are listed), ``ValueError`` for a
    value out of range. ``schedule``: a schedule to use instead of the one the mode and
    ``manual_synchronization`` select (``OffloadActivations()`` without layers); the mode then
    only sets the default selection.
    """
    api = _api or ("get_cpu_offload_context" if layer_contexts else "OffloadActivations")
    check_unknown_options(api, unknown)
    # The options by name, as passed (the parameters above): checked in one place.
    given = {name: value for name, value in locals().items() if name in ENGINE_OPTIONS}
    modules = check_option_values(api, **given)
    sizes = byte_options(api, given)  # "20GB" and the like, as whole bytes
    min_offload_bytes, group_bytes = sizes["min_offload_bytes"], sizes["group_bytes"]
    host_budget_bytes = sizes["host_budget_bytes"]
    resolved_mode = resolve_mode(mode)
    _check_counts(num_layers, model_layers, api, mode=resolved_mode, manual=manual_synchronization)
    if offload_weights:
        warnings.warn(
            "offload: offload_weights=True is accepted for TransformerEngine compatibility, but "
            "weights are not offloaded (parameters stay on the GPU); only activations are",
            stacklevel=3,
        )
    if not offload_activations:
        raise ValueError(
            "offload: offload_activations=False leaves nothing to offload (weights are never "
            "offloaded); pass offload_activations=True, or enabled=False to turn offloading off"
        )
    dev = resolve_device(device)
    if double_buffering and resolved_mode != "v1":
        warnings.warn("offload: double_buffering applies to the v1 schedule only; v2 ignores it", stacklevel=3)
    if selection is None:
        selection = "marked" if resolved_mode == "v1" else "auto"
    shares_groups = schedule is None and not manual_synchronization and resolved_mode == "v2"
    if group_bytes is None:
        group_bytes = DEFAULT_GROUP_BYTES if shares_groups else 0
    elif group_bytes and not shares_groups:
        used = "a plan's schedule" if schedule is not None else (
            "manual_synchronization=True" if manual_synchronization else f"the {resolved_mode} schedule")
        raise ValueError(
            f"offload: {api}: group_bytes={group_bytes} lets small layers share one copy in the v2 "
            f"schedule (a fixed num_layers), but this context runs {used}; drop group_bytes, or use "
            "mode='v2' with num_layers"
        )

    use_native = native.native_available()
    if dev.type == "cuda":
        transport: Union[CudaTransport, HostTransport] = CudaTransport(
            dev, use_native=use_native, d2h_stream=offload_stream, timing=timing
        )
    else:
        transport = HostTransport(use_native=use_native, timing=timing)
    arena = HostArena(
        pinned=transport.pinned,
        budget_bytes=host_budget_bytes,
        retain=retain_pinned_cpu_buffers,
        device_index=transport.device_index,
        # Each rank's pinned blocks on its own GPU's NUMA node (the host transport pins nothing).
        numa=placement_for_gpu(transport.device_index if transport.pinned else None),
        # Opt-in: a group whose block is still being pinned stays on the GPU while it has room,
        # rather than the step stalling on pinning (the first step, or growth). Not the default:
        # the 10% headroom cannot know what the head and backward will still allocate, and a
        # slow first step is better than an out-of-memory error that offloading was to prevent.
        # (Only pinned host memory is ever waited for: the host transport allocates at once.)
        keep_while_pinning=transport.can_keep if isinstance(transport, CudaTransport) and not wait_for_pinning else None,
    )
    policy = SelectionPolicy(
        device_index=transport.device_index,
        min_offload_bytes=min_offload_bytes,
        selection=selection,
        reserve_host_bytes=arena.claim,
        claim_ahead=arena.claim_ahead,
    )
    if schedule is not None:
        label = schedule.name
    elif manual_synchronization:
        # Every layer collects its saved tensors and the user decides which to move, as in
        # TransformerEngine, whose manual mode does not use num_layers.
        schedule = ManualSchedule(model_layers, model_layers)
        label = resolved_mode + " (manual)"
    elif resolved_mode == "v1":
        schedule = ScheduleV1(num_layers, model_layers, double_buffering=double_buffering)  # type: ignore[arg-type]
        label = resolved_mode
    else:
        schedule = ScheduleV2(num_layers, model_layers, group_bytes=group_bytes)  # type: ignore[arg-type]
        label = resolved_mode
    engine = OffloadEngine(
        policy=policy,
        schedule=schedule,
        transport=transport,
        arena=arena,
        mode=label,
        model_layers=model_layers,
        layer_contexts=layer_contexts,
    )
    if modules:
        engine.register_module_storages(*modules)
    return engine


class OffloadContext:
    """The per-layer context of ``get_cpu_offload_context``: enter it around each layer call."""

    def __init__(self, engine: OffloadEngine) -> None:
        self.engine = engine

    @run_eagerly
    def __enter__(self) -> "OffloadContext":
        self.engine.begin_layer()
        return self

    @run_eagerly
    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.engine.end_layer(failed=exc_type is not None)

    @property
    def stats(self) -> StepStats:
        """Figures of the last finished step (or of the step in progress if none finished):
        every key, its unit and meaning in :class:`offload.engine.stats.StepStats`."""
        return self.engine.stats()

    def report(self) -> str:
        """A readable table of :attr:`stats`."""
        return self.engine.report()

    def reserve(self, nbytes: int, *, background: bool = False) -> int:
        """Pin ``nbytes`` of host memory for offloaded groups now, so that the first step does
        not stall on pinning (see :meth:`OffloadEngine.reserve`). Returns the bytes reserved."""
        return self.engine.reserve(nbytes, background=background)


class SyncFunction:
    """``sync_function``: marks a layer's output so backward reaching it triggers reloads."""

    def __init__(self, engine: OffloadEngine) -> None:
        self.engine = engine

    @run_eagerly
    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(
                f"offload: sync_function got {type(tensor).__name__}; pass the layer's output tensor: "
                "its gradient is what tells the engine that backward reached the layer"
            )
        # Under no_grad, or after a frozen layer, no gradient will reach this tensor: nothing to
        # mark (TransformerEngine hands it back unchanged too). Backward then reloads on demand.
        # After a passive layer (recomputed in backward) there is no layer to mark either.
        layer = self.engine.forward.last_closed
        if layer is not None and torch.is_grad_enabled() and tensor.requires_grad:
            self.engine.attach_backward_marker(tensor, layer)
        return tensor


class ManualController:
    """Offload, release and reload layers by hand (``manual_synchronization=True``)."""

    def __init__(self, engine: OffloadEngine) -> None:
        self.engine = engine

    def _group(self, layer: int, action: str) -> Any:
        step = self.engine.step
        group = None if step is None else step.groups.get(layer)
        if group is None:
            raise ValueError(
                f"offload: cannot {action} layer {layer}: it has no offload group in this step "
                f"(layers 0..{self.engine.model_layers - 1} have one once their forward has run "
                "and saved tensors for backward)"
            )
        return group

    @run_eagerly
    def start_offload_layer(self, layer: int) -> None:
        """Start the D2H copy of ``layer``'s saved tensors (after its forward)."""
        group = self._group(layer, "offload")
        if group.state is GroupState.OPEN:
            raise ValueError(f"offload: layer {layer} is still running its forward; offload it after its `with` closes")
        self.engine.start_offload(group)

    @run_eagerly
    def release_activation_forward_gpu_memory(self, layer: int) -> None:
        """Drop ``layer``'s GPU copies once its D2H is done (ordered on the GPU, not the host)."""
        group = self._group(layer, "release")
        if group.state is GroupState.RESIDENT:
            raise ValueError(f"offload: layer {layer} was not offloaded yet; call start_offload_layer({layer}) first")
        self.engine.release(group)

    @run_eagerly
    def start_reload_layer(self, layer: int) -> None:
        """Start the H2D copy of ``layer`` ahead of its backward (once it was released)."""
        group = self._group(layer, "reload")
        if group.state in (GroupState.RESIDENT, GroupState.OFFLOADING):
            raise ValueError(
                f"offload: cannot reload layer {layer}: its activations are still on the GPU; call "
                f"start_offload_layer({layer}) and release_activation_forward_gpu_memory({layer}) first"
            )
        self.engine.start_reload(group)


class DisabledContext:
    """What ``get_cpu_offload_context(enabled=False)`` returns: a layer context that offloads
    nothing but answers like an enabled one (``stats``, ``report()``, ``reserve()``), so a loop
    written for offloading (``with ctx: x = layer(x)``, then ``x = sync(x)``, then
    ``print(ctx.report())``) runs unchanged with offloading turned off.

    ``modules``: those of ``params_from``, whose FP8 weight copies ``stats`` counts, as an enabled
    context does."""

    def __init__(self, modules: Iterable[torch.nn.Module] = ()) -> None:
        self.modules = list(modules)

    def __enter__(self) -> "DisabledContext":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        return None

    @property
    def stats(self) -> StepStats:
        """Every key of :class:`offload.engine.stats.StepStats`, ``mode`` ``"disabled"``, all figures 0
        but ``weight_cache_bytes``."""
        return disabled_stats(self.modules)

    def report(self) -> str:
        """One line saying that offloading is off."""
        return DISABLED_REPORT

    def reserve(self, nbytes: int, *, background: bool = False) -> int:
        """Nothing to pin while disabled: returns 0."""
        return 0


class DisabledController:
    """The manual controller of a disabled context: each call does nothing (there is no layer
    group to move), so a loop written for ``manual_synchronization=True`` runs unchanged."""

    def start_offload_layer(self, layer: int) -> None:
        """Nothing to offload while disabled."""

    def release_activation_forward_gpu_memory(self, layer: int) -> None:
        """Nothing to release while disabled."""

    def start_reload_layer(self, layer: int) -> None:
        """Nothing to reload while disabled."""


def _identity(tensor: Any) -> Any:
    return tensor


def get_cpu_offload_context(
    enabled: bool = False,
    num_layers: Optional[int] = 1,
    model_layers: int = 1,
    offload_activations: bool = True,
    offload_weights: bool = False,
    double_buffering: bool = False,
    manual_synchronization: bool = False,
    retain_pinned_cpu_buffers: bool = False,
    offload_stream: Optional["torch.cuda.Stream"] = None,
    *,
    mode: Optional[str] = None,
    device: Union[None, str, torch.device] = None,
    min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
    host_budget_bytes: Optional[int] = None,
    selection: Optional[str] = None,
    params_from: Any = None,
    timing: Optional[bool] = None,
    wait_for_pinning: bool = True,
    group_bytes: Optional[int] = None,
    **unknown: Any,
) -> tuple[Any, ...]:
    """TransformerEngine-compatible offload context: returns ``(context, sync_function)``.

    With ``manual_synchronization=True`` a third element, a :class:`ManualController`, is
    returned. ``enabled=False`` returns a :class:`DisabledContext` (offloads nothing; ``stats``
    and ``report()`` say so) and the identity function (and a controller whose calls do nothing).

    ``num_layers`` of ``model_layers`` layers are offloaded: at most ``model_layers - 1`` in v2,
    where TransformerEngine asserts the same, so ``get_cpu_offload_context(True)`` with the
    defaults (``num_layers=1, model_layers=1``) raises ``ValueError``; up to ``model_layers`` in v1
    (as TransformerEngine v1 allows). With ``manual_synchronization=True`` every layer collects
    its tensors and ``num_layers`` is not used (it may be None), as in TransformerEngine.
    ``mode`` ("v1"/"v2") wins over the ``NVTE_CPU_OFFLOAD_V1`` environment variable.
    ``device``: None (default) is the current CUDA device, or the CPU where CUDA is absent;
    ``"cpu"`` offloads CPU tensors through the host transport (as on CPU-only machines).
    ``min_offload_bytes``: smaller tensors stay put unless marked with ``mark_activation_offload``.
    ``host_budget_bytes``: cap on host memory held (default: the node's total RAM less a floor
    left for others, divided by ``LOCAL_WORLD_SIZE``; ``stats["host_budget_source"]`` says which).
    Growth is also bounded by what the node has available less that floor (``offload.host.node``).
    ``selection``: "auto" (every eligible tensor) or "marked" (opt-in; v1's default).
    ``params_from``: a module (or modules) whose parameters' and buffers' memory stays on the
    GPU in every form (views, ``.data`` aliases): offloading it would free nothing. Parameters
    and their views are kept without it. ``stats["weight_cache_bytes"]`` counts their FP8
    weight copies.
    ``timing``: record CUDA timing events around copies and stalls for the stats: ``True`` for
    every copy, ``False`` for none, ``None`` (default) for copies of 4 MiB or more, where the two
    events cost nothing measurable next to the transfer.
    ``wait_for_pinning``: what a group does when its pinned host block is not ready yet (the
    first step, or a step whose groups grew; pinning runs at about 10-20 GB/s). ``True``
    (default): the step waits for the block, so its peak is the offloaded one from the first
    step on. ``False``: the group stays on the GPU for this step if the GPU keeps 10% of its
    memory free after it (``stats["kept"]["pinning"]``), and the block is pinned in the
    background for a later step, so the first steps run at about a plain step's speed with a
    higher peak; only for a model whose plain peak (or the head and backward on top of the
    kept groups) fits the GPU. ``reserve`` before the first step avoids both.
    ``group_bytes`` (v2; default None: 32 MiB; 0 turns it off): a layer whose offloaded tensors
    add up to less than this shares its group with the next offloaded layer, so several small
    layers are copied once each way (a copy's fixed host cost exceeds the transfer of a few MiB;
    see ``offload.engine.schedules.v2``). Layers that save more are groups of their own, as
    without it; at most ``group_bytes`` more stay on the GPU while a shared group fills.

    Byte counts (``min_offload_bytes``, ``host_budget_bytes``, ``group_bytes``) take an int, a
    whole float (``20e9``) or a size string: a number and an optional unit, case-insensitive,
    ``B``, ``kB``/``MB``/``GB``/``TB`` (powers of 1000) or ``KiB``/``MiB``/``GiB``/``TiB``
    (powers of 1024), such as ``"20GB"`` or ``"20 GiB"`` (:mod:`offload.sizes`); at most
    ``2**63 - 1``.

    Options are checked here, with errors that name this function and the option: wrong types
    raise ``TypeError`` (unknown keywords too, listing the accepted ones), values out of range
    (and size strings the grammar refuses) ``ValueError``; with ``enabled=False`` too, except the
    layer counts against each other (TransformerEngine's own defaults, ``num_layers=1,
    model_layers=1``, describe no layer to offload) and ``offload_activations=False``, which a
    disabled context means anyway.
    """
    api = "get_cpu_offload_context"
    check_unknown_options(api, unknown)
    _check_bool(api, "enabled", enabled)
    # The engine options, by name, as given (the signature above is TransformerEngine's).
    options = {name: value for name, value in locals().items() if name in ENGINE_OPTIONS}
    if not enabled:
        noop: tuple[Any, ...] = (DisabledContext(check_option_values(api, **options)), _identity)
        return noop + (DisabledController(),) if manual_synchronization else noop
    engine = build_engine(**options, _api=api)
    result: tuple[Any, ...] = (OffloadContext(engine), SyncFunction(engine))
    if manual_synchronization:
        result += (ManualController(engine),)
    return result
