"""The recompute's memory and time factors of a plain profile, from one layer measured with its
recompute inside (a calibration step, or the low-memory sizing step; :mod:`offload.planner.sequence`)."""

from __future__ import annotations

from typing import NamedTuple, Optional

from .layer_costs import all_slots
from .shapes import StepShape, grown, transient_at
from .types import LayerProfile

__all__ = ["RecomputeReading", "recompute_factors"]


class RecomputeReading(NamedTuple):
    """One layer's backward with its recompute inside, measured in a probe step (a calibration
    step, or the low-memory sizing step): the layer's index, that backward's peak bytes and ms,
    and, from the same step, the layer's forward ms, the bytes its recompute re-creates (its
    saved slots and caches) and the step's shape."""

    index: int
    peak_bytes: int
    backward_ms: float
    forward_ms: float = 0.0
    saved_bytes: int = 0
    shape: Optional[StepShape] = None


def recompute_factors(ref: LayerProfile, reading: RecomputeReading, shape: Optional[StepShape]) -> tuple[float, float]:
    """The recompute's memory and time factors of a plain profile whose calibration layer
    measured ``ref`` at ``shape``, from ``reading`` (see :class:`RecomputeReading`).

    The reading may come from a step of another shape: the low-memory sizing step runs the
    first batch, the measured plain step the second (a stream's lengths differ). Its bytes and
    ms are then brought to ``shape`` before they are set against ``ref``: its peak as any
    transient peak is (:func:`offload.planner.shapes.transient_at`: as the layer's saved bytes
    grew between the two steps, or, for eager attention, faster), its ms by the layer's own
    ratio of forward ms between the two steps. Read raw, a sizing step at 8192
    tokens against a measured one at 6144 made every recompute look 1.5x its forward (the
    bound) on the H200, and plans avoided recomputes that cost a third less. Bounded: one
    layer speaks for all, and a noisy reading must not make recompute look free or ruinous."""
    peak, backward = float(reading.peak_bytes), reading.backward_ms
    if reading.shape is not None and shape is not None and reading.shape != shape:
        if reading.saved_bytes > 0:
            # The recompute re-creates the saved bytes, and its backward frees them; they were
            # measured in both steps.
            there = grown(all_slots(ref), reading.shape, shape)
            peak = transient_at(int(peak), there, [(n, g) for n, _, g in there], shape, reading.shape,
                                grew=(ref.saved_bytes + ref.cached_bytes) / reading.saved_bytes)
        if reading.forward_ms > 0:
            backward *= ref.forward_ms / reading.forward_ms
    factor = time_factor = 1.0
    additive = ref.saved_bytes + ref.cached_bytes + ref.backward_peak_bytes
    if additive > 0:
        factor = min(1.5, max(0.5, peak / additive))
    if ref.forward_ms > 0 and backward > 0:
        time_factor = min(1.5, max(0.3, (backward - ref.backward_ms) / ref.forward_ms))
    return factor, time_factor
