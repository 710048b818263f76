"""The ``forward`` stand-ins through which ``OffloadActivations`` carries out a plan's per-layer
choices that hooks cannot: running a layer under checkpointing (RECOMPUTE), and running a
layer's selective candidates (its MLP) under selective recompute (a ``selective`` KEEP or
OFFLOAD).

Each decides per call (a weight-shared module is one layer per call) by asking the context whose
forward runs in this thread. It holds the contexts it serves weakly, like the module hooks: a
copy of the model (``copy.deepcopy``, pickling) carries inert wrappers that simply call the copied
forward. A context attaches itself whenever it follows a plan or enters after ``close()``, and
detaches at ``close()``: a wrapper comes off when no live context uses it, so a closed context,
one that died without closing, or a second context on the same layers never leaves a plan
unfollowed.
"""

from __future__ import annotations

import copy
import functools
import threading
import weakref
from typing import Any, Iterable, Optional, Protocol

import torch

from ..engine.eager import run_eagerly
from .recompute import checkpoint_call
from .selective import SelectiveForward, attention_kept_contexts
from ..tiling.tokenwise import TiledForward


class PlanFollower(Protocol):
    """What a wrapper asks of the context it serves (``OffloadActivations``; a protocol, so that
    this module does not import the one that imports it)."""

    active: bool
    _thread: int

    # (the plan recomputes the layer being run, its recompute keeps attention's outputs)
    def _recompute_current(self) -> tuple[bool, bool]: ...

    def _selective_current(self) -> bool: ...

    def _tile_current(self) -> int: ...


class _Owners:
    """The contexts a wrapper serves, held weakly: several contexts may follow plans on the same
    layers (one per thread), one context may close and enter again, and one may die without
    closing; the wrapper stays while any of them is attached."""

    __slots__ = ("_refs",)

    def __init__(self, owner: Optional[PlanFollower]) -> None:
        self._refs: list[weakref.ref] = [weakref.ref(owner)] if owner is not None else []

    def attach(self, owner: PlanFollower) -> None:
        """Serve ``owner`` too (once), forgetting contexts that were garbage collected."""
        self._refs = [r for r in self._refs if r() is not None and r() is not owner]
        self._refs.append(weakref.ref(owner))

    def detach(self, owner: PlanFollower) -> bool:
        """Stop serving ``owner``; whether any live context is still served."""
        self._refs = [r for r in self._refs if r() is not None and r() is not owner]
        return bool(self._refs)

    @run_eagerly  # reads the thread and the contexts' state: a graph break in a compiled layer
    def running(self) -> Optional[PlanFollower]:
        """The context whose forward runs in this thread now, if any."""
        for ref in self._refs:
            owner = ref()
            if owner is not None and owner.active and owner._thread == threading.get_ident():
                return owner
        return None


class RecomputeForward:
    """Stands in for a layer's ``forward`` and runs it under non-reentrant checkpointing when
    the plan of the context running it recomputes the layer being run."""

    __slots__ = ("owners", "fn")

    def __init__(self, owner: Optional[PlanFollower], fn: Any) -> None:
        self.owners = _Owners(owner)
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self.owners.running()
        recomputed, keep_attention = owner._recompute_current() if owner is not None else (False, False)
        if recomputed:
            # The pre-hook has opened the layer's group: checkpoint's inputs are saved into it
            # (and offloaded), everything inside goes to checkpoint's own hooks, but attention's
            # outputs, which a plan may keep in the policy's cache (on the GPU). Its tiling is
            # fixed now, for the forward and the recompute alike.
            tokens = owner._tile_current()  # type: ignore[union-attr]
            fn = functools.partial(_tiled_as, tokens, self.fn) if tokens else self.fn
            return checkpoint_call(fn, args, kwargs, **({"context_fn": attention_kept_contexts} if keep_attention else {}))
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> "RecomputeForward":
        return RecomputeForward(None, copy.deepcopy(self.fn, memo))

    def __reduce__(self) -> tuple[Any, ...]:
        return (RecomputeForward, (None, self.fn))


