"""``OffloadActivations``' arguments, checked in its users' terms, and what a forward that ran
none of its layers means.

Separate from ``activations.py`` (the context itself) because these are the messages a user reads
first: the layer list (a whole model passed where its layers were expected gets the attribute
that holds them), the offload count (named as the caller named it, bounded by the layers given
rather than by the engine's ``model_layers``), torchtune's options, and the diagnosis of a
compiled model whose compiled code never calls the layer hooks.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable

import torch

from .api import MODE_ENV_VAR, MODES, _check_bool, _check_choice, _check_int, _got, resolve_mode
from .find_layers import describe_layers


def check_torchtune_options(
    use_pin_memory: Any, use_streams: Any, max_fwd_stash_size: Any, min_offload_size: Any
) -> None:
    """torchtune's ``OffloadActivations`` options: types, ranges, and what has no equivalent."""
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
    if min_offload_size is not None:
        _check_int(api, "min_offload_size", min_offload_size, 0, "an integer number of bytes")


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
