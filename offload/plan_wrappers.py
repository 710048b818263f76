"""The ``forward`` stand-ins through which ``OffloadActivations`` carries out a plan's per-layer
choices that hooks cannot: running a layer under checkpointing (RECOMPUTE), and running a
layer's selective candidates (its MLP) under selective recompute (a ``selective`` KEEP or
OFFLOAD).

Each decides per call (a weight-shared module is one layer per call) by asking its context,
which it holds weakly, like the module hooks: a copy of the model (``copy.deepcopy``, pickling)
carries inert wrappers that simply call the copied forward.
"""

from __future__ import annotations

import copy
import threading
import weakref
from typing import TYPE_CHECKING, Any, Iterable, Optional

import torch
from torch.utils.checkpoint import checkpoint

from .selective import SelectiveForward

if TYPE_CHECKING:
    from .activations import OffloadActivations


class RecomputeForward:
    """Stands in for a layer's ``forward`` and runs it under non-reentrant checkpointing when
    the plan recomputes the layer being run."""

    __slots__ = ("_owner", "fn")

    def __init__(self, owner: Optional["OffloadActivations"], fn: Any) -> None:
        self._owner = weakref.ref(owner) if owner is not None else None
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self._owner() if self._owner is not None else None
        if owner is not None and owner.active and owner._thread == threading.get_ident() \
                and owner._recompute_current():
            # The pre-hook has opened the layer's group: checkpoint's inputs are saved into it
            # (and offloaded), everything inside goes to checkpoint's own hooks.
            return checkpoint(self.fn, *args, use_reentrant=False, **kwargs)
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> "RecomputeForward":
        return RecomputeForward(None, copy.deepcopy(self.fn, memo))

    def __reduce__(self) -> tuple[Any, ...]:
        return (RecomputeForward, (None, self.fn))


class SelectiveWhen:
    """The ``when`` of a planned :class:`~offload.selective.SelectiveForward`: true while its
    context runs a layer the plan makes selective."""

    __slots__ = ("_owner",)

    def __init__(self, owner: Optional["OffloadActivations"]) -> None:
        self._owner = weakref.ref(owner) if owner is not None else None

    def __call__(self) -> bool:
        owner = self._owner() if self._owner is not None else None
        return owner is not None and owner._selective_current()

    def __deepcopy__(self, memo: dict[int, Any]) -> "SelectiveWhen":
        return SelectiveWhen(None)

    def __reduce__(self) -> tuple[Any, ...]:
        return (SelectiveWhen, (None,))


def install_recompute(owner: "OffloadActivations", layers: Iterable[torch.nn.Module]) -> None:
    """Wrap each layer's ``forward`` once for the plan's RECOMPUTE layers."""
    for module in dict.fromkeys(layers):
        if not isinstance(module.__dict__.get("forward"), RecomputeForward):
            module.forward = RecomputeForward(owner, module.forward)


def install_selective(owner: "OffloadActivations", candidates: Iterable[torch.nn.Module]) -> None:
    """Wrap each candidate's ``forward`` once for the plan's selective layers."""
    for module in dict.fromkeys(candidates):
        if not isinstance(module.__dict__.get("forward"), SelectiveForward):
            module.forward = SelectiveForward(module.forward, when=SelectiveWhen(owner))


def _unwrap(module: torch.nn.Module, wrapper: Any) -> None:
    if getattr(wrapper.fn, "__self__", None) is module:
        del module.forward  # it wrapped the class's forward (a bound method)
    else:
        module.forward = wrapper.fn  # an instance attribute set before (a user's selective wrapper)


def remove_plan_wrappers(layers: Iterable[torch.nn.Module], candidates: Iterable[torch.nn.Module]) -> None:
    """Take off what :func:`install_recompute` and :func:`install_selective` put on (the user's
    own selective wrappers stay)."""
    for module in dict.fromkeys(layers):
        wrapper = module.__dict__.get("forward")
        if isinstance(wrapper, RecomputeForward):
            _unwrap(module, wrapper)
    for module in dict.fromkeys(candidates):
        wrapper = module.__dict__.get("forward")
        if isinstance(wrapper, SelectiveForward) and isinstance(wrapper.when, SelectiveWhen):
            _unwrap(module, wrapper)
