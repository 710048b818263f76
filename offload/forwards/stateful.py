"""Arguments that carry state from call to call (a KV cache), and how a layer run again (a
recompute) leaves them exactly as its first run did.

Why. A checkpointed layer runs twice: in forward, and again in backward to rebuild what it saved.
A HuggingFace ``Cache`` among its arguments (``cache=``, ``past_key_values=``, ``layer_past``,
or positional, as GPT-2 passes it) is changed by each run: ``cache.update`` appends the layer's
keys and values. Run again against the same cache, the layer sees its keys twice (eager attention
raises against its ``T``-wide mask; SDPA under a purely causal mask survives by luck) and the
cache the user gets back holds them twice. Every place that runs a layer twice (a plan's
RECOMPUTE layers, selective recompute, the probe's checkpointed layers) goes through
:func:`offload.forwards.recompute.checkpoint_call`, which wraps the call in
:class:`StatefulCall` where such an argument is present: one mechanism, in one place.

How. transformers' caches (5.x: ``cache.layers``, one object per layer; 4.x: ``key_cache`` /
``value_cache`` lists) grow by replacing their tensors (``self.keys = torch.cat(...)``), never by
writing into them. So the state a call changes is *shallow*: which objects the cache's attributes,
lists and per-layer objects point at. :class:`StateSnapshot` records that (each reachable list's
and dict's items, each plain object's attributes, each tensor's version counter) before the
first run. A later run (the recompute) swaps the recorded state in, runs, and puts back, in a
``finally`` (torch's early stop ends a recompute by raising), the very objects that were there
before it: the user's cache ends bitwise and identity-equal to the plain run's. Nothing is
copied: the snapshot holds references the cache held anyway, until the layer's graph is freed.

What it refuses. A cache that writes into its tensors in place (``StaticCache``'s
``index_copy_``, its ``cumulative_length``) cannot be put back without copying it whole: the
first run's change of a recorded tensor's version is detected at once, in the forward of the
first step that recomputes, and raises :class:`StatefulArgumentError` naming the layer and the
argument. Outside training's path a KV cache is of no use: ``use_cache=False`` is the fix.

``transformers`` is never imported here: a cache is recognised by ``isinstance`` only where
transformers is already loaded, and otherwise duck-typed (``update`` and ``get_seq_length``).
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable, Mapping, Sequence

import torch

__all__ = ["StatefulArgumentError", "StateSnapshot", "StatefulCall", "is_stateful", "refuse_stateful_compiled",
           "stateful_arguments"]

# How deep the snapshot walks from an argument: cache -> layers list -> layer object -> its
# attributes -> a list of tensors in it (4), with room for an encoder-decoder cache's two caches.
_DEPTH = 6

# Plain values: nothing inside them can change, so they are recorded by identity only.
_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.device, torch.dtype, torch.Size,
          type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType,
          functools.partial)


class StatefulArgumentError(RuntimeError):
    """A layer that must run twice changes one of its arguments in a way that cannot be undone."""


def is_stateful(value: Any) -> bool:
    """Whether ``value`` is a KV cache: a transformers ``Cache`` (checked only if transformers is
    loaded), or anything with its methods ``update`` and ``get_seq_length``."""
    if isinstance(value, (torch.Tensor, *_ATOMS, tuple, list, dict)):
        return False
    cache_utils = sys.modules.get("transformers.cache_utils")
    cache_type = getattr(cache_utils, "Cache", None)
    if isinstance(cache_type, type) and isinstance(value, cache_type):
        return True
    kind = type(value)
    return callable(getattr(kind, "update", None)) and callable(getattr(kind, "get_seq_length", None))


def stateful_arguments(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The top-level arguments that are KV caches, as ``(name, value)``: ``"argument i"`` for a
    positional one, ``"name="`` for a keyword one."""
    found = [(f"argument {i}", a) for i, a in enumerate(args) if is_stateful(a)]
    return found + [(f"{k}=", v) for k, v in kwargs.items() if is_stateful(v)]


