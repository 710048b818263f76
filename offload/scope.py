"""Where the saved tensors of the code running now go: the offload engine, or a keep region.

PyTorch keeps a per-thread stack of saved-tensor hooks and runs only the innermost pair. Every
offload context pushes its engine's bound ``pack`` method there while tensors saved at that point
are the engine's (a TransformerEngine-shape layer context of an offloaded layer, the whole forward
of ``OffloadActivations``, a graphed layer's forward). So "is offloading on here, and by which
engine" is read from that stack instead of from a module-level registry: there is one source of
truth, and it is right per thread and under nesting (a checkpoint's hooks inside ours win, and
then nothing saved there reaches the engine, which these functions report faithfully).

- :func:`is_cpu_offload_enabled`, :func:`is_cpu_offload_layer`: TransformerEngine's queries.
- :class:`keep_on_gpu`: torchtune's ``NoOpManager``: tensors saved inside it stay on the GPU and
  are counted in the stats as ``kept["keep_on_gpu"]``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .engine.core import OffloadEngine
from .engine.packing import keep_handle
from .engine.policy import KEEP_REGION
from .engine.saved_hooks import python_hook
from .engine.stats import StepCounters

_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks


def current_engine() -> tuple[Optional[OffloadEngine], bool]:
    """The engine whose hooks receive tensors saved now (or None), and whether they are a
    graphed layer's (``offload.graphs``) rather than a step's."""
    top = _top_hooks(False)
    if top is None:
        return None, False
    # The engine's hooks are wrapped to run eagerly under torch.compile (offload.engine.eager): the
    # bound method is the wrapper's __wrapped__; a native hook hands over to the bound method.
    pack = python_hook(getattr(top[0], "__wrapped__", top[0]))
    owner = getattr(pack, "__self__", None)
    if not isinstance(owner, OffloadEngine):
        return None, False
    return owner, getattr(pack, "__func__", None) is OffloadEngine._pack_local


def is_cpu_offload_enabled() -> bool:
    """True where a tensor saved for backward now goes to an offload context.

    TransformerEngine's ``is_cpu_offload_enabled()``. It is True inside the ``with`` of an
    offloaded layer (``get_cpu_offload_context``), inside ``OffloadActivations``'s forward and
    in a graphed layer's forward; False outside them, inside :class:`keep_on_gpu`, and where
    other saved-tensor hooks are innermost (a checkpointed region, whose tensors are recomputed
    rather than saved). Unlike TransformerEngine, the ``with`` of a layer that the schedule does
    not offload reports False: nothing saved there is offloaded.
    """
    return current_engine()[0] is not None


def is_cpu_offload_layer() -> bool:
    """True where a tensor saved now joins a group that the schedule may offload.

    TransformerEngine v1's ``is_cpu_offload_layer()``. Narrower than
    :func:`is_cpu_offload_enabled` with ``OffloadActivations(layers)``, whose hooks cover the
    whole forward: the layers it keeps on the GPU (the last one by default) report False.
    """
    engine, local = current_engine()
    if engine is None:
        return False
    return local or engine.forward.open_group is not None


class _KeepPack:
    """The pack hook of a keep region: hands the tensor to the engine's kept path."""

    __slots__ = ("engine", "local")

    def __init__(self, engine: OffloadEngine, local: bool) -> None:
        self.engine = engine
        self.local = local

    def __call__(self, t: torch.Tensor) -> Any:
        engine = self.engine
        counters: Optional[StepCounters]
        if self.local:
            group = engine.forward.local_group
            counters = group.counters if group is not None else None
        else:
            counters = engine.step.counters if engine.step is not None else None
        if counters is None:
            # The engine's step is gone (aborted): kept uncounted, through the same handle as
            # every kept tensor (never the bare tensor: the cycle reason in offload.engine.packing).
            return keep_handle(t, engine.forward.layer)
        return engine.pack_kept(t, KEEP_REGION, counters)


class keep_on_gpu:
    """Keep the tensors saved inside this ``with`` on the GPU (torchtune's ``NoOpManager``).

    Use it for a region whose activations backward needs at once, such as a language model's
    output head and loss::

        with offload.OffloadActivations():
            hidden = model.body(x)
            with offload.keep_on_gpu():
                logits = model.head(hidden)

    It works in every form: ``OffloadActivations()`` with or without layers, and inside a layer
    context of ``get_cpu_offload_context``. The tensors are counted in the stats as
    ``kept["keep_on_gpu"]``. Where nothing is being offloaded (outside an offload context, or in
    a layer that is not offloaded) it does nothing. An offload context entered *inside* it takes
    over for its own tensors; regions nest.
    """

    def __init__(self) -> None:
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None

    def __enter__(self) -> "keep_on_gpu":
        if self._hooks is not None:
            raise RuntimeError("offload: this keep_on_gpu() is already entered; use a new keep_on_gpu() to nest")
        engine, local = current_engine()
        if engine is not None:
            hooks = torch.autograd.graph.saved_tensors_hooks(_KeepPack(engine, local), engine.unpack)
            hooks.__enter__()
            self._hooks = hooks
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(exc_type, exc, tb)
