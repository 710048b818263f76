"""The recompute's factors from a calibration reading taken at another shape (issue 50).

The low-memory sizing step runs a stream's first batch, the measured plain step its second: at
another length. Its calibration layer's backward with recompute must be brought to the measured
shape before it is set against that layer's plain figures, or every recompute of the plan is
charged for the difference in length (on the H200: 1.5x its forward, the bound, at 8192 tokens
against 6144, where 1.0x was right).
"""

from __future__ import annotations

import pytest

from offload.planner.calibration import RecomputeReading, recompute_factors
from offload.planner.shapes import StepShape
from offload.planner.types import LayerProfile

MiB = 1 << 20


def layer(scale: float) -> LayerProfile:
    """A layer measured at ``scale`` x 6144 tokens: forward 8 ms, plain backward 18.5 ms, 100 MiB
    saved and a 40 MiB backward peak at scale 1, all linear in tokens."""
    return LayerProfile((int(100 * MiB * scale),), 0, 8.0 * scale, 18.5 * scale, "layer",
                        backward_peak_bytes=int(40 * MiB * scale))


def reading(scale: float, *, time_factor: float, memory_factor: float, shape: StepShape) -> RecomputeReading:
    """What the calibration layer of ``layer(scale)`` measures with its recompute inside."""
    ref = layer(scale)
    additive = ref.saved_bytes + ref.cached_bytes + ref.backward_peak_bytes
    return RecomputeReading(8, int(memory_factor * additive), ref.backward_ms + time_factor * ref.forward_ms,
                            ref.forward_ms, ref.saved_bytes + ref.cached_bytes, shape)


MEASURED = StepShape(4, 6144)
SIZING = StepShape(4, 8192)


def test_a_reading_at_the_measured_shape_is_taken_as_it_is() -> None:
    got = recompute_factors(layer(1.0), reading(1.0, time_factor=1.1, memory_factor=0.9, shape=MEASURED), MEASURED)
    assert got == pytest.approx((0.9, 1.1), rel=1e-6)


def test_a_reading_at_another_shape_is_brought_to_the_measured_one() -> None:
    # The sizing step at 8192 tokens, the measured one at 6144: the layer's factors are 1.0 and
    # 1.05 at either; read raw they came out at the bounds (the old figures, 1.5 and 1.33).
    at_sizing = reading(8192 / 6144, time_factor=1.05, memory_factor=1.0, shape=SIZING)
    got = recompute_factors(layer(1.0), at_sizing, MEASURED)
    assert got == pytest.approx((1.0, 1.05), rel=1e-3)
    raw = recompute_factors(layer(1.0), at_sizing._replace(shape=None), MEASURED)
    assert raw[1] == 1.5 and raw[0] == pytest.approx(8192 / 6144, rel=1e-3)


def test_the_factors_stay_within_their_bounds() -> None:
    assert recompute_factors(layer(1.0), reading(1.0, time_factor=9.0, memory_factor=9.0, shape=MEASURED),
                             MEASURED) == (1.5, 1.5)
    assert recompute_factors(layer(1.0), reading(1.0, time_factor=0.0, memory_factor=0.1, shape=MEASURED),
                             MEASURED) == (0.5, 0.3)


def test_a_reading_without_its_own_figures_is_not_scaled() -> None:
    # No forward ms or saved bytes in the reading's step (a layer it could not time): as read.
    bare = RecomputeReading(8, int(140 * MiB), 18.5 + 8.0 * 1.2, 0.0, 0, SIZING)
    assert recompute_factors(layer(1.0), bare, MEASURED) == pytest.approx((1.0, 1.2), rel=1e-6)


def test_a_reading_of_eager_attention_at_a_shorter_shape_is_not_understated() -> None:
    # Scores (1, 2) beside activations (1, 1): the recomputed backward's peak is mostly
    # score-sized temporaries (2.96x the saved scores less half the activations, as measured on
    # the H200), so from a reading at half the length it grows faster than the saved bytes.
    # Brought up by the saved bytes' ratio, a true factor of 1.0 read 0.79 (the plan's recomputes
    # charged 21% less memory than they take); brought up as a transient peak, not below 1.
    lin, quad = 100 * MiB, 200 * MiB  # at 1 x 4096

    def backward_peak(lin_bytes: float, quad_bytes: float) -> int:
        return int(2.96 * quad_bytes - 0.5 * lin_bytes)

    ref = LayerProfile((lin, quad), 0, 8.0, 18.5, "layer", backward_peak_bytes=backward_peak(lin, quad),
                       slot_growth=((1, 1), (1, 2)))
    short_lin, short_quad = lin / 2, quad / 4  # at 1 x 2048
    true_peak = short_lin + short_quad + backward_peak(short_lin, short_quad)  # factor 1.0 there
    at_half = RecomputeReading(0, int(true_peak), 9.25 + 4.0, 4.0, int(short_lin + short_quad), StepShape(1, 2048))
    factor, _ = recompute_factors(ref, at_half, StepShape(1, 4096))
    assert 1.0 <= factor <= 1.5, factor
