"""The module hooks of ``OffloadActivations``: a forward pre-hook and hook on each layer module
(the layers form), and a global module hook while the ``with`` is open (the form without layers).

Each holds its context through a weak reference and nothing else, so a module that carries one
stays copyable, and its copies (``copy.deepcopy(model)``, pickling) are inert.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Optional, Protocol

import torch

from ..engine.eager import run_eagerly


class HookedContext(Protocol):
    """What the hooks read and call on their context (``OffloadActivations``)."""

    active: bool
    _thread: int

    def _before_layer(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None: ...

    def _after_layer(self, output: Any) -> None: ...

    def _module_done(self, output: Any) -> None: ...


class LayerHook:
    """A forward pre-hook (``after=False``) or forward hook on a layer module.

    Holds a weak reference to its ``OffloadActivations`` and nothing else, so the module stays
    copyable; its copies are inert (``owner`` None).
    """

    __slots__ = ("_owner", "_after")

    def __init__(self, owner: Optional[HookedContext], after: bool) -> None:
        self._owner = weakref.ref(owner) if owner is not None else None
        self._after = after

    @property
    def dead(self) -> bool:
        """Its context is gone (garbage collected), or it is an inert copy: it can never act."""
        return self._owner is None or self._owner() is None

    @run_eagerly
    def __call__(self, module: torch.nn.Module, args: Any, third: Any = None) -> None:
        # third: the output (after=True), or the keyword arguments (the pre-hook, registered
        # with_kwargs: a layer called as layer(hidden_states=h) has its input there).
        owner = self._owner() if self._owner is not None else None
        # Several contexts may hook the same modules (one per thread on one model): each acts
        # only for forwards run in the thread whose `with` it is in; the saved-tensor hooks are
        # per thread too, so each thread's tensors reach its own engine.
        if owner is None or not owner.active or owner._thread != threading.get_ident():
            return
        if self._after:
            owner._after_layer(third)
        else:
            owner._before_layer(module, args, third)

    def __deepcopy__(self, memo: dict[int, Any]) -> "LayerHook":
        return LayerHook(None, self._after)

    def __reduce__(self) -> tuple[Any, ...]:
        return (LayerHook, (None, self._after))


class GroupBoundary:
    """A global module forward hook (the no-layers form): after each module call, closes the
    open group if it holds ``group_bytes``. Weak like :class:`LayerHook`; registered only while
    the ``with`` is open."""

    __slots__ = ("_owner",)

    def __init__(self, owner: HookedContext) -> None:
        self._owner = weakref.ref(owner)

    @run_eagerly
    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        owner = self._owner()
        if owner is not None and owner.active:
            owner._module_done(output)
