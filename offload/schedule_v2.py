"""The v2 schedule (default) and the manual schedule.

A schedule decides *when* each layer's group is offloaded, released and reloaded; the engine does
the work (``start_offload``, ``release``, ``start_reload``). Schedules see the engine's current
step through ``engine.step`` and keep no tensors of their own.

v2: layers ``0..k-1`` of ``N = model_layers`` are offloaded (``k = num_layers``).
- D2H of a layer starts as soon as the layer ends (its tensors are ready).
- Release is as late as possible while keeping at most ``N - k`` layers' activations resident:
  at the start of layer ``L`` the layers resident are the non-offloaded layers started so far
  (``max(0, L - k + 1)``, counting ``L``), plus the offloaded ones not yet released (plus ``L``
  itself when it is offloaded). Releasing the oldest first until that total is ``N - k`` gives a
  peak equal to ``N - k`` resident layers while giving every D2H the most time to finish, since a
  release makes the compute stream wait for that D2H.
- Reload: when backward reaches layer ``L`` (the gradient of its output is computed: the marker
  that ``sync_function`` or ``OffloadActivations`` attaches) the group of ``L`` must be there, and
  the group of ``L - 1`` is prefetched so that its copy overlaps ``L``'s backward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from .group import Group, GroupState

if TYPE_CHECKING:
    from .engine import OffloadEngine


class Schedule:
    """Base schedule: offload the first ``num_layers`` layers; subclasses decide the timing."""

    name = "base"

    def __init__(self, num_layers: int, model_layers: int) -> None:
        self.num_layers = num_layers
        self.model_layers = model_layers

    def offloads(self, layer: int) -> bool:
        """Whether the group of ``layer`` is a candidate for offloading."""
        return layer < self.num_layers

    def on_step_start(self, engine: "OffloadEngine") -> None:
        """A new step (forward) begins."""

    def on_layer_start(self, engine: "OffloadEngine", layer: int) -> None:
        """Forward is about to run ``layer``."""

    def on_layer_end(self, engine: "OffloadEngine", layer: int, group: Optional[Group]) -> None:
        """Forward finished ``layer``; ``group`` is its closed group (None if not offloaded)."""

    def on_forward_end(self, engine: "OffloadEngine") -> None:
        """The last layer of the forward finished."""

    def on_backward_reach(self, engine: "OffloadEngine", layer: int) -> None:
        """Backward is about to run ``layer`` (the gradient of its output is ready)."""

    def on_unpack_miss(self, engine: "OffloadEngine", group: Group) -> None:
        """Backward needs ``group`` and it is not on the GPU: reload it now."""
        engine.start_reload(group)

    def on_consumed(self, engine: "OffloadEngine", group: Group) -> None:
        """Every saved tensor of ``group`` has been handed back once since its reload."""


class ScheduleV2(Schedule):
    """Offload layers ``0..k-1``, release lazily, prefetch one layer ahead in backward."""

    name = "v2"

    def on_layer_start(self, engine: "OffloadEngine", layer: int) -> None:
        k, n = self.num_layers, self.model_layers
        allowed = (n - k) - max(0, layer - k + 1)
        pending = [g for g in engine.step.groups.values() if g.state is GroupState.OFFLOADING]
        excess = len(pending) + (1 if layer < k else 0) - allowed
        for group in pending[: max(0, excess)]:
            engine.release(group)

    def on_layer_end(self, engine: "OffloadEngine", layer: int, group: Optional[Group]) -> None:
        if group is not None:
            engine.start_offload(group)

    def on_forward_end(self, engine: "OffloadEngine") -> None:
        for group in list(engine.step.groups.values()):
            if group.state is GroupState.OFFLOADING:
                engine.release(group)

    def on_backward_reach(self, engine: "OffloadEngine", layer: int) -> None:
        for target in (layer, layer - 1):
            group = engine.step.groups.get(target)
            if group is not None and group.state is GroupState.OFFLOADED:
                engine.start_reload(group)

    def on_unpack_miss(self, engine: "OffloadEngine", group: Group) -> None:
        engine.start_reload(group)
        if engine.step is not None and engine.step.index == group.step:
            previous = engine.step.groups.get(group.layer - 1)
            if previous is not None and previous.state is GroupState.OFFLOADED:
                engine.start_reload(previous)


class ManualSchedule(Schedule):
    """Nothing happens by itself: the user's controller calls offload, release and reload.

    A group that backward needs before the user reloaded it is reloaded on demand, so a missed
    call costs time, never data.
    """

    name = "manual"
