"""Running a module under non-reentrant checkpointing so that its tensor arguments, positional or
keyword, are what the checkpoint saves through the saved-tensor hooks.

Why. ``torch.utils.checkpoint(fn, *args, use_reentrant=False, **kwargs)`` saves the positional
tensors with ``save_for_backward`` (so they pass through the saved-tensor hooks: an offload
context copies them out and back), but keeps the keyword arguments as plain Python references
in its closure. A layer called ``layer(hidden_states=h)`` would then keep ``h`` on the device
until its backward, out of the hooks' sight: never offloaded, and never counted by the planner's
probe, so a plan's predicted peak would miss it. Here the top-level tensor keyword arguments are
passed to the checkpoint positionally and given back to the module by name, so a layer saves the
same through the hooks whichever way it is called. Tensors nested in other arguments (a tuple of
rotary embeddings) stay in the closure, as they do for positional arguments.

Every place that checkpoints a layer or a selective module (a plan's RECOMPUTE layers, selective
recompute, the low-memory probe) goes through :func:`checkpoint_call`, and the probe counts what
it saves with :func:`checkpoint_input_bytes`: one definition of "a checkpoint's inputs".

A checkpointed call runs twice, so arguments that carry state (a KV cache) would be changed twice:
:func:`checkpoint_call` runs such a call through :class:`~offload.forwards.stateful.StatefulCall`,
whose recompute runs against the state the forward saw and leaves the state the forward left.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from .stateful import StatefulCall, stateful_arguments

__all__ = ["checkpoint_call", "checkpoint_inputs", "checkpoint_input_bytes", "checkpoint_input_sizes", "saved_size"]

# A saved tensor's storage address, bytes and shape (:func:`saved_size`).
SavedSize = tuple[int, int, tuple[int, ...]]


def checkpoint_inputs(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    """The tensors a :func:`checkpoint_call` with these arguments saves for backward: the
    positional tensors, then the top-level tensor keyword arguments."""
    return [a for a in args if isinstance(a, torch.Tensor)] + \
        [v for v in kwargs.values() if isinstance(v, torch.Tensor)]


def checkpoint_input_sizes(args: Sequence[Any], kwargs: Mapping[str, Any],
                           before: Sequence[SavedSize] = ()) -> list[tuple[int, tuple[int, ...]]]:
    """``(bytes, shape)`` of each of :func:`checkpoint_inputs`, each storage once (a tensor passed
    twice, or two views of one storage, is saved once by the engine's group). ``before``: the
    tensors saved since the layer before (an embedding's indices; :func:`saved_size` each), which
    join this layer's group in the engine, counted too: at 4 x 8192 tokens LLAMA's 256 KiB of
    indices left the first layer's inputs over the block its plan pinned for them, and a
    repeated step pinned another on its thread."""
    seen: set[int] = set()
    out = []
    for ptr, nbytes, shape in [*map(saved_size, checkpoint_inputs(args, kwargs)), *before]:
        if ptr not in seen:
            seen.add(ptr)
            out.append((nbytes, shape))
    return out


def saved_size(t: torch.Tensor) -> SavedSize:
    """``(storage address, bytes, shape)`` of ``t``: what :func:`checkpoint_input_sizes` counts,
    without a reference that would keep the tensor alive."""
    return t.untyped_storage().data_ptr(), t.nbytes, tuple(t.shape)


def checkpoint_input_bytes(args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
    """Bytes of :func:`checkpoint_inputs`, each storage counted once."""
    return sum(nbytes for nbytes, _ in checkpoint_input_sizes(args, kwargs))


def checkpoint_call(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
                    **options: Any) -> Any:
    """``fn(*args, **kwargs)`` under non-reentrant ``torch.utils.checkpoint`` (``options``:
    its own, e.g. ``context_fn``), with the tensor keyword arguments saved like positional ones,
    and a KV cache among the arguments left as one plain run leaves it (see the module notes);
    :class:`~offload.forwards.stateful.StatefulArgumentError` where that cannot be done."""
    states = stateful_arguments(args, kwargs)
    if states:
        fn = StatefulCall(fn, states)
    names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    if not names:
        return checkpoint(fn, *args, use_reentrant=False, **options, **kwargs)
    rest = {k: v for k, v in kwargs.items() if k not in names}
    count = len(args)

    def by_name(*flat: Any) -> Any:
        # The recompute calls this again with the unpacked (possibly reloaded) tensors.
        return fn(*flat[:count], **dict(zip(names, flat[count:])), **rest)

    return checkpoint(by_name, *args, *(kwargs[k] for k in names), use_reentrant=False, **options)
