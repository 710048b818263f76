"""The planner's lowest layer: the per-layer actions a plan chooses from, and what a layer
profile's slots say. Nothing here imports the rest of the planner (``types``, ``model`` and
``table`` all build on it)."""

from __future__ import annotations

from enum import Enum
from typing import Any


class Action(str, Enum):
    """What a plan does with one layer's saved tensors."""

    KEEP = "keep"            # saved tensors stay on the GPU until the layer's backward
    OFFLOAD = "offload"      # copied to host (all, or slots >= a size), released, reloaded
    RECOMPUTE = "recompute"  # non-reentrant checkpoint: only the inputs are saved (and offloaded,
                             # unless the LayerPlan keeps them on the GPU: keep_inputs)


def slot_keys(profile: Any) -> tuple[int, ...]:
    """Per slot of a :class:`LayerProfile` or :class:`SelectiveProfile`, the largest tensor saved
    into it (the slot itself where the profile does not say)."""
    return profile.slot_keys or profile.slot_bytes
