"""A probe step's layer times without the process's warm-up (``offload.planner.warm_up``): the
first-run layer of each kind, forward and backward, is compared with the other layers of its kind."""

from __future__ import annotations

from dataclasses import replace

from offload.planner.types import LayerProfile, LinkProfile, SelectiveProfile, StepProfile
from offload.planner.warm_up import WARM_UP_SPREAD, without_warm_up

MB = 1 << 20


def layer(fwd: float, bwd: float, kind: str = "block", attention: float = 0.0) -> LayerProfile:
    return LayerProfile((4 * MB, MB), MB, fwd, bwd, kind, attention_forward_ms=attention, attention_backward_ms=attention)


def profile(layers: list[LayerProfile]) -> StepProfile:
    return StepProfile(tuple(layers), LinkProfile(10.0, 10.0, 15.0), 100 * MB, 2 * MB, 1.0, 5.0, 2.0, 100.0, 200 * MB,
                       "cuda")


def test_the_first_forward_and_the_first_backward_of_a_kind_lose_their_warm_up() -> None:
    # Layer 0 runs forward first (kernels loaded, algorithms chosen there), layer 3 backward first.
    layers = [layer(90.0, 20.0, attention=50.0), layer(10.0, 20.0, attention=4.0), layer(11.0, 21.0, attention=5.0),
              layer(12.0, 70.0, attention=6.0)]
    steady, changed = without_warm_up(profile(layers))
    assert changed == [0, 3]
    # The median of the others, all its times of that direction (the attention's with it).
    assert (steady.layers[0].forward_ms, steady.layers[0].attention_forward_ms) == (11.0, 5.0)
    assert steady.layers[0].backward_ms == 20.0  # its backward was not an outlier
    assert (steady.layers[3].backward_ms, steady.layers[3].attention_backward_ms) == (20.0, 4.0)
    assert steady.layers[3].forward_ms == 12.0
    assert steady.layers[1:3] == tuple(layers[1:3])


def test_a_cold_forwards_selective_times_are_replaced_with_it() -> None:
    def selective(fwd: float, extra: float) -> SelectiveProfile:
        return SelectiveProfile((MB,), 2 * MB, extra, forward_ms=fwd)

    layers = [replace(layer(90.0, 20.0), selective=selective(60.0, 30.0))] + \
        [replace(layer(10.0 + i, 20.0), selective=selective(6.0 + i, 3.0 + i)) for i in range(3)]
    steady, changed = without_warm_up(profile(layers))
    assert changed == [0]
    assert steady.layers[0].selective == selective(7.0, 4.0)  # the median layer's (index 2)
    assert steady.layers[0].selective.slot_bytes == layers[0].selective.slot_bytes  # its sizes stay its own


def test_times_within_the_spread_of_the_slowest_other_stay_as_measured() -> None:
    # Layers alike that differ by design (a slow global attention every other layer): the first
    # is not slower than every other by half, so nothing is changed.
    layers = [layer(40.0, 20.0), layer(30.0, 60.0), layer(10.0, 20.0), layer(30.0, 60.0)]
    assert layers[0].forward_ms <= WARM_UP_SPREAD * 30.0
    same, changed = without_warm_up(profile(layers))
    assert changed == [] and same.layers == tuple(layers)


def test_kinds_are_compared_within_themselves_and_need_three_layers() -> None:
    # Two kinds: "a" (three layers) has a warm-up outlier; "b" (two layers) has too few to tell.
    layers = [layer(90.0, 20.0, "a"), layer(50.0, 20.0, "b"), layer(10.0, 20.0, "a"), layer(10.0, 90.0, "b"),
              layer(10.0, 20.0, "a")]
    steady, changed = without_warm_up(profile(layers))
    assert changed == [0]
    assert steady.layers[0].forward_ms == 10.0
    assert steady.layers[1] == layers[1] and steady.layers[3] == layers[3]


def test_a_profile_without_outliers_is_returned_as_is() -> None:
    p = profile([layer(10.0, 20.0)] * 4)
    same, changed = without_warm_up(p)
    assert same is p and changed == []
    slow_everywhere = profile([replace(l, forward_ms=100.0) for l in p.layers])
    assert without_warm_up(slow_everywhere) == (slow_everywhere, [])
