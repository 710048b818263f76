"""``OffloadActivations``' arguments, checked in its users' terms, and what a forward that ran
none of its layers means.

Separate from ``activations.py`` (the context itself) because these are the messages a user reads
first: the layer list (a whole model passed where its layers were expected gets the attribute
that holds them), the offload count (named as the caller named it, bounded by the layers given
rather than by the engine's ``model_layers``), torchtune's options, the diagnosis of a compiled
model whose compiled code never calls the layer hooks and of a second forward inside one ``with``.
Also the removal of dead layer hooks, and what ``OffloadActivations(layers)`` does when told no
count, plan or budget (:func:`default_budget`).
"""

from __future__ import annotations

import sys
from typing import Any, Iterable, Optional, Sequence

import torch

from ..api import MODE_ENV_VAR, MODES, _check_bool, _check_choice, _check_int, _got, resolve_mode
from .find import describe_layers
from ..engine.schedules import DEFAULT_GROUP_BYTES
from ..sizes import byte_count
from ..planner.budget import DEVICE
from ..planner.make import Budget
from ..planner.types import Plan


def check_torchtune_options(
    use_pin_memory: Any, use_streams: Any, max_fwd_stash_size: Any, min_offload_size: Any
) -> Optional[int]:
    """torchtune's ``OffloadActivations`` options: types, ranges, and what has no equivalent.
    Returns ``min_offload_size`` in whole bytes (it takes the forms of ``min_offload_bytes``), or
    None where it was not given."""
    api = "OffloadActivations"
    _check_bool(api, "use_pin_memory", use_pin_memory)
    if not use_pin_memory:
        raise ValueError(
            "offload: OffloadActivations: use_pin_memory=False is not supported: offloaded tensors "
            "go to a pinned host arena that is allocated once and reused every step (no pinned "
            "allocation per tensor); pass host_budget_bytes to cap the host memory it holds"
        )
    if use_streams is not None:
        _check_bool(api, "use_streams", use_streams)
        if not use_streams:
            raise ValueError(
                "offload: OffloadActivations: use_streams=False is not supported: copies always run "
                "on their own streams, ordered by events, and give the same gradients; pass "
                "enabled=False to turn offloading off"
            )
    if max_fwd_stash_size is not None:
        if not isinstance(max_fwd_stash_size, int) or isinstance(max_fwd_stash_size, bool):
            raise TypeError(
                f"offload: OffloadActivations: max_fwd_stash_size must be an integer >= 1 (groups "
                f"whose copies may run before the oldest is released), got {_got(max_fwd_stash_size)}"
            )
        if max_fwd_stash_size < 1:
            raise ValueError(
                f"offload: OffloadActivations: max_fwd_stash_size must be at least 1, got {max_fwd_stash_size}"
            )
    if min_offload_size is None:
        return None
    return byte_count(api, "min_offload_size", min_offload_size, 0)


def check_bytes_form(num_offload_layers: Optional[int], planner_options: list[str], group_bytes: Optional[int],
                     keep_last_groups: Optional[int], options: dict[str, Any]) -> tuple[int, int]:
    """The ``group_bytes`` and ``keep_last_groups`` of ``OffloadActivations()`` without layers
    (defaults filled in, checked); the options that need layers refused, naming each."""
    refused = ["num_offload_layers"] * (num_offload_layers is not None) + planner_options + [
        name for name, given in (
            ("num_layers", "num_layers" in options),
            ("model_layers", "model_layers" in options),
            ("manual_synchronization", bool(options.get("manual_synchronization"))),
            ("double_buffering", bool(options.get("double_buffering"))),
        ) if given
    ]
    if refused:
        raise ValueError(
            f"offload: OffloadActivations() without layers finds group boundaries by bytes, so "
            f"{', '.join(refused)} cannot apply; pass the layer modules first "
            "(OffloadActivations(model.layers, ...)) to use layer counts, plans or manual control"
        )
    group_bytes = DEFAULT_GROUP_BYTES if group_bytes is None else group_bytes
    _check_int("OffloadActivations", "group_bytes", group_bytes, 1, "an integer number of bytes")
    keep_last_groups = 1 if keep_last_groups is None else keep_last_groups
    _check_int("OffloadActivations", "keep_last_groups", keep_last_groups, 1)
    return group_bytes, keep_last_groups


