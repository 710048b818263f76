"""Where the forward of the current step stands: one object, one checked transition per event.

The engine used to keep this as a dozen attributes that its parts shared (the open group, the
pending group, the current layer, whether a layer is open, the depth of passive layers, the step
counter, which hooks are pushed, the forward's thread). Every lifecycle bug of three rounds sat
in how they moved together, so they live here, and only the transitions below change them:

    IDLE --start_step--> BETWEEN --enter_layer--> IN_LAYER
      ^                    ^  |                      |
      |                    |  +--end_forward, let_go-+--> IDLE   (the forward is over)
      |                    +------exit_layer---------+
      +------------------------ abort ----------------------- (any state: a forward raised)

- IDLE: no forward is open. The step that ran last (``step``) may still wait for its backward.
- BETWEEN: a step's forward is open and no layer is. A tensor saved now joins the next layer's
  group (``pending_group``, see ``offload.engine.lifecycle``).
- IN_LAYER: a layer the engine counts is open (``layer``); ``open_group`` is its group, or None
  when the schedule does not offload it.

*Passive* layers (a checkpoint recomputing a layer in backward, an eval forward) change nothing
but ``passive_depth``: while it is above zero every layer event is ignored, in any state.

A step whose groups died before its forward ended (its graph was dropped) is *abandoned*
(``StepState.abandoned``, set when a group is freed), and one whose backward began early is done
(``StepState.forward_done``): either way the forward is no longer open, so the next layer starts
a fresh step from BETWEEN as from IDLE.

Each transition checks the invariants that tie the fields together (``_check``: a handful of
attribute reads, well under a microsecond) and raises naming the broken one: a wrong call order
is a bug in the engine or a front, never something to carry on from. This module only keeps the
books; the engine (``offload.engine.lifecycle``) pushes the hooks and tells the schedule.
"""

from __future__ import annotations

import enum
from typing import Optional

from .group import Group
from .step import StepState


class Phase(enum.Enum):
    IDLE = "idle"
    BETWEEN = "between layers"
    IN_LAYER = "in a layer"


_IDLE = Phase.IDLE
_BETWEEN = Phase.BETWEEN
_IN_LAYER = Phase.IN_LAYER


class LifecycleError(RuntimeError):
    """A transition was asked for in a state that does not allow it: a bug in the engine or in
    one of its fronts, reported with the state it found."""