class StateSnapshot:
    """The shallow state of objects (see the module notes): for each list, dict or plain object
    reachable from them, its items or attributes as they are now, and each tensor's version."""

    __slots__ = ("_containers", "_tensors")

    def __init__(self, roots: Sequence[tuple[str, Any]]) -> None:
        self._containers: list[tuple[Any, Any]] = []   # (object, its items or attributes)
        self._tensors: list[tuple[str, torch.Tensor, int]] = []  # (path, tensor, version)
        seen: set[int] = set()
        for name, root in roots:
            self._walk(root, name, 0, seen, root=True)

    def _walk(self, value: Any, path: str, depth: int, seen: set[int], root: bool = False) -> None:
        if isinstance(value, torch.Tensor):
            if id(value) not in seen:
                seen.add(id(value))
                self._tensors.append((path, value, value._version))
            return
        if isinstance(value, _ATOMS) or depth > _DEPTH or id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, tuple):
            items: Any = enumerate(value)
        elif isinstance(value, list):
            self._containers.append((value, list(value)))
            items = enumerate(value)
        elif isinstance(value, dict):
            self._containers.append((value, dict(value)))
            items = value.items()
        elif hasattr(value, "__dict__") and (root or not isinstance(value, torch.nn.Module)):
            # (A module reachable from a cache is not its state: its parameters are left alone.)
            attrs = vars(value)
            self._containers.append((value, dict(attrs)))
            items = attrs.items()
        else:
            return  # opaque (a stream, an event): kept by identity
        for key, item in list(items):
            self._walk(item, f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]", depth + 1, seen)

    def restore(self) -> None:
        """Put every recorded list, dict and object back as it was recorded (the same items)."""
        for obj, saved in self._containers:
            if isinstance(obj, list):
                obj[:] = saved
            elif isinstance(obj, dict):
                obj.clear()
                obj.update(saved)
            else:
                attrs = vars(obj)
                attrs.clear()
                attrs.update(saved)

    def written_in_place(self) -> list[str]:
        """The paths of the recorded tensors written in place since they were recorded."""
        return [path for path, t, version in self._tensors if t._version != version]


def _describe(fn: Any) -> str:
    # The module a checkpointed function runs, for the error: through partials, bound methods
    # and our stand-ins (which keep the wrapped forward as ``fn`` or the module as ``module``).
    for _ in range(8):
        if isinstance(fn, torch.nn.Module):
            return type(fn).__name__
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, torch.nn.Module):
            return type(owner).__name__
        module = getattr(fn, "module", None) or getattr(owner, "module", None)
        if isinstance(module, torch.nn.Module):
            return type(module).__name__
        if isinstance(fn, functools.partial):
            fn = fn.args[-1] if fn.args and callable(fn.args[-1]) else fn.func
        else:
            fn = getattr(fn, "fn", None) or getattr(owner, "fn", None)
        if fn is None:
            break
    return "a layer"


class StatefulCall:
    """``fn`` as a checkpoint runs it, given the KV caches among its arguments (``states``, from
    :func:`stateful_arguments`): the first call is the forward, run as it is, whose arguments'
    state before it is recorded; each later call (a recompute) runs against that recorded state
    and then gives the arguments back the state they had before it (see the module notes).

    Raises :class:`StatefulArgumentError` when the forward wrote into a recorded tensor in place.
    """

    __slots__ = ("fn", "states", "before", "ran")

    def __init__(self, fn: Callable[..., Any], states: list[tuple[str, Any]]) -> None:
        self.fn = fn
        self.states = states
        self.before = StateSnapshot(states)
        self.ran = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.ran:
            self.ran = True
            out = self.fn(*args, **kwargs)
            self._check(self.before, "its first run")
            return out
        now = StateSnapshot(self.states)
        self.before.restore()
        try:
            return self.fn(*args, **kwargs)
        finally:
            now.restore()
            # The recompute ran against the state before the forward; a tensor of the state after
            # it written now would leave the user's cache changed.
            self._check(now, "its recompute in backward")

    def _check(self, snapshot: StateSnapshot, when: str) -> None:
        # A tensor recorded in the snapshot written in place since: a second run would change it
        # again, and putting it back would mean copying it.
        written = snapshot.written_in_place()
        if not written:
            return
        kinds = ", ".join(f"{name} (a {type(value).__name__})" for name, value in self.states)
        raise StatefulArgumentError(
            f"offload: {_describe(self.fn)} runs twice here (recomputed in backward: a plan's recomputed "
            f"layer, selective recompute, or the probe steps of memory_budget_bytes), and {when} wrote into "
            f"the argument {kinds} in place ({', '.join(written[:3])}{', ...' if len(written) > 3 else ''}): "
            "a second run would change it again, and it cannot be put back without copying it. Pass "
            "use_cache=False to the model (training needs no KV cache), or a cache that grows by "
            "concatenation (transformers' DynamicCache), or offload a fixed number of layers "
            "(num_offload_layers=N), which recomputes nothing."
        )


def refuse_stateful_compiled(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Raise :class:`StatefulArgumentError` if a call checkpointed inside ``torch.compile`` (whose
    recompute is traced into the graph, out of :class:`StatefulCall`'s reach) has a KV cache
    among its arguments."""
    states = stateful_arguments(args, kwargs)
    if states:
        raise StatefulArgumentError(
            f"offload: {_describe(fn)} runs under selective recompute inside torch.compile with a KV cache "
            f"({', '.join(name for name, _ in states)}): the compiled recompute would update it a second "
            "time. Pass use_cache=False to the model, or leave this module out of selective recompute."
        )
