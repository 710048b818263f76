"""The schedule of ``OffloadActivations()`` without layers: groups cut by bytes, the tail kept.

With no layer modules to mark boundaries, ``OffloadActivations`` closes the open group at the
end of a module call once the group holds ``group_bytes`` of offloadable tensors (see
``activations.py``). How many groups a forward makes is known only when it ends, so the timing is
relative to the newest group rather than to a layer count:

- D2H of group ``g`` starts when group ``g + tail`` closes. The last ``tail`` groups of the forward
  therefore never start a copy and stay on the GPU: backward needs them first, at once, and a
  copy out and straight back in would only cost link time. A delay of ``tail`` groups still
  overlaps every copy with the compute of the groups after it.
- Release lags the copies by ``stash`` groups: a group is released (the compute stream waits for
  its D2H) once ``stash`` later copies have started, so the wait falls on a copy that has had
  ``stash`` groups of compute to finish. At the end of the forward every started copy is released,
  so all offloaded groups really leave the GPU before backward.
- Backward reaching group ``g`` (the marker on the output of the module call that closed it)
  reloads ``g`` if it is still on the host and prefetches ``g - 1`` .. ``g - prefetch_depth``; a
  group needed before its marker fired is reloaded on its first unpack.

The schedule holds layer indices, not groups: the step's groups stay weakly held (see ``step.py``).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Optional

from ..group import Group, GroupState
from ..policy import KEEP_LAYER
from .base import Schedule

from .engine_view import EngineView

if TYPE_CHECKING:
    from ..step import StepState


class ScheduleAuto(Schedule):
    """Offload every group but the last ``tail`` of the forward; release ``stash`` groups late."""

    name = "auto"

    def __init__(self, tail: int = 1, stash: int = 2, prefetch_depth: int = 2) -> None:
        # No layer count: every group is a candidate until the forward's end says which are the
        # tail. num_layers stays 0 so that nothing reads a count this schedule does not have.
        super().__init__(num_layers=0, model_layers=0)
        self.tail = tail
        self.stash = stash
        self.prefetch_depth = prefetch_depth
        self._waiting: deque[int] = deque()    # closed, copy not started (the newest ``tail``)
        self._in_flight: deque[int] = deque()  # copy started, not released yet

    def offloads(self, layer: int) -> bool:
        """Every group is a candidate: the tail is decided when the forward ends."""
        return True

    def expects_offload(self) -> bool:
        """This schedule always means to offload something."""
        return True

    def on_step_start(self, engine: EngineView) -> None:
        self._waiting.clear()
        self._in_flight.clear()

    def on_layer_end(self, engine: EngineView, layer: int, group: Optional[Group]) -> None:
        if group is None:
            return  # nothing offloadable was saved since the last boundary
        groups = engine.step.groups
        self._waiting.append(layer)
        while len(self._waiting) > self.tail:
            older = groups.get(self._waiting.popleft())
            if older is None:
                continue  # dropped with its graph
            engine.start_offload(older)
            if older.state is GroupState.OFFLOADING:
                self._in_flight.append(older.layer)
        while len(self._in_flight) > self.stash:
            done = groups.get(self._in_flight.popleft())
            if done is not None:
                engine.release(done)

    def on_forward_end(self, engine: EngineView) -> None:
        groups = engine.step.groups
        while self._in_flight:
            done = groups.get(self._in_flight.popleft())
            if done is not None:
                engine.release(done)
        # The tail stays on the GPU: counted as kept (not in an offloaded layer) so that the
        # stats, and the warning of a step that offloaded nothing, can say where they went.
        counters = engine.step.counters
        while self._waiting:
            kept = groups.get(self._waiting.popleft())
            if kept is not None and kept.state is GroupState.RESIDENT:
                counters.keep(KEEP_LAYER, len(kept.table))

    def on_backward_reach(self, engine: EngineView, step: "StepState", layer: int) -> None:
        """Reload ``step``'s group ``layer`` and prefetch the ``prefetch_depth`` below it (in its
        own micro-batch when several forwards are in flight)."""
        groups = step.groups
        for target in range(layer, layer - 1 - self.prefetch_depth, -1):
            group = groups.get(target)
            if group is not None and group.state is GroupState.OFFLOADED:
                engine.start_reload(group)
