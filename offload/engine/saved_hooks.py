"""The saved-tensor hooks the engine pushes: native where the extension is built, else Python.

``pack`` and ``unpack`` (``offload.engine.packing``) are the definition of what the hooks do.
Autograd calls them once per saved tensor, and on a model that saves thousands of small tensors
a step (MOE: 64 experts a layer, 2695 packs a step) they are most of what offloading adds to
the host's time: inside real MOE steps on our H100 host, pack and unpack took 23 of the
engine's 33 ms a step (docs/benchmarks.md). The native pair (``csrc/torch/saved_hooks.cpp``,
built into ``offload._entries``) is two C functions that take the common cases without a Python
frame:

- pack: a parameter (or a leaf that requires grad, or a view of one) is kept; an unmarked plain
  tensor of the engine's device, large enough, goes into the open group after the arena's claim
  (asked through Python, so the budget keeps one definition; ``HostArena.claim_ahead`` lets one
  call cover the group's next small tensors as a credit), and one under the size floor is
  kept as "small";
- unpack: a kept tensor whose version did not move; an entry of a reloaded group whose H2D was
  already waited for, other than the reload's last entry.

Anything else (no open group, a mark, a subclass, a tensor of another device, a storage, the first
unpack of a reload, the last one, an in-place change to report) is handed, unchanged, to the
Python hook before the native one has changed anything, so the one selection policy and the one
unpack decide it. ``tests/test_saved_hooks_cpu.py`` holds the two paths to the same gradients
and stats.

On by default where ``offload._entries`` is live; ``OFFLOAD_NATIVE_HOOKS=0`` (read when an
engine is made) keeps the Python pair. They became the default in issue 35's sixth round, after
the whole GPU suite passed with them (553 tests) and they gained in every step-interleaved run
on the H100 host (SMALL 1.42 and 1.43x plain against the Python hooks' 1.51 and 1.46x; MOE 1.15
and 1.20x against 1.20 and 1.23x; docs/benchmarks.md). Code that watches the engine by wrapping ``policy.decide`` or
``engine.pack`` does not see what the native pair decides on its own: wrap the pushed hooks
(``engine._hooks``), or set ``OFFLOAD_NATIVE_HOOKS=0``.

The state the C functions read is a tuple (the order is :func:`_state`'s): a GC-tracked object,
so that the cycle engine -> hooks -> state -> Python hooks -> engine is one the collector breaks.
"""

from __future__ import annotations

import os
import types
from typing import Any, Callable, Protocol

import torch

from ..host import native
from .eager import run_eagerly
from .group import GroupState
from .marks import KEEP_ATTR, OFFLOAD_ATTR, TE_KEEP_ATTR
from .policy import KEEP_BUDGET, KEEP_PARAMETER, KEEP_SMALL

Hook = Callable[[Any], Any]


class HookedEngine(Protocol):
    """What the hooks read of the engine (a protocol: the engine imports this module)."""

    forward: Any
    policy: Any

    def pack(self, t: torch.Tensor) -> Any: ...

    def unpack(self, packed: Any) -> Any: ...


# Where the state tuple holds the Python hooks (``Slot`` in csrc/torch/saved_hooks.cpp).
_PYTHON_PACK, _PYTHON_UNPACK = 2, 3


def _state(engine: HookedEngine, pack: Hook, unpack: Hook) -> tuple[Any, ...]:
    # The order of ``Slot`` in csrc/torch/saved_hooks.cpp.
    return (
        engine.forward,
        engine.policy,
        pack,
        unpack,
        torch.nn.Parameter,
        GroupState.RELOADED,
        KEEP_PARAMETER,
        KEEP_BUDGET,
        KEEP_SMALL,
        (KEEP_ATTR, TE_KEEP_ATTR, OFFLOAD_ATTR),
        engine.policy.device_index,
    )


_STATE_SIZE = 11  # len(_state(...)); the extension checks the same count (SAVED_HOOKS_STATE_SIZE)


def native_hooks_requested() -> bool:
    """Whether the native hooks are wanted: yes unless ``OFFLOAD_NATIVE_HOOKS`` turns them off
    (``0``, ``false``, ``no``, ``off``)."""
    return os.environ.get("OFFLOAD_NATIVE_HOOKS", "1").strip().lower() not in native.OFF_VALUES


def engine_hooks(engine: HookedEngine) -> tuple[Hook, Hook]:
    """``(pack, unpack)`` for ``engine``'s saved-tensor hooks: the native pair over the engine's
    Python hooks when wanted (:func:`native_hooks_requested`, the default) and ``offload._entries``
    is live, else the Python hooks themselves. Never the native pair for an opt-in policy
    (``selection="marked"``, v1's default): there every unmarked activation would be checked
    natively, then decided again in Python.

    Both Python hooks are marked to run eagerly (``offload.engine.eager``): the native ones call
    them, and a C function has no frame for Dynamo to see.
    """
    pack, unpack = run_eagerly(engine.pack), run_eagerly(engine.unpack)
    ext = native.entries_extension()
    wanted = native_hooks_requested() and not engine.policy.opt_in_only
    if ext is None or not wanted or not hasattr(ext, "make_saved_hooks"):
        return pack, unpack
    return tuple(ext.make_saved_hooks(_state(engine, pack, unpack)))  # type: ignore[return-value]


def python_hook(hook: Hook) -> Hook:
    """The Python hook behind ``hook``: a native hook's Python counterpart (the engine's bound
    ``pack`` or ``unpack``, which it hands everything else to), else ``hook`` itself. What tells
    whose hooks are innermost (``offload.scope``) reads the engine from it."""
    state = getattr(hook, "__self__", None)
    if isinstance(hook, types.BuiltinFunctionType) and type(state) is tuple and len(state) == _STATE_SIZE:
        return state[_PYTHON_PACK] if hook.__name__ == "pack" else state[_PYTHON_UNPACK]
    return hook
