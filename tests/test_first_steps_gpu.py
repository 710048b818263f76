"""The first steps on a CUDA GPU (issue 50 s1): where the plain step fits, the auto probe runs the
sizing step and the measured plain step only (the sizing step calibrated the recompute), the
allocator grown to the plain peak before the measured step; the recompute factors it gives stay
within their bounds and a recompute plan's peak is still predicted within 10%; every step, probe
steps included, gives the plain gradients bit for bit; and ``first_steps`` accounts for each.

    python -m pytest -q tests/test_first_steps_gpu.py
"""

from __future__ import annotations

import contextlib
import copy
import gc
import warnings

from typing import Optional

import pytest
import torch

import offload
from offload.planner.first_steps import PHASES
from offload.models import run_layers
from _util import assert_bitwise, make_gpt_layers, oa_step, peak_of, recompute_plan_peak, train_step

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


def test_the_measured_plain_steps_peak_is_the_probes_own_reading() -> None:
    # The probe resets the device's peak counter layer by layer, so a loop reading it after the
    # step sees only the last layers' stretch; ``first_steps`` has the whole step's (what the
    # benchmarks report for probe steps, step_records.with_probe_peaks).
    clean_device()
    layers, x = setup()
    plain = peak_of(lambda: train_step(layers, x))[1]
    oa = offload.OffloadActivations(layers, memory_budget_bytes="device")
    counter = [peak_of(lambda: oa_step(layers, x, oa))[1] for _ in range(3)]
    rows = oa.first_steps
    assert [r["kind"] for r in rows[:2]] == ["size", "measure"], rows
    assert rows[1]["peak_bytes"] >= 0.95 * plain > counter[1], (rows[1]["peak_bytes"], plain, counter)
    assert rows[2]["peak_bytes"] is None  # planned steps: the plan report's measured peak
    oa.close()


def test_a_byte_budget_below_the_plain_peak_binds_the_probe_steps_too() -> None:
    # The GPU has room for the plain step, the budget the user set does not: the sizing step is
    # the measured one, no step (probe steps included, by their own reading) goes over the
    # budget, and the allocator is not grown to the plain peak (it stayed reserved for the whole
    # run: T22 held 82.8 GB reserved under a 24 GiB budget).
    clean_device()
    layers, x = setup()
    expected = train_step(layers, x)
    assert_bitwise(expected, train_step(layers, x))
    base = torch.cuda.memory_allocated()
    plain = peak_of(lambda: train_step(layers, x))[1]
    budget = base + (plain - base) * 6 // 10
    clean_device()
    oa = offload.OffloadActivations(layers, memory_budget_bytes=budget)
    grown = []
    seq = oa._planned._sequence
    seq._grow_allocator = lambda: grown.append(1)  # (where the plain probe runs, it grows the pool first)
    counter = []
    for _ in range(5):
        got, peak = peak_of(lambda: oa_step(layers, x, oa))
        assert_bitwise(expected, got)
        counter.append(peak)
    rows = oa.first_steps
    assert rows[0]["kind"] == "size" and "measure" not in [r["kind"] for r in rows], rows
    assert "more than the memory budget's" in oa.plan.profile.probe_reason, oa.plan.profile.probe_reason
    for i, peak in enumerate(counter):
        own = rows[i]["peak_bytes"] if i < len(rows) and rows[i]["peak_bytes"] is not None else 0
        assert max(peak, own) <= budget * 1.02, (i, peak, own, budget, oa.plan.describe())
    assert not grown  # the allocator was not grown to the plain peak
    oa.close()
    made = offload.plan(layers, lambda: train_step(layers, x), memory_budget_bytes=budget)  # the same from plan()
    assert made.profile.probe == "recompute" and made.prediction.peak_bytes <= budget, made.profile.probe_reason


def adamw_loop(model: torch.nn.ModuleList, x: torch.Tensor, oa: object = None, check: Optional[list] = None,
               *, micro: int = 1, steps: int = 5) -> tuple[list, list]:
    """``steps`` AdamW steps of ``micro`` micro-batches each, ``oa`` around each forward: each
    step's gradients (``check``: compared with these at once, and none kept, since they would grow
    every step's base) and each micro-batch's peak."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    grads, peaks = [], []
    for step in range(steps):
        for _ in range(micro):
            xin = x.detach().requires_grad_(True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            with oa if oa is not None else contextlib.nullcontext():
                out = run_layers(model, xin)
            (out.float() ** 2).mean().backward()
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
            del out
        got = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if check is not None:
            assert_bitwise(check[step], got)
        else:
            grads.append(got)
        del got
    return grads, peaks


def adamw_case(micro: int) -> tuple[torch.nn.ModuleList, torch.Tensor, list, int, int, int]:
    """Layers, their input, the plain AdamW loop's gradients (the loop checked to repeat itself),
    the memory held before it, AdamW's state, and a budget with room for that state and 60% of the
    plain step's activations (below the plain peak: the sizing step is the measured one)."""
    clean_device()
    layers, x = setup()
    expected, _ = adamw_loop(copy.deepcopy(layers), x, micro=micro)
    adamw_loop(copy.deepcopy(layers), x, check=expected, micro=micro)
    clean_device()
    base = torch.cuda.memory_allocated()
    plain = peak_of(lambda: train_step(layers, x))[1]
    for p in layers.parameters():
        p.grad = None
    state = 2 * sum(p.nbytes for p in layers.parameters())  # AdamW's two moments
    return layers, x, expected, base, state, base + state + (plain - base) * 6 // 10


def test_plans_count_the_optimizer_state_that_the_measured_steps_end_made() -> None:
    # The sizing step is the process's first and the measured one; AdamW makes its state at that
    # step's end, and every later step holds it. The plans count it in their base (made at the
    # next entry), so each planned step stays within the budget, bit for bit.
    layers, x, expected, base, state, budget = adamw_case(micro=1)
    oa = offload.OffloadActivations(layers, memory_budget_bytes=budget)
    _, peaks = adamw_loop(layers, x, oa, check=expected)
    assert oa.first_steps[0]["kind"] == "size" and oa.plan.profile.probe == "recompute"
    assert oa.plan.profile.base_bytes >= base + state, (oa.plan.profile.base_bytes, base, state)
    for step, peak in enumerate(peaks[1:], 1):
        assert peak <= budget * 1.02, (step, peak, budget, oa.plan.describe())
    oa.close()


def test_under_gradient_accumulation_the_plans_follow_the_optimizer_state_made_later() -> None:
    # Two micro-batches a step: AdamW makes its state after the second, after the measured step
    # and the profile's making both. The next entry holds it: every bucket is planned again on
    # the grown base (a warning says so), and no planned step goes over the budget, bit for bit.
    layers, x, expected, base, state, budget = adamw_case(micro=2)
    oa = offload.OffloadActivations(layers, memory_budget_bytes=budget)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, peaks = adamw_loop(layers, x, oa, check=expected, micro=2, steps=4)
    for i, peak in enumerate(peaks[1:], 1):
        assert peak <= budget * 1.02, (i, peak, budget, oa.plan.describe())
    assert oa.plan.profile.base_bytes >= base + state, (oa.plan.profile.base_bytes, base, state)
    assert any("planned again: the memory held at the forward's entry grew" in str(w.message) for w in caught)
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
