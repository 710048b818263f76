"""The v2 schedule, the default (the manual schedule is ``ManualSchedule`` in ``base.py``).

A schedule decides *when* each layer's group is offloaded, released and reloaded; the engine does
the work (``start_offload``, ``release``, ``start_reload``); see ``base.py`` for what a schedule
sees.

v2: layers ``0..k-1`` of ``N = model_layers`` are offloaded (``k = num_layers``).
- The budget: at most ``B = max(N - k, 2)`` layers hold activations on the GPU at once. ``N - k``
  is what the caller asked for; the floor of 2 is one layer computing while the previous one's
  copy finishes. A budget of 1 (``k = N - 1``) would serialise every layer's compute with its
  copy, and backward's prefetch holds two layers anyway.
- D2H of a layer starts as soon as the layer ends (its tensors are ready).
- Release is as late as the budget allows, oldest first: a release makes the compute stream wait
  for that D2H, so the later it comes the less it stalls. At the end of forward every offloaded
  group is released, so all ``k`` layers really leave the GPU.
- Reload: when backward reaches layer ``L`` (the gradient of its output is computed: the marker
  that ``sync_function`` or ``OffloadActivations`` attaches) the group of ``L`` must be there, and
  the groups of ``L - 1`` and ``L - 2`` are prefetched while the budget allows (counting the
  non-offloaded layers still to run and the groups already back). Two layers of backward cover
  one group's H2D on our H100 (a layer's copy takes ~1.6x its backward); prefetching further
  would only raise the backward peak, where parameter gradients are accumulating too.

Small layers (``group_bytes``, default ``DEFAULT_GROUP_BYTES``, 32 MiB; 0 turns it off). Each
group costs the host the same fixed work whatever its size (closing it, a D2H and an H2D
submission, their events, the release's and the unpack's waits: about 140 us a group inside
SMALL's steps on our H100's host), while a layer of a few MiB moves over PCIe in tens of
microseconds. So a layer whose group holds fewer than ``group_bytes`` when it ends is not closed:
the next offloaded layer's tensors join it, until it holds ``group_bytes`` or the last offloaded
layer ends, and the whole group is copied once each way. Layers that save more than that (those
of any large model) are groups of their own, as before. Between the layers of a shared group
nothing reaches the schedule (``Schedule.joins_next``), and only its top layer carries a backward
marker: reaching it reloads the group, and the prefetch looks below the group's first layer. The
budget counts such a group as one layer: its layers together hold less than ``group_bytes`` plus
one layer, which bounds what the forward keeps on the GPU beyond the budget.

Several micro-batches in flight (a pipeline stage's 1F1B order, see ``lifecycle.py``): each
micro-batch is a step with its own groups, keyed by (micro-batch, layer).
- Backward reaching a layer of an earlier micro-batch reloads and prefetches *that*
  micro-batch's groups, as for the current one.
- The budget counts every micro-batch in flight: the others' layers that hold GPU memory (the
  layers they keep, until their backward passes them, and their groups not released or
  reloaded) count against it, and it grows by what each other micro-batch keeps anyway (its
  ``N - k`` layers). A micro-batch waiting for its backward with its groups on the host leaves
  the budget as it was alone; one holding prefetched or unreleased groups takes them from it.
  With one micro-batch at a time none of this is looked at.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Optional

from ..group import Group, GroupState
from .base import Schedule

from .engine_view import EngineView

if TYPE_CHECKING:
    from ..step import StepState


_OFFLOADING = GroupState.OFFLOADING


class ScheduleV2(Schedule):
    """Offload layers ``0..k-1``; release late and prefetch early within a layer budget."""

    name = "v2"

    def __init__(self, num_layers: int, model_layers: int, prefetch_depth: int = 2, group_bytes: int = 0) -> None:
        super().__init__(num_layers, model_layers)
        self.budget = max(model_layers - num_layers, 2)
        self.prefetch_depth = prefetch_depth
        self.group_bytes = group_bytes
        # The current step's groups whose D2H is in flight and whose originals are still held,
        # oldest first: what a layer start may release. Kept as the groups go (rather than found
        # by scanning the step's groups at every layer, which grew with the model's depth), and
        # held weakly, like the step's groups, so that a forward whose graph is dropped still
        # frees them.
        self._offloading: list[weakref.ref] = []

    def _non_offloaded_through(self, layer: int) -> int:
        # Layers k..layer are not offloaded; their activations are on the GPU until backward.
        return max(0, layer - self.num_layers + 1)

    def _kept_layers(self, step: "StepState") -> int:
        # The non-offloaded layers of ``step`` whose activations are still on the GPU: those
        # its forward ran, less those its backward is done with.
        if step.reached is None:
            return max(0, min(step.layers_started, self.model_layers) - self.num_layers)
        return self._non_offloaded_through(step.reached)

    def _others(self, engine: EngineView, this: "StepState") -> tuple[int, int]:
        """(layers the other micro-batches in flight hold on the GPU, what they keep anyway)."""
        held = share = 0
        for step in engine.micro_batches():
            if step is this:
                continue
            held += self._kept_layers(step) + step.groups.holding_gpu_memory()
            share += self.model_layers - self.num_layers
        return held, share

    def _still_offloading(self) -> list[Group]:
        # The queue's groups that are still OFFLOADING (a group leaves by release, or by dying
        # with its graph), oldest first; the queue keeps only those.
        live = [g for r in self._offloading if (g := r()) is not None and g.state is _OFFLOADING]
        if len(live) != len(self._offloading):
            self._offloading = [weakref.ref(g) for g in live]
        return live

    def joins_next(self, group: Group, layer: int) -> bool:
        # Below group_bytes, the next offloaded layer's tensors join this group (see the module
        # notes). Never past the last offloaded layer, whose group must be copied at its end.
        # The same under capture as eagerly: a captured step finds the host blocks that its
        # eager warm-up step's groups left, so both must make the same groups.
        return group.saved_bytes < self.group_bytes and layer + 1 < self.num_layers

    def groups_after(self, group: Group) -> int:
        # Later layers of about this group's bytes a layer share groups of group_bytes, so the
        # forecast counts those groups, not the layers (a block a layer would be pinned in vain).
        # Only the full ones: the last offloaded layer closes a group of whatever is left, too
        # small for a block guessed at this group's size (the arena's reuse slack), so it gets
        # its own block when it comes.
        later = self.offloaded_after(group.top)
        per_layer = group.nbytes // (group.top - group.layer + 1)
        if later == 0 or per_layer >= self.group_bytes:
            return later
        return later // -(-self.group_bytes // max(per_layer, 1))

    def on_step_start(self, engine: EngineView) -> None:
        self._offloading = []

    def on_abort(self, engine: EngineView, step: "StepState") -> None:
        self._offloading = []

    def on_layer_start(self, engine: EngineView, layer: int) -> None:
        step = engine.step
        pending = self._still_offloading() if self._offloading else []
        resident = len(pending) + self._non_offloaded_through(layer) + (1 if self.offloads(layer) else 0)
        limit = self.budget
        if engine.in_flight:
            held, share = self._others(engine, step)
            resident += held
            limit += share
        for group in pending[: max(0, resident - limit)]:
            engine.release(group)

    def on_layer_end(self, engine: EngineView, layer: int, group: Optional[Group]) -> None:
        if group is not None:
            engine.start_offload(group)
            if group.state is _OFFLOADING:
                self._offloading.append(weakref.ref(group))

    def on_forward_end(self, engine: EngineView) -> None:
        for group in self._still_offloading():
            engine.release(group)
        self._offloading = []

    def on_backward_reach(self, engine: EngineView, step: "StepState", layer: int) -> None:
        """Backward is about to run ``layer`` of ``step``: its group must come back now, and the
        ones below it are prefetched while the budget (of every micro-batch in flight) allows."""
        groups = step.groups
        needed = groups.get(layer)
        below = layer
        if needed is not None:
            if needed.state is GroupState.OFFLOADED:
                engine.start_reload(needed)
            # A group that small layers share is reached at its top layer only (the inner ones
            # carry no marker): what backward needs next lies below its first layer.
            below = needed.layer
        # Groups of layers above ``layer`` are done; count what still holds GPU memory.
        resident = self._non_offloaded_through(layer) + groups.holding_gpu_memory(min(layer, self.num_layers - 1))
        limit = self.budget
        if engine.in_flight:
            held, share = self._others(engine, step)
            resident += held
            limit += share
        for target in range(min(below, self.num_layers) - 1, max(-1, below - 1 - self.prefetch_depth), -1):
            group = groups.get(target)
            if group is None or group.state is not GroupState.OFFLOADED:
                continue
            if resident >= limit:
                break
            engine.start_reload(group)
            resident += 1