class SelectiveWhen:
    """The ``when`` of a planned :class:`~offload.forwards.selective.SelectiveForward`: true while a
    context it serves runs a layer its plan makes selective."""

    __slots__ = ("owners",)

    def __init__(self, owner: Optional[PlanFollower]) -> None:
        self.owners = _Owners(owner)

    def __call__(self) -> bool:
        owner = self.owners.running()
        return owner is not None and owner._selective_current()

    def __deepcopy__(self, memo: dict[int, Any]) -> "SelectiveWhen":
        return SelectiveWhen(None)

    def __reduce__(self) -> tuple[Any, ...]:
        return (SelectiveWhen, (None,))


class TileWhen:
    """The ``chunk`` of a planned :class:`~offload.tiling.tokenwise.TiledForward`: the plan's
    tokens per chunk while a context it serves runs a layer its plan tiles, else 0 (plainly)."""

    __slots__ = ("owners",)

    def __init__(self, owners: _Owners) -> None:
        self.owners = owners  # the SelectiveWhen's beside it: one set of contexts per candidate

    def __call__(self) -> int:
        replayed = getattr(_REPLAY, "tokens", None)
        if replayed is not None:
            return replayed
        owner = self.owners.running()
        return owner._tile_current() if owner is not None else 0


# The tiling of the recomputed layer running in this thread, while it runs. A checkpoint's
# recompute runs in backward, outside any context's forward, and must save exactly what the
# layer's forward saved (or checkpoint refuses it): the forward's choice is replayed from here.
_REPLAY = threading.local()


def _tiled_as(tokens: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
    before = getattr(_REPLAY, "tokens", None)
    _REPLAY.tokens = tokens
    try:
        return fn(*args, **kwargs)
    finally:
        _REPLAY.tokens = before


def _planned_selective(module: torch.nn.Module) -> Optional[SelectiveWhen]:
    wrapper = module.__dict__.get("forward")
    if isinstance(wrapper, SelectiveForward) and isinstance(wrapper.when, SelectiveWhen):
        return wrapper.when
    return None


def install_plan_wrappers(owner: PlanFollower, layers: Iterable[torch.nn.Module],
                          candidates: Iterable[torch.nn.Module]) -> None:
    """Make the ``layers``' and ``candidates``' wrappers serve ``owner``: wrap each module once,
    or attach ``owner`` to the wrapper already there (another context's, live or dead).
    Idempotent; called whenever the owner starts following a plan or enters after ``close``."""
    for module in dict.fromkeys(layers):
        wrapper = module.__dict__.get("forward")
        if isinstance(wrapper, RecomputeForward):
            wrapper.owners.attach(owner)
        else:
            module.forward = RecomputeForward(owner, module.forward)
    for module in dict.fromkeys(candidates):
        when = _planned_selective(module)
        if when is not None:
            when.owners.attach(owner)
        elif not isinstance(module.__dict__.get("forward"), SelectiveForward):
            # (A module the user runs under selective_recompute is always selective already.)
            # Tiled inside selective: a layer's plan runs its candidates one way or the other
            # (never both), and inside a recomputed layer the selective one runs plainly while
            # the tiled one still tiles.
            when = SelectiveWhen(owner)
            tiled = TiledForward(module, module.forward, TileWhen(when.owners))
            module.forward = SelectiveForward(tiled, when=when)


def _unwrap(module: torch.nn.Module, wrapper: Any) -> None:
    fn = wrapper.fn
    if isinstance(fn, TiledForward) and isinstance(fn.chunk, TileWhen):
        fn = fn.fn  # the planned tiling under the planned selective wrapper
    if getattr(fn, "__self__", None) is module:
        del module.forward  # it wrapped the class's forward (a bound method)
    else:
        module.forward = fn  # an instance attribute set before (a user's selective wrapper)


def remove_plan_wrappers(owner: PlanFollower, layers: Iterable[torch.nn.Module],
                         candidates: Iterable[torch.nn.Module]) -> None:
    """Detach ``owner`` from the wrappers :func:`install_plan_wrappers` put on; a wrapper no
    live context uses any more comes off (the user's own selective wrappers stay)."""
    for module in dict.fromkeys(layers):
        wrapper = module.__dict__.get("forward")
        if isinstance(wrapper, RecomputeForward) and not wrapper.owners.detach(owner):
            _unwrap(module, wrapper)
    for module in dict.fromkeys(candidates):
        when = _planned_selective(module)
        if when is not None and not when.owners.detach(owner):
            _unwrap(module, module.__dict__["forward"])
