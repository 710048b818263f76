"""The planned schedule: per-layer keep / offload / recompute, releases and reloads by budget.

It carries out a :class:`offload.planner.Plan` with the rules of the planner's cost model
(``offload/planner/model.py``: that docstring is the spec; this module follows it step for
step, with the byte figures of the probe):

- forward, at each layer start: groups whose D2H has finished are released (free); while
  ``base + held + forward_need(layer) > budget`` the oldest in-flight group is released by force
  (the compute stream waits for its D2H). After the last layer the same with ``head_bytes``.
  Without a budget nothing is forced, and the D2H of late layers runs on into backward.
- backward, when it reaches layer ``i``: a group of ``i`` still in flight is never released (the
  originals serve its backward); layer ``i``'s group is reloaded if it was released; while the
  budget (counting the gradients backward has made so far) is exceeded, the oldest in-flight
  group below ``i`` is released by force; then up to two groups below ``i`` are prefetched
  while they fit the budget.

Recomputed layers are wrapped in non-reentrant checkpointing by ``OffloadActivations``; their
group holds only the checkpoint's inputs. A recomputed layer planned ``keep_inputs`` makes no
group: its inputs stay on the GPU until its backward, as a KEEP layer's tensors do.

Several micro-batches in flight (a pipeline stage's 1F1B order, see ``lifecycle.py``): each is a
step with its own groups and its own ``held`` figures (a :class:`Holding`, by step index).
- Backward reaching a layer of an earlier micro-batch reloads, releases and prefetches in *that*
  micro-batch's groups, as for the current one.
- ``held`` in the rules above is the sum over every micro-batch in flight, and "the oldest
  in-flight group" is the oldest copy of any of them (earlier micro-batches first). The plan's
  budget was made for one micro-batch, so it grows by what the plan keeps of each other one
  anyway (its bytes with every copy released): a micro-batch waiting for its backward with its
  copies released leaves the budget as it was alone; one holding unreleased copies or
  prefetched groups takes them from it. With one micro-batch at a time none of this is looked at.
- ``grads`` stays the figure of the backward running now (micro-batches accumulate into the same
  gradients; the plan's model knows one backward).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import torch

from ..group import Group, GroupState
from ..step_peak import StepPeak
from ...host.layout import ALIGNMENT
from ...planner.model import (
    PREFETCH_DEPTH, copied_at, copied_slots, forward_need_bytes, held_bytes, offloaded_bytes, resident_bytes, transient_bytes,
)
from ...planner.types import Action, LayerPlan, LayerProfile, Plan, StepProfile
from .base import Schedule

from .engine_view import EngineView

if TYPE_CHECKING:
    from ..step import StepState


@dataclass
class Holding:
    """One micro-batch's (step's) GPU bytes by the plan's figures, updated as the step goes.

    ``copying`` holds layer indices, not groups: the step's groups stay weakly held (see
    ``step.py``), so a micro-batch whose graph is dropped still frees its GPU originals.
    """

    held: list[int]  # the model's GPU bytes per layer
    copying: list[int] = field(default_factory=list)  # D2H submitted, not released: oldest first


class PlannedSchedule(Schedule):
    """Carry out ``plan`` (made from ``profile``) on every step."""

    name = "planned"

    def __init__(self, plan: Plan, profile: StepProfile) -> None:
        plan.check_matches(profile.signature(), len(profile.layers))
        actions = [lp.action for lp in plan.layers]
        # The layers whose group goes to the host (not KEEP, not a recompute keeping its inputs).
        self._offloads = [lp.offloads for lp in plan.layers]
        super().__init__(num_layers=sum(self._offloads), model_layers=len(actions))
        self.plan = plan
        self.profile = profile
        self.budget = plan.budget_bytes
        self.actions = actions
        n = len(actions)
        self._held_full = [held_bytes(profile.layers[i], plan.layers[i]) for i in range(n)]
        self._held_after_release = [resident_bytes(profile.layers[i], plan.layers[i]) for i in range(n)]
        self._transient = [transient_bytes(profile.layers[i], plan.layers[i], profile.recompute_factor) for i in range(n)]
        self._need = [forward_need_bytes(layer) for layer in profile.layers]
        self._copies = [offloaded_bytes(profile.layers[i], plan.layers[i]) > 0 for i in range(n)]
        self._regions = [_region(profile.layers[i], plan.layers[i]) for i in range(n)]  # per layer, 0: none
        # Gradients left allocated when backward reaches layer i: the head's leftovers and the
        # weight gradients of the layers above it (a suffix sum, read once per backward layer).
        self._grads_at = [profile.head_residual_bytes] * (n + 1)
        for i in range(n - 1, -1, -1):
            self._grads_at[i] = self._grads_at[i + 1] + (profile.layers[i + 1].grad_bytes if i + 1 < n else 0)
        # What the plan keeps of a micro-batch anyway (every copy released): the budget grows by
        # it for each other micro-batch in flight, since the plan was made for one.
        self._kept = sum(self._held_after_release)
        self._steps: dict[int, Holding] = {}  # step index -> what it holds (those in flight)
        self.grads = 0  # the model's gradient bytes backward has left allocated so far
        # This step's tokens over the tokens the plan's profile is for (a plan is made for the
        # top of a bucket of shapes, offload.plan_steps): its size floors and byte checks scale.
        self.scale = 1.0
        # This step's (batch, length), where known: the plan's byte figures are checked there.
        self.step_shape: Optional[tuple[int, int]] = None
        # Set to a list to record (event, layer, model's bytes, allocated bytes) at every
        # decision point: where a measured peak departs from the prediction, this shows where.
        self.trace: Optional[list[tuple[str, int, int, int]]] = None
        # The step's peak, read at the forward's and the backward's end (the plan report's
        # measured peak, offload.engine.step_peak); None: not measured.
        self.peak: Optional[StepPeak] = None
        # Called at the forward's end (the planner's: a plan made in the background since the
        # step's entry has its host blocks asked then, not a step later).
        self.after_forward: Optional[Callable[[], None]] = None

    # -- what the engine asks --------------------------------------------------------------------
    def offloads(self, layer: int) -> bool:
        return layer < len(self.actions) and self._offloads[layer]

    def region_bytes(self) -> list[int]:
        """The host region each copying layer will ask for: its copied bytes plus the layout's
        per-slot alignment (what the arena pins ahead for this plan)."""
        return [n for n in self._regions if n > 0]

    def groups_after(self, group: Group) -> list[int]:
        """The arena's growth forecast after a miss of ``group``'s layer: the regions the later
        layers will ask for, at this step's tokens. The arena pins ahead those no idle block
        serves, each at its own size (the plan's blocks were asked for when it was put in
        force), not a block of this group's size per later copying layer: on T22's 8192-token
        plan, where most later layers are recomputes sending 128 MiB of inputs, an offloaded
        layer's miss pinned 6 blocks of 1.5 GB, and an input group 192 KiB over its prediction
        15 blocks of 151 MiB, though idle blocks served every later layer."""
        return [int(region * self.scale) for region in self._regions[group.top + 1:] if region]

    def min_offload_bytes(self, layer: int) -> Optional[int]:
        """Offload only tensors of at least this size in ``layer`` (None: the policy's default):
        the plan's floor, scaled to this step's tokens (:attr:`scale`)."""
        if layer < len(self.actions) and self.actions[layer] is Action.OFFLOAD:
            floor = self.plan.layers[layer].min_offload_bytes
            return int(floor * self.scale) if floor else None
        return None

    def recomputes(self, layer: int) -> bool:
        """Whether ``layer`` runs under checkpointing in this plan."""
        return layer < len(self.actions) and self.actions[layer] is Action.RECOMPUTE

    def tile_tokens(self, layer: int) -> int:
        """Tokens per chunk of ``layer``'s tiled candidates in this plan (0: untiled)."""
        return self.plan.layers[layer].tile_tokens if layer < len(self.actions) else 0

    def selective(self, layer: int) -> bool:
        """Whether ``layer`` runs its candidates under selective recompute in this plan."""
        return layer < len(self.actions) and self.plan.layers[layer].selective

    def keeps_attention(self, layer: int) -> bool:
        """Whether ``layer``'s recompute keeps attention's outputs in this plan."""
        return layer < len(self.actions) and self.plan.layers[layer].keep_attention

    # -- accounting ------------------------------------------------------------------------------
    def _holding(self, step: "StepState") -> Holding:
        # Made when the step starts; made here for a step that began under another schedule
        # (OffloadActivations switches to its plan after its probe steps).
        holding = self._steps.get(step.index)
        if holding is None:
            holding = self._steps[step.index] = Holding([0] * len(self.actions))
        return holding

    def _micro_batches(self, engine: EngineView, step: "StepState") -> list["StepState"]:
        """``step`` and the other micro-batches in flight, oldest first."""
        if not engine.in_flight:
            return [step]
        others = [s for s in engine.micro_batches() if s is not step]
        return sorted([*others, step], key=lambda s: s.index)

    def _held(self, engine: EngineView, step: "StepState") -> tuple[int, int]:
        """(the model's GPU bytes: base, gradients and every micro-batch in flight, how many
        micro-batches besides ``step`` that counts)."""
        steps = self._micro_batches(engine, step)
        held = sum(sum(self._holding(s).held) for s in steps)
        return self.profile.base_bytes + held + self.grads, len(steps) - 1

    def _record(self, engine: EngineView, step: "StepState", event: str, layer: int) -> None:
        if self.trace is not None:
            device = engine.transport.device
            actual = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            self.trace.append((event, layer, self._held(engine, step)[0], actual))

    def _over(self, engine: EngineView, step: "StepState", extra: int) -> bool:
        if self.budget is None:
            return False
        held, others = self._held(engine, step)
        # The budget is for one micro-batch: each other one brings what the plan keeps anyway.
        return held + extra > self.budget + others * self._kept

    def _release(self, engine: EngineView, step: "StepState", layer: int) -> None:
        holding = self._holding(step)
        holding.copying.remove(layer)
        group = step.groups.get(layer)
        if group is not None:  # else dropped with its graph: nothing left to release
            engine.release(group)
            holding.held[layer] = self._held_after_release[layer]

    def _release_finished(self, engine: EngineView, step: "StepState") -> None:
        for owner in self._micro_batches(engine, step):
            for layer in list(self._holding(owner).copying):
                group = owner.groups.get(layer)
                if group is None or engine.transport.offload_finished(group):
                    self._release(engine, owner, layer)

    def _force(self, engine: EngineView, step: "StepState", extra: int) -> None:
        # Oldest copy first: earlier micro-batches', then in layer order. Every layer listed is
        # below the one its backward reached (on_backward_reach drops the others).
        for owner in self._micro_batches(engine, step):
            copying = self._holding(owner).copying
            while copying and self._over(engine, step, extra):
                self._release(engine, owner, copying[0])

    # -- forward ---------------------------------------------------------------------------------
    def on_step_start(self, engine: EngineView) -> None:
        # Forget the micro-batches that are done; keep those in flight (their backward is to come).
        live = {step.index for step in engine.in_flight.values()}
        self._steps = {index: holding for index, holding in self._steps.items() if index in live}
        self._holding(engine.step)
        self.grads = 0

    def on_layer_start(self, engine: EngineView, layer: int) -> None:
        n = len(self.actions)
        step = engine.step
        self._release_finished(engine, step)
        self._force(engine, step, self._need[layer] if layer < n else 0)
        self._record(engine, step, "forward", layer)

    def on_layer_end(self, engine: EngineView, layer: int, group: Optional[Group]) -> None:
        n = len(self.actions)
        if layer >= n:
            return
        step = engine.step
        holding = self._holding(step)
        holding.held[layer] = self._held_full[layer]
        if group is not None:
            self._check_bytes(engine, layer, group)
            engine.start_offload(group)
            if group.state is GroupState.OFFLOADING:
                holding.copying.append(layer)
        if layer == n - 1:  # the head comes next: the forward's peak
            self._release_finished(engine, step)
            self._force(engine, step, self.profile.head_bytes)
            self._record(engine, step, "head", layer)

    def on_forward_end(self, engine: EngineView) -> None:
        if self.peak is not None:
            self.peak.read()
        if self.after_forward is not None:
            self.after_forward()

    def _check_bytes(self, engine: EngineView, layer: int, group: Group) -> None:
        # The plan's figure for what the layer copies against what it did. A plan is made for
        # the top of a bucket of shapes (across ranks, the largest): first the plan's figure
        # scaled to this step's tokens (cheap, every step), and where that is off, the exact one
        # at this step's shape (each slot grown by its own exponents and held against the size
        # floor as the engine's policy holds it; offload.planner.scaling). Off by more than
        # that, the plan's memory figures do not hold: say so once, with what to do.
        if self.actions[layer] is not Action.OFFLOAD:
            return
        lp, profile = self.plan.layers[layer], self.profile
        got = group.copy_bytes
        expected = offloaded_bytes(profile.layers[layer], lp) * self.scale
        if not expected or abs(got - expected) <= 0.1 * expected + (64 << 10):
            return
        shape, at = self.step_shape, profile.shape
        if shape is not None and at is not None:
            floor = self.min_offload_bytes(layer) or profile.offload_floor_bytes
            expected = copied_at(profile.layers[layer], lp, shape, at, floor)
            if abs(got - expected) <= 0.1 * expected + (64 << 10):
                return
        engine.warn_once("plan-bytes", bytes_off(layer, got, int(expected), shape, at))

    # -- backward --------------------------------------------------------------------------------
    def on_backward_reach(self, engine: EngineView, step: "StepState", layer: int) -> None:
        """Backward is about to run ``layer`` of ``step``: reload its group, release by force
        while over the budget, prefetch below it while the budget allows (the module's rules)."""
        if self.peak is not None:
            self.peak.read_after_backward()
        holding = self._holding(step)
        held = holding.held
        for done in range(layer + 1, len(held)):
            held[done] = 0  # their backward is over: autograd freed their tensors
        self.grads = self._grads_at[min(layer, len(self.actions))]
        holding.copying = [c for c in holding.copying if c < layer]
        groups = step.groups
        needed = groups.get(layer)
        if needed is not None and needed.state is GroupState.OFFLOADED:
            engine.start_reload(needed)
            held[layer] = self._held_full[layer]
        transient = self._transient[layer] if layer < len(self._transient) else 0
        self._force(engine, step, transient)
        depth = 0
        for below in range(layer - 1, -1, -1):
            if depth >= PREFETCH_DEPTH:
                break
            if not self._copies[below]:
                continue
            depth += 1
            group = groups.get(below)
            if group is None or group.state is not GroupState.OFFLOADED:
                continue
            extra = self._held_full[below] - held[below] + transient
            if self._over(engine, step, extra):
                break
            engine.start_reload(group)
            held[below] = self._held_full[below]
        self._record(engine, step, "backward", layer)


def bytes_off(layer: int, got: int, expected: int, shape: Optional[tuple[int, int]],
              at: Optional[tuple[int, int]]) -> str:
    """The warning for a layer that copied other bytes than its plan says (plans are made per
    batch shape, so the advice is not to make a plan: that is done at every new shape)."""
    head = f"offload: layer {layer} saved {got} bytes to offload, but the plan was made for {expected}"
    if at is None:
        # A profile of an older version: it does not say its shape, so no plan is made per shape.
        return (f"{head}: the plan's profile does not say the batch shape it was measured at (an older "
                "version's), so it is followed at every shape and its memory figures no longer hold. "
                "Make the plan again with this version's offload.plan(...), or drop plan= and pass "
                "memory_budget_bytes= so that OffloadActivations probes the model itself.")
    where = f" in a step of batch {shape[0]} x length {shape[1]}" if shape is not None else ""
    return (f"{head}{where} (a plan made for batch {at[0]} x length {at[1]}, from the probe's figures): "
            "this layer's saved tensors do not grow with the batch and the length as the probe's shapes "
            "said (sizes that depend on the data, such as a mixture of experts' routing, or a model "
            "changed since the probe). Gradients stay exact, but the plan's memory figures are off by "
            "the difference: a step that runs out of memory lowers the budget by itself (with a "
            "warning); to stay clear of that, pass a lower memory_budget_bytes (or \"lowest\"). If "
            "the model changed, make a new OffloadActivations (or plan) for it.")


def _region(layer: LayerProfile, lp: LayerPlan) -> int:
    # The host region ``layer`` asks for under ``lp`` at the plan's tokens: its copied bytes plus
    # the layout's per-slot alignment; 0 when it copies nothing.
    if lp.action is Action.OFFLOAD:
        slots = copied_slots(layer, lp)
        return sum(slots) + ALIGNMENT * len(slots) if slots else 0
    if lp.offloads:  # a recompute sending its inputs (one keeping them pins nothing)
        return layer.input_bytes + ALIGNMENT * 4  # a layer's few input tensors
    return 0