class ForwardState:
    """The forward's position in the current step, and everything that moves with it."""

    # Slots: read on every pack (``open_group``) and every layer boundary.
    __slots__ = (
        "phase", "step", "step_index", "layer", "open_group", "pending_group", "last_closed",
        "passive_depth", "layer_hooks", "forward_hooks", "thread", "local_group", "local_hooks",
    )

    def __init__(self) -> None:
        self.phase = _IDLE
        self.step: Optional[StepState] = None  # the step started last (kept after its forward)
        self.step_index = 0                    # the index of that step (or of the last one
                                               # counted elsewhere); 0 before the first
        self.layer = -1                        # the layer open, or the last one that was
        self.open_group: Optional[Group] = None
        # The next layer's group, opened early by a tensor saved between two layers. Strong
        # reference: until its layer runs, no autograd handle may hold it yet.
        self.pending_group: Optional[Group] = None
        self.last_closed: Optional[int] = None  # the layer just closed; None after a passive one
        self.passive_depth = 0                 # open passive layers (see the module notes)
        self.layer_hooks = False               # the open layer pushed the saved-tensor hooks
        self.forward_hooks = False             # OffloadActivations pushed them for the forward
        self.thread = 0                        # the thread running the open forward
        # A graphed layer's own group while it is warmed up or captured (offload.graphs), with
        # its own hooks: outside any step, so none of the transitions above touch it.
        self.local_group: Optional[Group] = None
        self.local_hooks = False

    # -- questions -------------------------------------------------------------------------------
    def forward_open(self) -> bool:
        """Whether a step's forward is open (a layer or the space between two)."""
        if self.phase is _IDLE:
            return False
        step = self.step
        return not step.forward_done and not step.abandoned  # type: ignore[union-attr]

    @property
    def in_layer(self) -> bool:
        """Whether a layer the engine counts is open."""
        return self.phase is _IN_LAYER

    # -- transitions -----------------------------------------------------------------------------
    def let_go(self) -> None:
        """Stop holding the step started last (it is finished, or waits in flight for its
        backward): its groups can die with their graph. Back to IDLE."""
        if self.phase is _IN_LAYER:
            self._refuse("let go of the step", "outside a layer")
        self.step = None
        self.phase = _IDLE
        self.pending_group = None

    def count_step_elsewhere(self) -> None:
        """A step of the context ran without the engine (a probe step, ``offload.plan_steps``):
        the next step's index counts it, so that the figures number every step of the context."""
        if self.phase is _IN_LAYER or self.forward_open():
            self._refuse("count a step run elsewhere", "between steps")
        self.step_index += 1

    def start_step(self, step: StepState, thread: int) -> None:
        """A new step's forward begins (from IDLE, or BETWEEN the layers of an abandoned step)."""
        if self.phase is _IN_LAYER or self.forward_open():
            self._refuse("start a step", "IDLE, or between the layers of an abandoned step")
        self.phase = _BETWEEN
        self.step = step
        self.step_index = step.index
        self.thread = thread
        self.pending_group = None
        self._check()

    def open_pending(self, group: Group) -> None:
        """A tensor saved between two layers opened the next layer's group early."""
        if self.phase is not _BETWEEN:
            self._refuse("open the next layer's group", "between two layers of an open forward")
        self.pending_group = group
        self._check()

    def take_pending(self) -> Optional[Group]:
        """The pending group, handed to the caller (the layer it was opened for is entering)."""
        pending, self.pending_group = self.pending_group, None
        return pending

    def enter_layer(self, layer: int, group: Optional[Group], hooks: bool) -> None:
        """Layer ``layer`` opens, saving into ``group`` (None: kept); ``hooks``: it pushed them.
        The caller took the pending group first (:meth:`take_pending`)."""
        if self.phase is not _BETWEEN or self.pending_group is not None:
            self._refuse(f"enter layer {layer}", "between two layers, the pending group taken")
        self.phase = _IN_LAYER
        self.layer = layer
        self.open_group = group
        self.layer_hooks = hooks
        self._check()

    def exit_layer(self) -> Optional[Group]:
        """The open layer closes: back between layers; returns its group (None if kept)."""
        if self.phase is not _IN_LAYER:
            self._refuse("exit a layer", "in a layer")
        group, self.open_group = self.open_group, None
        self.phase = _BETWEEN
        self.layer_hooks = False
        self.last_closed = self.layer
        self._check()
        return group

    def end_forward(self) -> Optional[Group]:
        """The forward is over (its last layer closed, or backward began): IDLE; returns the
        pending group, saved after the last layer for one that never came, for the caller to keep.

        Inside a layer (a backward run from within a layer's forward ended it early) the layer
        stays open and the state goes IDLE when it closes: the caller asks again then.
        """
        if self.phase is _IN_LAYER:
            return None
        pending, self.pending_group = self.pending_group, None
        self.phase = _IDLE
        self._check()
        return pending

    def abort(self) -> Optional[StepState]:
        """A forward raised, from any state: forget the open step; returns it (or None).

        The hooks' flags are cleared too: the caller pops them before calling this.
        """
        step, self.step = self.step, None
        self.phase = _IDLE
        self.open_group = None
        self.pending_group = None
        self.passive_depth = 0
        self.layer_hooks = False
        self.forward_hooks = False
        self.last_closed = None
        return step

    # -- invariants ------------------------------------------------------------------------------
    def _check(self) -> None:
        phase = self.phase
        if phase is not _IN_LAYER and (self.open_group is not None or self.layer_hooks):
            self._broken("a group or the layer's hooks are open outside a layer")
        if phase is not _IDLE and self.step is None:
            self._broken("a forward is open without a step")
        pending = self.pending_group
        if pending is not None and (phase is not _BETWEEN or pending.top != self.step.layers_started):  # type: ignore[union-attr]
            self._broken("the pending group is not the next layer's")
        group = self.open_group
        if group is not None and group.top != self.layer:
            self._broken(f"the open group is layer {group.top}'s, in layer {self.layer}")

    def _refuse(self, what: str, allowed: str) -> None:
        raise LifecycleError(
            f"offload: cannot {what} {self.phase.value} (allowed only {allowed}); this is a bug in "
            "offload's engine or in the front calling it, please report it"
        )

    def _broken(self, what: str) -> None:
        raise LifecycleError(
            f"offload: the forward's state broke an invariant ({what}; {self.phase.value}, layer "
            f"{self.layer}); this is a bug in offload's engine, please report it"
        )
