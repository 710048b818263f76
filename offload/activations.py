"""``OffloadActivations``: one ``with`` around the whole forward; layers found by module hooks.

The saved-tensor hooks are pushed once for the whole forward (see ``engine.py``), and forward
pre-hooks / hooks on the given layer modules move the engine from one layer's group to the next.
Because the hooks stay *outside* the layers, a ``torch.utils.checkpoint`` inside or around a layer
keeps its own hooks innermost, and only the checkpoint's inputs reach the engine.

The module hooks are registered on first entry and removed by :meth:`OffloadActivations.close`.
Outside the ``with`` they return at once. They hold the context only through a weak reference, and
a copy of them (``copy.deepcopy(model)``, pickling) is an inert hook, so a model that carries them
can still be copied or saved.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Optional

import torch

from .api import build_engine


def _first_grad_tensor(value: Any) -> Optional[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value if value.requires_grad else None
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_grad_tensor(item)
            if found is not None:
                return found
    if isinstance(value, dict):
        return _first_grad_tensor(list(value.values()))
    return None


class _LayerHook:
    """A forward pre-hook (``after=False``) or forward hook on a layer module.

    Holds a weak reference to its ``OffloadActivations`` and nothing else, so the module stays
    copyable; its copies are inert (``owner`` None).
    """

    __slots__ = ("_owner", "_after")

    def __init__(self, owner: Optional["OffloadActivations"], after: bool) -> None:
        self._owner = weakref.ref(owner) if owner is not None else None
        self._after = after

    def __call__(self, module: torch.nn.Module, args: Any, output: Any = None) -> None:
        owner = self._owner() if self._owner is not None else None
        if owner is None or not owner.active:
            return
        if self._after:
            owner._after_layer(output)
        else:
            owner._before_layer()

    def __deepcopy__(self, memo: dict[int, Any]) -> "_LayerHook":
        return _LayerHook(None, self._after)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_LayerHook, (None, self._after))


class OffloadActivations:
    """One ``with`` around the whole forward; layer boundaries come from module hooks.

    ``layers`` are the modules that form the repeated layers (e.g. ``model.layers``), in call
    order; a module listed several times (weight-shared layers, ALBERT-style) is one layer per
    call. By default all but the last are offloaded (``num_offload_layers=len(layers) - 1``).
    ``enabled=False`` turns offloading off (the ``with`` does nothing). The other options are
    those of :func:`offload.get_cpu_offload_context`.

    Checkpointing composes: layers run under ``torch.utils.checkpoint`` (reentrant or not,
    around ``forward`` or ``__call__``, e.g. HF ``gradient_checkpointing_enable``) offload only
    their checkpoint inputs, which come back before the layer's recompute.
    """

    def __init__(
        self,
        layers: Iterable[torch.nn.Module],
        num_offload_layers: Optional[int] = None,
        *,
        enabled: bool = True,
        **options: Any,
    ) -> None:
        self.layers = list(layers)
        if not self.layers or not all(isinstance(m, torch.nn.Module) for m in self.layers):
            raise ValueError(
                "offload: OffloadActivations needs a non-empty list of nn.Module layers (e.g. model.layers)"
            )
        count = len(self.layers)
        if num_offload_layers is None:
            num_offload_layers = count - 1
        options.setdefault("num_layers", num_offload_layers)
        if options["num_layers"] != num_offload_layers:
            raise ValueError("offload: OffloadActivations takes num_offload_layers or num_layers, not both")
        options.setdefault("model_layers", count)
        self.enabled = bool(enabled)
        self.engine = build_engine(layer_contexts=False, **options) if self.enabled else None
        self.active = False
        self._tracking = False  # this forward is tracked (grad enabled at entry)
        self._handles: list[Any] = []

    # -- the with ----------------------------------------------------------------------------------
    def __enter__(self) -> "OffloadActivations":
        if self.active:
            raise RuntimeError("offload: this OffloadActivations is already active; it does not nest")
        if self.engine is None:
            return self
        if not self._handles:
            self._register_hooks()
        self._tracking = self.engine.begin_forward()
        self.active = self._tracking
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.engine is None or not self._tracking:
            return
        self.active = False
        self._tracking = False
        if exc_type is not None:
            self.engine.abort_step()
            return
        counted = self.engine.step.layers_started if self.engine.step is not None else 0
        self.engine.end_forward()
        if counted != len(self.layers):
            self.engine._warn_once(
                "count",
                f"offload: the forward ran {counted} of the {len(self.layers)} layers given to "
                "OffloadActivations; pass the modules one forward really calls, in call order",
            )

    def _register_hooks(self) -> None:
        # One pair of hooks per distinct module: a module listed twice is called twice.
        for module in dict.fromkeys(self.layers):
            self._handles.append(module.register_forward_pre_hook(_LayerHook(self, after=False)))
            self._handles.append(module.register_forward_hook(_LayerHook(self, after=True)))

    def close(self) -> None:
        """Remove the module hooks (registered on first entry; inert outside the ``with``)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- layer boundaries --------------------------------------------------------------------------
    def _before_layer(self) -> None:
        self.engine.begin_layer()  # type: ignore[union-attr]

    def _after_layer(self, output: Any) -> None:
        layer = self.engine.end_layer()  # type: ignore[union-attr]
        if layer is None:
            return
        marked = _first_grad_tensor(output)
        if marked is not None:
            self.engine.attach_backward_marker(marked, layer)  # type: ignore[union-attr]

    # -- figures -----------------------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, Any]:
        """Figures of the last finished step (see ``offload.stats.snapshot``); ``{}`` when disabled."""
        return self.engine.stats() if self.engine is not None else {}

    def report(self) -> str:
        """A readable table of :attr:`stats`."""
        if self.engine is None:
            return "offload report: disabled (enabled=False)"
        return self.engine.report()
