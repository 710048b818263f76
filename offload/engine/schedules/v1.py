"""The v1 schedule (``NVTE_CPU_OFFLOAD_V1=1``): group windows, one group in flight.

Layers ``0..k-1`` are the ``k`` offload groups. Their deadlines ("window layers") are spread
evenly over the ``N = model_layers`` layers: group ``i`` must be offloaded by the end of layer
``window[i] = (i + 1) * N // k - 1``. Only one D2H is in flight at a time: group ``i + 1`` starts
when group ``i`` has been released at its window. In backward, group ``i`` is reloaded when
backward reaches its window layer, which is at or after layer ``i``, so the copy has the layers in
between to hide behind.

With ``double_buffering=True`` reloads go into two persistent GPU buffers used in turn (group
``i`` into buffer ``i % 2``). That needs groups of equal size; a reload whose buffer still serves
another group waits until that group is done with it.

When a buffer is free again. A group is *consumed* when its last saved tensor is handed back
(unpack), but the backward node that asked for it has not run yet: autograd unpacks a node's saved
tensors and only then runs it. So the buffer is only *draining* at that point. It becomes free at
the next point that backward reaches after that node: the next backward marker, or an unpack miss
of another group (each node's saved tensors were packed in one layer, so an unpack for another
group comes from a later node). There the deferred reload is submitted; on CUDA its H2D stream
then waits on the compute stream as it stands (``CudaTransport.reload``), which is after the
consuming node's kernels were queued.

A backward with ``create_graph=True`` may keep the views it read (saved for the double backward),
so a reload under grad mode goes into a fresh buffer instead, which those views keep alive.

Several micro-batches in flight (a pipeline stage's 1F1B order, see ``lifecycle.py``): backward
reaching a window layer of an earlier micro-batch reloads *that* micro-batch's groups. There is
no budget that other micro-batches could count against: each forward releases its copies by its
own end (so "one group in flight" holds across micro-batches), and the two double-buffering
buffers are tied to the group they serve, not to a step, so every micro-batch's groups take them
in turn (one backward runs at a time; a new step's start frees them).

v1 shares the engine, groups, transport, arena and selection policy with v2; only the timing
differs. Its default selection is opt-in (``mark_activation_offload``), set by the API.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import TYPE_CHECKING, Optional

import torch

from ..group import Group, GroupState
from .base import Schedule

from .engine_view import EngineView

if TYPE_CHECKING:
    from ..step import StepState


def _deref(ref: Optional[weakref.ref[Group]]) -> Optional[Group]:
    return None if ref is None else ref()


def window_layers(num_groups: int, model_layers: int) -> list[int]:
    """The layer by whose end each offload group must be offloaded (evenly spread)."""
    return [(i + 1) * model_layers // num_groups - 1 for i in range(num_groups)]


class ScheduleV1(Schedule):
    """Legacy group-window schedule with an optional double-buffered reload."""

    name = "v1"

    def __init__(self, num_layers: int, model_layers: int, double_buffering: bool = False) -> None:
        super().__init__(num_layers, model_layers)
        self.windows = window_layers(num_layers, model_layers) if num_layers > 0 else []
        self.double_buffering = double_buffering
        self._queue: deque[Group] = deque()
        self._in_flight: Optional[Group] = None
        # Double buffering: the two persistent buffers, the group each serves, and a deferred
        # reload per buffer.
        self._buffers: list[Optional[torch.Tensor]] = [None, None]
        # Held weakly: a backward that raises leaves them behind, and the groups must die with
        # autograd's graph, not live on until the next step.
        self._occupant: list[Optional[weakref.ref[Group]]] = [None, None]
        self._deferred: list[Optional[weakref.ref[Group]]] = [None, None]
        # The occupant was consumed, but the node that read its last tensor may not have run yet.
        self._draining = [False, False]

    def on_step_start(self, engine: EngineView) -> None:
        self._forget_groups()

    def on_abort(self, engine: EngineView, step: "StepState") -> None:
        # The only schedule that holds groups strongly (its queue and buffers' occupants); the
        # two reload buffers go too: a step that failed may have failed for want of memory.
        self._forget_groups()
        self._buffers = [None, None]

    def _forget_groups(self) -> None:
        self._queue.clear()
        self._in_flight = None
        self._occupant = [None, None]
        self._deferred = [None, None]
        self._draining = [False, False]

    # -- forward ---------------------------------------------------------------------------------
    def _pump(self, engine: EngineView) -> None:
        while self._in_flight is None and self._queue:
            group = self._queue.popleft()
            engine.start_offload(group)
            if group.state is GroupState.OFFLOADING:
                self._in_flight = group

    def _release_due(self, engine: EngineView, layer: int) -> None:
        while self._in_flight is not None and self.windows[self._in_flight.layer] <= layer:
            engine.release(self._in_flight)
            self._in_flight = None
            self._pump(engine)

    def on_layer_end(self, engine: EngineView, layer: int, group: Optional[Group]) -> None:
        if group is not None:
            self._queue.append(group)
        self._pump(engine)
        self._release_due(engine, layer)

    def on_forward_end(self, engine: EngineView) -> None:
        self._release_due(engine, self.model_layers)
        while self._queue or self._in_flight is not None:
            self._pump(engine)
            self._release_due(engine, self.model_layers)
        if self.double_buffering:
            sizes = {g.layer: g.nbytes for g in engine.step.groups.values() if g.state is GroupState.OFFLOADED}
            if len(set(sizes.values())) > 1:
                detail = ", ".join(f"layer {layer}: {n} bytes" for layer, n in sorted(sizes.items()))
                raise ValueError(
                    "offload: double_buffering=True reloads every group into one of two buffers of "
                    f"the same size, but the offloaded groups differ in size ({detail}). Make the "
                    "offloaded layers save the same tensors, or pass double_buffering=False."
                )

    # -- backward --------------------------------------------------------------------------------
    def on_backward_reach(self, engine: EngineView, step: "StepState", layer: int) -> None:
        """Reload the groups of ``step`` whose window is ``layer`` (that micro-batch's own, when
        several are in flight)."""
        if self.double_buffering:
            self._settle(engine)
        for index, window in enumerate(self.windows):
            if window == layer:
                group = step.groups.get(index)
                if group is not None and group.state is GroupState.OFFLOADED:
                    self._reload(engine, group, defer=True)

    def on_unpack_miss(self, engine: EngineView, group: Group) -> None:
        if self.double_buffering:
            self._settle(engine)
        self._reload(engine, group, defer=False)

    def _settle(self, engine: EngineView) -> None:
        # Called where backward has moved past the nodes that consumed the draining groups: their
        # buffers are free, and a reload that was waiting for one goes in now.
        for slot in (0, 1):
            if not self._draining[slot]:
                continue
            self._draining[slot] = False
            self._occupant[slot] = None
            waiting = _deref(self._deferred[slot])
            self._deferred[slot] = None
            if waiting is not None and waiting.state is GroupState.OFFLOADED:
                self._reload(engine, waiting, defer=False)

    def _reload(self, engine: EngineView, group: Group, *, defer: bool) -> None:
        if not self.double_buffering or torch.is_grad_enabled():
            # Grad mode in backward means create_graph=True: the views may outlive this backward.
            engine.start_reload(group)
            return
        slot = group.layer % 2
        occupant = _deref(self._occupant[slot])
        if occupant is not None and occupant is not group:
            if defer:
                self._deferred[slot] = weakref.ref(group)
                return
            # Needed now while its buffer still serves another group: use a fresh buffer rather
            # than overwrite data that is still to be read.
            engine.start_reload(group)
            return
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < group.nbytes:
            buffer = torch.empty(group.nbytes, dtype=torch.uint8, device=engine.transport.device)
            self._buffers[slot] = buffer
        self._occupant[slot] = weakref.ref(group)
        engine.start_reload(group, into=buffer)

    def on_consumed(self, engine: EngineView, group: Group) -> None:
        if not self.double_buffering:
            return
        slot = group.layer % 2
        if _deref(self._occupant[slot]) is group:
            # Not free yet: the node that asked for this last tensor runs after this unpack.
            self._draining[slot] = True