def layer_list(layers: Any) -> list[torch.nn.Module]:
    """``layers`` as a list of modules, or a ``TypeError`` / ``ValueError`` that says what to pass."""
    if isinstance(layers, torch.nn.Module) and not hasattr(type(layers), "__iter__"):
        # A whole model where its layers were expected (a ModuleList or Sequential is a list).
        found = describe_layers(layers)
        where = (f"; in this {type(layers).__name__} that is {found}" if found else
                 f"; no module list of repeated layers was found in this {type(layers).__name__}")
        raise TypeError(
            f"offload: OffloadActivations got the module {type(layers).__name__} where its layers "
            "were expected: pass model.layers (or the module list that holds the repeated "
            f"layers){where}. Or pass no layers (OffloadActivations()) to find group boundaries "
            "by bytes"
        )
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise TypeError(
            "offload: OffloadActivations: layers must be the model's repeated layers (an iterable "
            f"of nn.Module such as model.layers) or None, got {_got(layers)}"
        )
    listed = list(layers)
    if not listed:
        raise ValueError(
            "offload: OffloadActivations needs a non-empty list of nn.Module layers (e.g. "
            "model.layers), or no layers at all to find group boundaries by bytes"
        )
    for i, m in enumerate(listed):
        if not isinstance(m, torch.nn.Module):
            raise TypeError(
                f"offload: OffloadActivations: layers[{i}] is {_got(m) if len(repr(m)) <= 60 else type(m).__name__}, "
                "not an nn.Module; pass the model's repeated layer modules (e.g. model.layers)"
            )
    return listed


def check_plan(plan: Any) -> None:
    """``plan=``: None or an :class:`offload.planner.Plan`; a ``TypeError`` that says how to get
    one otherwise. A dict (``plan.to_dict()``, saved as JSON) is refused rather than loaded: one
    loader, :meth:`Plan.from_dict`, checks it, and :attr:`OffloadActivations.plan` then is the
    object the caller holds."""
    if plan is None or isinstance(plan, Plan):
        return
    if isinstance(plan, dict):
        how = "it looks like plan.to_dict()'s data: pass offload.planner.Plan.from_dict(d)"
    elif isinstance(plan, (str, bytes)):
        how = ("to follow a plan saved with json.dump(plan.to_dict(), f), pass "
               "offload.planner.Plan.from_dict(json.load(f)); for a budget, use memory_budget_bytes")
    else:
        how = "pass offload.plan(layers, train_step, ...)'s result or offload.planner.Plan.from_dict(d)"
    raise TypeError(
        f"offload: OffloadActivations: plan must be an offload.planner.Plan or None, got "
        f"{_got(plan) if len(repr(plan)) <= 60 else type(plan).__name__}; {how}"
    )


def check_offload_count(name: str, value: Any, count: int, options: dict[str, Any]) -> None:
    """``num_offload_layers`` (or its alias ``name``) against the ``count`` layers given, in
    OffloadActivations' own terms (the engine's check speaks of model_layers, which its users
    never set)."""
    api = "OffloadActivations"
    _check_int(api, name, value, 0)
    mode = options.get("mode")
    _check_choice(api, "mode", mode, MODES, f"follow {MODE_ENV_VAR}")
    if resolve_mode(mode) == "v1":
        if value > count:
            raise ValueError(
                f"offload: {api}: {name}={value} is more than the {count} layers given; pass at "
                f"most {count}"
            )
        return
    if value > count - 1:
        raise ValueError(
            f"offload: {api}: {name}={value} is more than {count - 1}: of the {count} layers "
            "given, backward needs the last one's activations at once, so at most all but the "
            f"last can be offloaded. Pass at most {count - 1} (the default), or leave "
            f"{name} out"
        )


# A `with` in which none of the layers ran, and no compiled code to blame (OffloadActivations' notes).
NO_LAYER_RAN = (
    "offload: none of the {count} layers given to OffloadActivations ran inside this `with`. If it "
    "held the backward (or the optimizer's step), put it around the forward only: `with oa: loss = "
    "model(x)`, then `loss.backward()` (after the `with`, or inside that same one). Otherwise pass "
    "the modules the forward really calls, in call order (e.g. model.model.layers)"
)

COMPILED_FIRST = (
    "offload: the forward ran none of the {count} layers given to OffloadActivations, and "
    "torch.compile has compiled code in this process: code compiled before OffloadActivations "
    "registered its layer hooks (on its first `with`) never calls them, because Dynamo does not "
    "guard on module hooks by default (torch._dynamo.config.skip_nnmodule_hook_guards), so "
    "nothing is offloaded. Enter the OffloadActivations before the first compiled call (create "
    "it before the first step), or call torch.compiler.reset() once after its first `with` so "
    "that the model is compiled again with the hooks, or set "
    "torch._dynamo.config.skip_nnmodule_hook_guards = False before compiling"
)


def dynamo_compiled_code() -> bool:
    """Whether Dynamo has compiled any frame in this process (never imports Dynamo)."""
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    codes = getattr(convert_frame, "input_codes", None)
    return bool(getattr(codes, "seen", None))


