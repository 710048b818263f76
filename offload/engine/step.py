"""The engine's per-step state: the step's groups (held weakly), its counters and progress, and
the gradient hook that tells the engine where backward is."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch

from .eager import run_eagerly
from .group import Group
from .stats import StepCounters



class StepGroups:
    """A step's groups by layer, held weakly: autograd's saved-tensor handles keep a group
    alive, so a forward whose graph is dropped frees its groups (see ``lifecycle.py``).

    A plain dict of ``weakref.ref`` rather than ``weakref.WeakValueDictionary``: the schedules
    look groups up at every layer boundary, and the latter's Python-level iteration guard cost
    more than the rest of the boundary (0.5 ms a step on SMALL).
    """

    __slots__ = ("_refs",)

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def __setitem__(self, layer: int, group: Group) -> None:
        self._refs[layer] = weakref.ref(group)

    def get(self, layer: int) -> Optional[Group]:
        ref = self._refs.get(layer)
        return None if ref is None else ref()

    def __getitem__(self, layer: int) -> Group:
        group = self.get(layer)
        if group is None:
            raise KeyError(layer)
        return group

    def pop(self, layer: int, default: Any = None) -> Any:
        ref = self._refs.pop(layer, None)
        group = None if ref is None else ref()
        return default if group is None else group

    def values(self) -> list[Group]:
        """The live groups, in layer order of creation, each once (a group that several small
        layers share is also found under its later layers: ``Group.top``)."""
        return [g for layer, r in self._refs.items() if (g := r()) is not None and g.layer == layer]

    def holding_gpu_memory(self, top: Optional[int] = None) -> int:
        """How many live groups (of layers ``<= top``, if given) hold GPU memory that backward
        has not finished with (``Group.holds_gpu_memory``). Counted without building the list
        of groups: the schedules ask at every backward layer."""
        count = 0
        for layer, ref in self._refs.items():
            g = ref()
            if g is not None and g.layer == layer and (top is None or layer <= top) and g.holds_gpu_memory:
                count += 1
        return count

    def keys(self) -> list[int]:
        """The layers that have a live group (a shared group's every layer)."""
        return [layer for layer, r in self._refs.items() if r() is not None]

    def __len__(self) -> int:
        return len(self.values())


@dataclass
class StepState:
    """The engine's view of one step: one micro-batch's forward and its backward.

    Several can be in flight at once (a pipeline stage's 1F1B order runs forward mb0, forward
    mb1, backward mb0, ...): the engine then holds the earlier ones in ``OffloadEngine.in_flight``
    by step index, so a group is found by (micro-batch, layer).
    """

    index: int
    counters: StepCounters
    # layer -> group (offloaded layers), held weakly: see ``lifecycle.py``.
    groups: StepGroups = field(default_factory=StepGroups)
    layers_started: int = 0
    forward_done: bool = False
    captured: bool = False  # the step runs under CUDA-graph capture
    abandoned: bool = False  # a group died before the forward ended: its graph was dropped
    unconsumed: int = 0  # closed groups not yet handed back in full (nor dead)
    # The layer backward is about to run (the last marker fired), None before its backward.
    reached: Optional[int] = None


# Earlier micro-batches kept in flight at most (a pipeline stage holds about as many as there are
# stages); beyond it the oldest is finished and no longer counted in the schedule's budgets.
MAX_IN_FLIGHT = 16


class InFlight(dict[int, StepState]):
    """The earlier micro-batches: steps whose forward ended, and whose backward had not handed
    every group back, when the next forward began (a pipeline stage's 1F1B order).

    A dict of step index -> :class:`StepState`, oldest first, so that a group is found by
    (micro-batch, layer): backward reaching one of them still reaches the schedule, and the
    schedule's budgets count what each holds. A dict itself rather than a class holding one:
    the schedules test ``if engine.in_flight`` at every layer boundary, and a Python ``__bool__``
    would be a call each time. A step leaves when its backward has handed every group back (the
    engine finishes it then), when its groups all died without a backward (its graph was
    dropped), or, past ``MAX_IN_FLIGHT``, the oldest first: forwards whose outputs are kept
    without a backward would otherwise be counted for good. ``wave_first`` is the first step of
    the current *wave* (steps in flight together): host blocks are trimmed only when a wave
    ends, keeping those any of its steps used.
    """

    __slots__ = ("wave_first",)

    def __init__(self) -> None:
        super().__init__()
        self.wave_first = 1

    def admit(self, step: StepState) -> bool:
        """Keep ``step`` if its backward is still to come; True if kept. Captured steps never
        interleave (their backward is in the same graph)."""
        if step.forward_done and step.unconsumed > 0 and not step.abandoned and not step.captured \
                and not step.counters.finished:
            self[step.index] = step
            return True
        return False

    def stale(self) -> list[StepState]:
        """The steps to finish now: those whose groups all died, and the oldest past the cap."""
        out = [step for step in self.values() if step.unconsumed <= 0]
        live = [step for step in self.values() if step.unconsumed > 0]
        return out + live[: max(0, len(live) - MAX_IN_FLIGHT)]

    def start(self, index: int) -> None:
        """Step ``index`` begins: with nothing in flight, it begins a new wave."""
        if not self:
            self.wave_first = index


def first_grad_tensor(value: Any) -> Optional[torch.Tensor]:
    """The first tensor that requires grad in a layer's output or arguments (nested in lists,
    tuples and dicts): its gradient tells when backward reaches, or leaves, the layer."""
    if isinstance(value, torch.Tensor):
        return value if value.requires_grad else None
    if isinstance(value, (list, tuple)):
        for item in value:
            found = first_grad_tensor(item)
            if found is not None:
                return found
    if isinstance(value, dict):
        return first_grad_tensor(list(value.values()))
    return None


class ReachListener(Protocol):
    """What :class:`BackwardReach` tells (the engine; a protocol, so that this module, which the
    engine imports, does not import it back)."""

    def on_backward_reach(self, step: int, layer: int) -> None: ...


class BackwardReach:
    """Fired when the gradient of a layer's output is computed (backward reaches it): a pre-hook
    of the node that made the output, or a hook of the output itself where it has no node."""

    __slots__ = ("engine", "step", "layer")

    def __init__(self, engine: ReachListener, step: int, layer: int) -> None:
        self.engine = engine
        self.step = step
        self.layer = layer

    @run_eagerly
    def __call__(self, grad: Any) -> None:
        self.engine.on_backward_reach(self.step, self.layer)
