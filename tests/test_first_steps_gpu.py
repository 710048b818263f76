"""The first steps on a CUDA GPU (issue 50 s1): where the plain step fits, the auto probe runs the
sizing step and the measured plain step only (the sizing step calibrated the recompute), the
allocator grown to the plain peak before the measured step; the recompute factors it gives stay
within their bounds and a recompute plan's peak is still predicted within 10%; every step, probe
steps included, gives the plain gradients bit for bit; and ``first_steps`` accounts for each.

    python -m pytest -q tests/test_first_steps_gpu.py
"""

from __future__ import annotations

import gc

import pytest
import torch

import offload
from offload.planner.first_steps import PHASES
from _util import assert_bitwise, make_gpt_layers, oa_step, recompute_plan_peak, train_step

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("repeatable_attention")]

HIDDEN, HEADS = 256, 4


def clean_device() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def setup(n: int = 6, seq: int = 1024) -> tuple[torch.nn.ModuleList, torch.Tensor]:
    layers = make_gpt_layers(n, HIDDEN, HEADS, device="cuda", dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(1)
    return layers, torch.randn(2, seq, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)


def test_two_probe_steps_where_the_plain_step_fits_bit_for_bit() -> None:
    clean_device()
    layers, x = setup()
    expected = train_step(layers, x)
    assert_bitwise(expected, train_step(layers, x))
    oa = offload.OffloadActivations(layers, memory_budget_bytes="device")
    for _ in range(5):
        assert_bitwise(expected, oa_step(layers, x, oa))
    rows = oa.first_steps
    # The first planned step follows a stand-in while its plan is made in the background.
    assert [r["kind"] for r in rows[:3]] == ["size", "measure", "stand-in"], rows
    assert rows[3]["kind"] in ("stand-in", "planned"), rows
    profile = oa.plan.profile
    assert profile.probe == "plain"
    # Calibrated by the sizing step's middle layer, within the bounds a calibration step has.
    assert 0.5 <= profile.recompute_factor <= 1.5 and 0.3 <= profile.recompute_time_factor <= 1.5
    for r in rows[:3]:
        assert 0 <= sum(r[f"{p}_s"] for p in PHASES) <= r["wall_s"], r
    assert rows[0]["device_s"] > 0 and rows[1]["device_s"] > 0
    assert rows[2]["search_s"] == 0 and rows[1]["link_s"] > 0  # no search on the step's thread; the link measured
    assert rows[1]["allocator_s"] > 0  # grown before the measured step
    assert "first steps" in oa.report()
    oa.close()


def test_the_measured_step_finds_the_allocator_grown() -> None:
    clean_device()
    layers, x = setup()
    oa = offload.OffloadActivations(layers, memory_budget_bytes="device")
    seq = oa._planned._sequence
    seen = []
    real = seq._grow_allocator

    def grown() -> None:
        real()
        seen.append((torch.cuda.memory_reserved(), seq.sizing.plain_peak_bytes))

    seq._grow_allocator = grown
    oa_step(layers, x, oa)  # the sizing step (closed at the next step's entry)
    oa_step(layers, x, oa)  # the measured step: the allocator grown at its entry
    ((reserved, peak),) = seen
    assert reserved >= peak, (reserved, peak)
    oa.close()


def test_recompute_plan_peak_is_still_predicted_within_ten_percent() -> None:
    # As tests/test_planner_gpu.py checks it with a calibration step: here the sizing step's
    # middle layer calibrated the recompute.
    clean_device()
    layers, x = setup(seq=1024)
    measured, predicted, described = recompute_plan_peak(layers, x)
    assert abs(measured - predicted) <= 0.10 * predicted, (measured, predicted, described)


def test_the_link_is_measured_on_one_pinned_block() -> None:
    # The measured step's link figures, from a block pinned as the arena pins (its halves the
    # two host ends): each way and both at once, in the range a PCIe or NVLink-C2C host link has.
    from offload.planner.link import measure_link

    clean_device()
    link = measure_link(torch.device("cuda"))
    assert 1.0 < link.d2h_gbps < 1000 and 1.0 < link.h2d_gbps < 1000 and 1.0 < link.duplex_gbps < 2000, link
