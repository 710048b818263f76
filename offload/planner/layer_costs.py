"""What one layer holds, copies and costs under one action: the per-layer figures of the cost
model (:mod:`offload.planner.model`, whose docstring is their spec) and of the plan table.

They read a layer profile and a layer plan by their fields (the protocols below), so this module
sits under both ``types`` and ``table``: a plan's table can be printed from ``types`` without an
import cycle.
"""

from __future__ import annotations

from typing import Optional, Protocol

from .actions import Action, slot_keys
from .shapes import Slot, StepShape, grown

_LINEAR = (1, 1)


class Slots(Protocol):
    """Saved slots and the cache beside them, as a layer profile and its selective one have them."""

    @property
    def slot_bytes(self) -> tuple[int, ...]: ...
    @property
    def slot_keys(self) -> tuple[int, ...]: ...
    @property
    def cached_bytes(self) -> int: ...
    @property
    def slot_growth(self) -> tuple[tuple[int, int], ...]: ...
    @property
    def small_slots(self) -> tuple[tuple[int, int, int, int], ...]: ...


class SlotsLike(Slots, Protocol):
    """A :class:`~offload.planner.types.SelectiveProfile`, as these functions read it."""

    @property
    def extra_backward_ms(self) -> float: ...


class LayerLike(Slots, Protocol):
    """A :class:`~offload.planner.types.LayerProfile`, as these functions read it."""

    @property
    def selective(self) -> Optional[SlotsLike]: ...
    @property
    def input_bytes(self) -> int: ...
    @property
    def saved_bytes(self) -> int: ...
    @property
    def forward_peak_bytes(self) -> int: ...
    @property
    def backward_peak_bytes(self) -> int: ...
    @property
    def forward_ms(self) -> float: ...
    @property
    def backward_ms(self) -> float: ...
    @property
    def attention_forward_ms(self) -> float: ...
    @property
    def attention_bytes(self) -> int: ...


class ChoiceLike(Protocol):
    """A :class:`~offload.planner.types.LayerPlan`, as these functions read it."""

    @property
    def action(self) -> Action: ...
    @property
    def min_offload_bytes(self) -> int: ...
    @property
    def selective(self) -> bool: ...
    @property
    def tile_tokens(self) -> int: ...
    @property
    def keep_inputs(self) -> bool: ...
    @property
    def keep_attention(self) -> bool: ...


def _selective(layer: LayerLike, lp: ChoiceLike) -> Optional[SlotsLike]:
    if not lp.selective:
        return None
    if layer.selective is None:
        raise ValueError("a plan runs a layer selectively, but its profile has no selective candidates: "
                         "make the plan for this profile")
    return layer.selective


def layer_slots(layer: LayerLike, lp: ChoiceLike) -> tuple[int, ...]:
    """The storage slots the layer saves through the hooks under ``lp`` (its selective ones when
    the plan runs its candidates selectively)."""
    sel = _selective(layer, lp)
    return layer.slot_bytes if sel is None else sel.slot_bytes


def copied_slots(layer: LayerLike, lp: ChoiceLike) -> list[int]:
    """The sizes of the slots an OFFLOAD layer copies: those whose largest tensor reaches the
    plan's floor (the engine's policy compares each tensor with it)."""
    sel = _selective(layer, lp)
    source = layer if sel is None else sel
    return [s for s, k in zip(source.slot_bytes, slot_keys(source)) if k >= lp.min_offload_bytes]


def all_slots(source: Slots) -> list[Slot]:
    """Every slot ``source`` (a layer profile, or its selective one) saves, above the engine's
    size floor or under it (``small_slots``), as ``(bytes, largest tensor's bytes, (a, b))``."""
    growth = source.slot_growth or (_LINEAR,) * len(source.slot_bytes)
    return [*zip(source.slot_bytes, slot_keys(source), growth),
            *((n, k, (a, b)) for n, k, a, b in source.small_slots)]


def copied_at(layer: LayerLike, lp: ChoiceLike, shape: tuple[int, int], at: tuple[int, int], floor: int) -> int:
    """Bytes an OFFLOAD layer of a plan made at shape ``at`` copies in a step of ``shape`` (both
    ``(batch, length)``): its slots (selective ones when the plan says) grown to ``shape`` each
    by its own exponents, those whose largest tensor reaches ``floor`` (the size floor the
    engine applies in that step: the plan's scaled to it, or the policy's)."""
    sel = _selective(layer, lp)
    slots = grown(all_slots(layer if sel is None else sel), StepShape(*shape), StepShape(*at))
    return sum(n for n, k, _ in slots if k >= floor)


def cached_bytes(layer: LayerLike, lp: ChoiceLike) -> int:
    """Bytes held outside the hooks (selective caches, or the attention outputs a recompute
    keeps) from the layer's forward to its backward."""
    if lp.action is Action.RECOMPUTE:
        return layer.attention_bytes if lp.keep_attention else 0
    sel = _selective(layer, lp)
    return layer.cached_bytes if sel is None else sel.cached_bytes


def offloaded_bytes(layer: LayerLike, lp: ChoiceLike) -> int:
    """Bytes the layer copies to host (and back): its offloaded slots, or its inputs (none when
    a recompute keeps them on the GPU)."""
    if lp.action is Action.OFFLOAD:
        return sum(copied_slots(layer, lp))
    if lp.action is Action.RECOMPUTE:
        return 0 if lp.keep_inputs else layer.input_bytes
    return 0


def held_bytes(layer: LayerLike, lp: ChoiceLike) -> int:
    """GPU bytes the layer holds from the end of its forward until its group is released (its
    selective-recompute caches and kept attention outputs, which are never offloaded, included)."""
    saved = layer.input_bytes if lp.action is Action.RECOMPUTE else sum(layer_slots(layer, lp))
    return saved + cached_bytes(layer, lp)


def resident_bytes(layer: LayerLike, lp: ChoiceLike) -> int:
    """GPU bytes the layer holds after its release, until its reload (slots never offloaded)."""
    return held_bytes(layer, lp) - offloaded_bytes(layer, lp)


def transient_bytes(layer: LayerLike, lp: ChoiceLike, recompute_factor: float = 1.0) -> int:
    """Extra bytes during the layer's backward: its measured backward peak, and for a
    recompute the activations it rebuilds, scaled by the profile's measured
    ``recompute_factor``."""
    if lp.action is Action.RECOMPUTE:
        return int(recompute_factor * (layer.saved_bytes + layer.cached_bytes + layer.backward_peak_bytes))
    return layer.backward_peak_bytes


def forward_need_bytes(layer: LayerLike) -> int:
    """Bytes the layer's forward needs on top of what is held: its measured peak, at least
    what it saves."""
    return max(layer.saved_bytes + layer.cached_bytes, layer.forward_peak_bytes)


def backward_cost_ms(layer: LayerLike, lp: ChoiceLike, recompute_time_factor: float = 1.0) -> float:
    """Compute time of the layer's backward, recompute included (before any slowdown)."""
    if lp.action is Action.RECOMPUTE:
        skipped = layer.attention_forward_ms if lp.keep_attention else 0.0
        return layer.backward_ms + recompute_time_factor * max(0.0, layer.forward_ms - skipped)
    sel = _selective(layer, lp)
    return layer.backward_ms + (sel.extra_backward_ms if sel is not None else 0.0)
