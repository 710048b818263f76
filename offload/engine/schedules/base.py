"""The schedule interface: *when* each layer's group is offloaded, released and reloaded.

The engine does the work (``start_offload``, ``release``, ``start_reload``) and calls the
schedule at each event of a step. Schedules see the forward's step through ``engine.step`` and
the step a backward reaches as an argument (it may be an earlier micro-batch still in flight),
and keep no tensors of their own. They know the engine only through these calls, so this module
imports nothing from the engine at run time (no import cycle).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

from ..group import Group

from .engine_view import EngineView

if TYPE_CHECKING:
    from ..step import StepState


# Where groups are made by bytes (small layers sharing one in v2, module calls in the form
# without layers), a group closes once it holds this many. Large enough that a group's fixed host
# cost (close, copy submissions, events, waits: 100-200 us inside steps on our H100's host, more
# than PCIe needs for a few MiB) vanishes next to its copy (~0.6 ms at 54 GB/s); small enough that
# copies pipeline behind the compute of the layers after them and that what a filling group holds
# on the GPU beyond the schedule's budget stays small.
DEFAULT_GROUP_BYTES = 32 << 20


class Schedule:
    """Base schedule: offload the first ``num_layers`` layers; subclasses decide the timing."""

    name = "base"

    def __init__(self, num_layers: int, model_layers: int) -> None:
        self.num_layers = num_layers
        self.model_layers = model_layers

    def offloads(self, layer: int) -> bool:
        """Whether the group of ``layer`` is a candidate for offloading."""
        return layer < self.num_layers

    def offloaded_after(self, layer: int) -> int:
        """How many layers after ``layer`` the schedule offloads (the arena's growth forecast;
        asked only when the arena has no block, so a loop is fine)."""
        return sum(self.offloads(later) for later in range(layer + 1, self.model_layers))

    def groups_after(self, group: Group) -> Union[int, list[int]]:
        """How many more groups the step will copy after ``group`` (the arena's growth forecast:
        that many blocks of about its size are pinned ahead), or, where the schedule knows them
        (a plan), the sizes of their regions. One per offloaded layer here."""
        return self.offloaded_after(group.top)

    def expects_offload(self) -> bool:
        """Whether a step that offloads nothing is worth a warning (see ``offload.engine.diagnose``)."""
        return self.num_layers > 0

    def min_offload_bytes(self, layer: int) -> Optional[int]:
        """A size floor for ``layer``'s offloaded tensors, or None for the policy's default."""
        return None

    def recomputes(self, layer: int) -> bool:
        """Whether ``layer`` runs under checkpointing (planned schedules only)."""
        return False

    def selective(self, layer: int) -> bool:
        """Whether ``layer`` runs its candidates under selective recompute (planned schedules only)."""
        return False

    def keeps_attention(self, layer: int) -> bool:
        """Whether ``layer``'s recompute keeps attention's outputs (planned schedules only)."""
        return False

    def joins_next(self, group: Group, layer: int) -> bool:
        """Whether the group of ``layer``, which just ended, stays open for the next layer's
        tensors instead of being closed and copied on its own (small layers sharing one copy).
        The base never does: every layer is a group of its own.

        Only for a next layer this schedule offloads. Between a layer whose group joins the
        next and that next layer the schedule is not called (no ``on_layer_end`` with nothing
        to copy, no ``on_layer_start`` for a layer that adds no group), and the shared group's
        inner layers get no backward marker: the marker of its top layer reloads all of it,
        so ``on_backward_reach`` should prefetch below the group's first layer (``group.layer``).
        """
        return False

    def on_step_start(self, engine: EngineView) -> None:
        """A new step (forward) begins."""

    def on_layer_start(self, engine: EngineView, layer: int) -> None:
        """Forward is about to run ``layer``."""

    def on_layer_end(self, engine: EngineView, layer: int, group: Optional[Group]) -> None:
        """Forward finished ``layer``; ``group`` is its closed group (None if not offloaded)."""

    def on_forward_end(self, engine: EngineView) -> None:
        """The last layer of the forward finished."""

    def on_abort(self, engine: EngineView, step: "StepState") -> None:
        """The forward of ``step`` raised: forget what the schedule holds for it, so that its
        groups die with autograd's graph (the engine drops the step itself)."""

    def on_backward_reach(self, engine: EngineView, step: "StepState", layer: int) -> None:
        """Backward is about to run ``layer`` of ``step`` (the gradient of its output is ready).

        ``step`` is ``engine.step``, or an earlier micro-batch still in flight (its forward ended
        before the current step's began, as in a pipeline's 1F1B order): a schedule reloads and
        prefetches in ``step.groups``, and counts what the other micro-batches in flight
        (``engine.micro_batches()``) hold against its budget. The base does nothing: groups are
        reloaded when backward needs them (``on_unpack_miss``).
        """

    def on_unpack_miss(self, engine: EngineView, group: Group) -> None:
        """Backward needs ``group`` and it is not on the GPU: as if backward had just reached its
        layer (the marker fired late, or there is none), in the group's own micro-batch. The
        engine then reloads the group itself if that did not, as it does for a group of a step
        no longer in flight (a retained graph), which has no step to reach."""
        step = engine.step_state(group.step)
        if step is not None:
            self.on_backward_reach(engine, step, group.layer)

    def on_consumed(self, engine: EngineView, group: Group) -> None:
        """Every saved tensor of ``group`` has been handed back once since its reload."""


class ManualSchedule(Schedule):
    """Nothing happens by itself: the user's controller calls offload, release and reload.

    A group that backward needs before the user reloaded it is reloaded on demand, so a missed
    call costs time, never data.
    """

    name = "manual"

    def expects_offload(self) -> bool:
        """The user decides what is offloaded, and when: nothing to warn about."""
        return False
