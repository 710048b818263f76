"""The engine: one model's offloading, put together from three parts that each have one job.

``OffloadEngine`` owns the parts (policy, schedule, transport, arena) and one state object,
``forward`` (``offload.engine.forward.ForwardState``: the running step, the open layer and its
group, changed only by checked transitions), and gets its methods from three mixins, each in its
own module so that it can be read alone:

- ``packing`` (``PackingMixin``): the saved-tensor hooks, the per-tensor hot path. ``pack``
  keeps a tensor or records it in the open group, ``unpack`` hands it back.
- ``lifecycle`` (``StepLifecycleMixin``): the step and layer lifecycle: each event (a step or a
  layer begins or ends, backward reaches a layer, a forward fails) moves ``forward`` by one
  checked transition and tells the schedule; micro-batches in flight, captured steps and
  graphed layers' groups.
- ``copies`` (``CopyMixin``): the primitives schedules call to move a group to the host and back
  (offload, release, reload), and host regions going back to the arena.

Mixins rather than helper objects the engine owns: the hooks run once per saved tensor, where a
helper would add an attribute lookup and a call each time, and a schedule sees one ``engine``.
The mixins import nothing from this module (no import cycle); each declares the parts it uses,
and none keeps step state of its own: that is all in ``forward``. The notes on layer boundaries,
micro-batches in flight, threads and CUDA graphs are at the top of ``lifecycle``; those on
handles, reference cycles and in-place changes at the top of ``packing``.

Lifetime of one saved tensor (the data flow in brief: docs/design.md):
- ``pack`` (forward): the policy keeps it (``(tensor, version, layer)`` is returned, the tensor
  detached unless it is a parameter, see ``offload.engine.packing``) or it joins the open layer's group
  and ``(group, index)`` is returned to autograd.
- the schedule offloads the group (D2H into an arena region), releases the GPU originals, and
  reloads the group (one H2D into one buffer) ahead of its backward.
- ``unpack`` (backward): the original if the group still holds it, else a typed view of the
  reload buffer. Once every entry was handed back, the group drops its buffer reference; the
  views autograd still holds keep the memory alive until it is done with them.
- when autograd frees the saved tensors (and the engine has moved to the next step) the group is
  garbage and its host region goes back to the arena, tagged with the event of its last copy.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..host.arena import HostArena
from ..host.room import host_figures
from .copies import CopyMixin
from .eager import saved_tensors_hooks
from .forward import ForwardState
from .lifecycle import StepLifecycleMixin
from .packing import PackingMixin
from .policy import SelectionPolicy
from .saved_hooks import engine_hooks
from .stats import StepCounters, format_report, snapshot, weight_cache_bytes
from .step import InFlight
from .transport import Transport

if TYPE_CHECKING:
    from .schedules.base import Schedule

__all__ = ["OffloadEngine"]


class OffloadEngine(StepLifecycleMixin, PackingMixin, CopyMixin):
    """Owns one model's offloading: policy, schedule, transport, arena and per-step state."""

    def __init__(
        self,
        *,
        policy: SelectionPolicy,
        schedule: Schedule,
        transport: Transport,
        arena: HostArena,
        mode: str,
        model_layers: int,
        layer_contexts: bool,
    ) -> None:
        self.policy = policy
        self.schedule = schedule
        self.transport = transport
        self.arena = arena
        self.mode = mode
        self.model_layers = model_layers
        # True: TransformerEngine's call shape. It has no "end of forward" call, so a step is
        # model_layers layer contexts, and each offloaded layer's context pushes the hooks.
        # False: OffloadActivations, which pushes the hooks once and ends the forward itself.
        self.layer_contexts = layer_contexts
        # Where the current step's forward stands, and everything that moves with it: one
        # object, changed only by its checked transitions (offload.engine.forward).
        self.forward = ForwardState()
        self.last_finished: Optional[StepCounters] = None
        # The modules registered with register_module_storages: the stats count their weight
        # caches (FP8 copies); empty when the context was given none.
        self.modules: tuple[torch.nn.Module, ...] = ()
        self._warned: set[str] = set()
        # Run eagerly even under a compiled frame (see offload.engine.eager). The profiled pair
        # is pushed instead while a profiler runs (StepLifecycleMixin._push_hooks).
        # Python, or native on request (offload.engine.saved_hooks).
        self._hooks = saved_tensors_hooks(*engine_hooks(self))
        self._profiled_hooks = saved_tensors_hooks(self.pack_profiled, self.unpack_profiled)
        self.in_flight = InFlight()  # earlier micro-batches, backward still to come
        # A graphed layer's hooks while it is warmed up or captured (offload.graphs).
        self._local_hooks = saved_tensors_hooks(self._pack_local, self.unpack)

    def register_module_storages(self, *modules: torch.nn.Module) -> None:
        """Keep on the GPU every saved tensor over the memory of these modules' parameters and
        buffers (views and aliases such as ``.data`` included): offloading it frees nothing.

        Replaces what was registered before; call again after moving the modules' parameters.
        Parameters themselves and views of them are kept without this.
        """
        self.policy.set_module_storages(modules)
        self.modules = modules

    def warn_once(self, key: str, message: str) -> None:
        """Warn with ``message`` the first time ``key`` comes up in this engine's life."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)

    # -- stats -----------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Figures of the last finished step (or of the step in progress if none finished)."""
        counters = self.last_finished
        if counters is None:
            step = self.forward.step
            counters = step.counters if step is not None else StepCounters(step=0, mode=self.mode)
        return snapshot(
            counters,
            pinned_bytes_held=self.arena.counters.bytes_held,
            native=self.transport.use_native,
            transport=self.transport.name,
            host_budget_bytes=self.arena.budget_bytes,
            host_budget_source=self.arena.budget_source,
            **host_figures(self.arena.needs, self.arena.counters.peak_bytes_held, self.arena.ledger),
            host_numa_node=self.arena.numa.node,
            host_numa_source=self.arena.numa.source,
            weight_cache_bytes=weight_cache_bytes(self.modules) if self.modules else None,
        )

    def report(self) -> str:
        """A readable table of :meth:`stats`."""
        return format_report(self.stats())