def second_entry_error(other_thread: bool) -> RuntimeError:
    """The error for an ``OffloadActivations`` entered while its ``with`` is open: from another
    thread (``other_thread``) or inside itself."""
    if other_thread:
        return RuntimeError(
            "offload: this OffloadActivations is running a forward in another thread; one "
            "OffloadActivations serves one forward at a time. Give each thread (each model or "
            "micro-batch stream run concurrently) its own OffloadActivations."
        )
    return RuntimeError(
        "offload: this OffloadActivations is already active (its `with` is open); it does not "
        "nest. Enter it once per forward: micro-batches one after another, each in its own "
        "`with` (their backwards may come later, as in a pipeline's 1F1B order), and give "
        "another model its own OffloadActivations."
    )


def second_forward_error(earlier: int, position: int) -> RuntimeError:
    """The error for ``layers[earlier]`` called again as layer ``position`` of one forward."""
    return RuntimeError(
        f"offload: OffloadActivations saw layers[{earlier}] called again as layer "
        f"{position} of this forward: a second forward (another micro-batch, or another "
        "model sharing these layers) ran inside this `with`, which would mix two forwards' "
        "layers into one step. Enter the `with` once per forward (micro-batches one after "
        "another; their backwards may come later, as in a pipeline), or give each stream its "
        "own OffloadActivations. A module that one forward calls several times (shared "
        "weights) must be listed once per call, in call order."
    )


def prune_dead_hooks(module: torch.nn.Module, kind: type) -> None:
    """Remove ``module``'s forward (pre-)hooks of class ``kind`` whose context is gone (``dead``)."""
    # Hooks of contexts that were garbage collected without close() (one OffloadActivations per
    # step, say) do nothing but would still be called on every forward, more each step. Removed
    # when a new context registers, never from a finalizer: one could run in the middle of a
    # module call that is iterating these dicts.
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for key in [k for k, hook in hooks.items() if isinstance(hook, kind) and hook.dead]:
            del hooks[key]


# -- the default: what OffloadActivations(layers) does when told neither a count nor a plan --------
def default_budget(
    device_type: str, *, count_given: bool, plan_given: bool, budget: Budget, mode: str = "v2",
    manual: bool = False, checkpointed: bool = False,
) -> Budget:
    """The memory budget ``OffloadActivations(layers, ...)`` plans for: ``budget`` if one was
    given; ``"device"`` (the fastest plan that fits what the GPU can give) where nothing else
    says what to do and the device is CUDA; otherwise None, the fixed count (all layers but the
    last offloaded). Pure: :func:`default_inputs` reads its arguments from the options.

    Why plan by default on CUDA: the fixed count loses to checkpointing on both time and peak at
    long context, where a plan mixes keep, offload and recompute per layer (issue 33). Why not
    everywhere: an explicit count (``count_given``) or ``plan`` is the user's choice; on the CPU
    there is no allocator to size a plan to (``"device"`` is refused there); the v1 schedule
    (``mode``, asked for by name or ``NVTE_CPU_OFFLOAD_V1``) and ``manual`` synchronization are
    schedules a plan would replace; and layers under the model's own checkpointing
    (``checkpointed``) would be recomputed twice by a plan's recompute, where the fixed count
    composes with it (each layer offloads its checkpoint inputs).
    """
    if budget is not None or plan_given or count_given:
        return budget
    if device_type != "cuda" or mode == "v1" or manual or checkpointed:
        return None
    return DEVICE


def device_type(device: Any) -> str:
    """The type of the device :func:`offload.api.resolve_device` makes of ``device`` (``None``:
    CUDA where it is available, else the CPU), read without initialising CUDA. A value it would
    refuse reads as ``"cpu"`` here: the engine's own checks raise for it, in their words."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, int) and not isinstance(device, bool):
        return "cuda"  # an index: torch's current accelerator, which here can only be CUDA
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError, ValueError):
        return "cpu"


def checkpointed(layers: Sequence[torch.nn.Module]) -> bool:
    """Whether the model checkpoints these layers itself, as far as the modules show it when the
    context is made: HF's flag (``activation_checkpointing_enable()`` sets
    ``gradient_checkpointing`` on each decoder layer) or torch's ``checkpoint_wrapper``."""
    return any(getattr(m, "gradient_checkpointing", False) is True or hasattr(m, "_checkpoint_wrapped_module")
               for m in layers)


def default_inputs(layers: Sequence[torch.nn.Module], options: dict[str, Any]) -> dict[str, Any]:
    """:func:`default_budget`'s keyword arguments besides the counts and the budget, read from
    ``OffloadActivations``' engine ``options`` (a mode it would refuse reads as v2: the engine
    raises for it, in its words)."""
    try:
        mode = resolve_mode(options.get("mode"))
    except (TypeError, ValueError):
        mode = "v2"
    return {"device_type": device_type(options.get("device")), "mode": mode,
            "manual": options.get("manual_synchronization") is True, "checkpointed": checkpointed(layers)}
