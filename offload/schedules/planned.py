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
group holds only the checkpoint's inputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from ..group import Group, GroupState
from ..layout import ALIGNMENT
from ..planner.model import (
    PREFETCH_DEPTH, forward_need_bytes, held_bytes, offloaded_bytes, resident_bytes, transient_bytes,
)
from ..planner.types import Action, Plan, StepProfile
from .base import Schedule

if TYPE_CHECKING:
    from ..engine import OffloadEngine


class PlannedSchedule(Schedule):
    """Carry out ``plan`` (made from ``profile``) on every step."""

    name = "planned"

    def __init__(self, plan: Plan, profile: StepProfile) -> None:
        plan.check_matches(profile.signature(), len(profile.layers))
        actions = [lp.action for lp in plan.layers]
        super().__init__(num_layers=sum(a is not Action.KEEP for a in actions), model_layers=len(actions))
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
        # Gradients left allocated when backward reaches layer i: the head's leftovers and the
        # weight gradients of the layers above it (a suffix sum, read once per backward layer).
        self._grads_at = [profile.head_residual_bytes] * (n + 1)
        for i in range(n - 1, -1, -1):
            self._grads_at[i] = self._grads_at[i + 1] + (profile.layers[i + 1].grad_bytes if i + 1 < n else 0)
        self.held = [0] * n  # the model's GPU bytes per layer, updated as the step goes
        self.grads = 0  # the model's gradient bytes backward has left allocated so far
        self._in_flight: list[Group] = []  # D2H submitted, not released: oldest first
        # Set to a list to record (event, layer, model's bytes, allocated bytes) at every
        # decision point: where a measured peak departs from the prediction, this shows where.
        self.trace: Optional[list[tuple[str, int, int, int]]] = None

    # -- what the engine asks --------------------------------------------------------------------
    def offloads(self, layer: int) -> bool:
        return layer < len(self.actions) and self.actions[layer] is not Action.KEEP

    def region_bytes(self) -> list[int]:
        """The host region each copying layer will ask for: its copied bytes plus the layout's
        per-slot alignment (what the arena pins ahead for this plan)."""
        sizes = []
        for layer, lp in zip(self.profile.layers, self.plan.layers):
            if lp.action is Action.OFFLOAD:
                slots = [n for n in layer.slot_bytes if n >= lp.min_offload_bytes]
                sizes.append(sum(slots) + ALIGNMENT * len(slots))
            elif lp.action is Action.RECOMPUTE:
                sizes.append(layer.input_bytes + ALIGNMENT * 4)  # a layer's few input tensors
        return [n for n in sizes if n > 0]

    def offloaded_after(self, layer: int) -> int:
        return sum(self._copies[layer + 1:])

    def min_offload_bytes(self, layer: int) -> Optional[int]:
        """Offload only slots of at least this size in ``layer`` (None: the policy's default)."""
        if layer < len(self.actions) and self.actions[layer] is Action.OFFLOAD:
            return self.plan.layers[layer].min_offload_bytes or None
        return None

    def recomputes(self, layer: int) -> bool:
        """Whether ``layer`` runs under checkpointing in this plan."""
        return layer < len(self.actions) and self.actions[layer] is Action.RECOMPUTE

    # -- accounting ------------------------------------------------------------------------------
    def _record(self, engine: "OffloadEngine", event: str, layer: int) -> None:
        if self.trace is not None:
            device = engine.transport.device
            actual = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            self.trace.append((event, layer, self.profile.base_bytes + sum(self.held) + self.grads, actual))

    def _over(self, extra: int) -> bool:
        if self.budget is None:
            return False
        return self.profile.base_bytes + sum(self.held) + self.grads + extra > self.budget

    def _release(self, engine: "OffloadEngine", group: Group) -> None:
        engine.release(group)
        self._in_flight.remove(group)
        self.held[group.layer] = self._held_after_release[group.layer]

    def _release_finished(self, engine: "OffloadEngine", below: int) -> None:
        for group in list(self._in_flight):
            if group.layer < below and engine.transport.offload_finished(group):
                self._release(engine, group)

    def _force(self, engine: "OffloadEngine", extra: int, below: int) -> None:
        while self._in_flight and self._over(extra):
            oldest = self._in_flight[0]
            if oldest.layer >= below:
                break
            self._release(engine, oldest)

    # -- forward ---------------------------------------------------------------------------------
    def on_step_start(self, engine: "OffloadEngine") -> None:
        self.held = [0] * len(self.actions)
        self.grads = 0
        self._in_flight = []

    def on_layer_start(self, engine: "OffloadEngine", layer: int) -> None:
        n = len(self.actions)
        self._release_finished(engine, n)
        self._force(engine, self._need[layer] if layer < n else 0, n)
        self._record(engine, "forward", layer)

    def on_layer_end(self, engine: "OffloadEngine", layer: int, group: Optional[Group]) -> None:
        n = len(self.actions)
        if layer >= n:
            return
        self.held[layer] = self._held_full[layer]
        if group is not None:
            self._check_bytes(engine, layer, group)
            engine.start_offload(group)
            if group.state is GroupState.OFFLOADING:
                self._in_flight.append(group)
        if layer == n - 1:  # the head comes next: the forward's peak
            self._release_finished(engine, n)
            self._force(engine, self.profile.head_bytes, n)
            self._record(engine, "head", layer)

    def _check_bytes(self, engine: "OffloadEngine", layer: int, group: Group) -> None:
        # A plan made for another model (or another batch or sequence length) saves other
        # bytes than the probe saw: the plan still runs and gradients stay exact, but its
        # budget accounting is off. Say so once, with the figures.
        if self.actions[layer] is not Action.OFFLOAD:
            return
        expected = offloaded_bytes(self.profile.layers[layer], self.plan.layers[layer])
        got = group.copy_bytes
        if expected and abs(got - expected) > 0.1 * expected + (64 << 10):
            engine.warn_once(
                "plan-bytes",
                f"offload: layer {layer} saved {got} bytes to offload, but the plan was made for "
                f"{expected}: the model, batch or sequence length differs from the probe's. The "
                "plan's memory figures no longer hold; make a new plan (offload.plan(...)).",
            )

    # -- backward --------------------------------------------------------------------------------
    def on_backward_reach(self, engine: "OffloadEngine", layer: int) -> None:
        groups = engine.step.groups
        for done in range(layer + 1, len(self.held)):
            self.held[done] = 0  # their backward is over: autograd freed their tensors
        self.grads = self._grads_at[min(layer, len(self.actions))]
        self._in_flight = [g for g in self._in_flight if g.layer < layer]
        needed = groups.get(layer)
        if needed is not None and needed.state is GroupState.OFFLOADED:
            engine.start_reload(needed)
            self.held[layer] = self._held_full[layer]
        transient = self._transient[layer] if layer < len(self._transient) else 0
        self._force(engine, transient, layer)
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
            extra = self._held_full[below] - self.held[below] + transient
            if self._over(extra):
                break
            engine.start_reload(group)
            self.held[below] = self._held_full[below]
        self._record(engine, "backward", layer)

    def on_unpack_miss(self, engine: "OffloadEngine", group: Group) -> None:
        if engine.step is not None and engine.step.index == group.step:
            self.on_backward_reach(engine, group.layer)
        else:
            engine.start_reload(group)
