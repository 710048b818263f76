"""``memory_budget_bytes="device"`` without a GPU: the budget worked out from injected figures,
the plan made for it and its report, and the refusals and warnings at the call."""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace

import pytest
import torch

import offload
from offload.planner.budget import default_headroom
from offload.planner import DEVICE_HEADROOM, LayerProfile, LinkProfile, StepProfile, device_budget
from offload.planner import make as make_mod
from offload.planner.make import check_device_budget, choose

from _util import make_gpt_layers, train_step

GiB = 1 << 30
MiB = 1 << 20
CUDA0 = torch.device("cuda", 0)


def llama_like(n: int = 8) -> StepProfile:
    """LLAMA-1B-like figures (see test_plan_model.llama_1b): 1.5 GiB saved a layer, 4 GiB base."""
    slots = (256 * MiB,) * 4 + (64 * MiB,) * 8 + (16 * MiB,) * 2
    layer = LayerProfile(slots, 64 * MiB, 6.0, 12.0, "llama-1b-layer")
    saved = layer.saved_bytes * n
    return StepProfile((layer,) * n, LinkProfile(54.0, 54.0, 86.6), 4 * GiB, 3 * GiB, 3.0, 12.0, 2.0,
                       3.0 + 12.0 + 2.0 + 18.0 * n, 7 * GiB + saved, "cuda")


def test_device_budget_counts_what_this_process_holds_as_inside_the_budget():
    # 80 GiB device; this process reserves 10 GiB (weights etc.), others hold 6 GiB, 64 GiB free.
    got = device_budget(80 * GiB, 64 * GiB, 10 * GiB)
    assert got.capacity_bytes == 80 * GiB and got.held_by_others_bytes == 6 * GiB
    assert got.headroom == DEVICE_HEADROOM == 0.15
    assert got.budget_bytes == int(74 * GiB * 0.85)
    assert got.describe() == "device (80.0 GiB capacity - 6.0 GiB held by others - 15% headroom = 62.9 GiB)"
    assert device_budget(80 * GiB, 64 * GiB, 10 * GiB, headroom=0.0).budget_bytes == 74 * GiB


def test_expandable_segments_need_less_headroom(monkeypatch):
    assert default_headroom("") == DEVICE_HEADROOM
    assert default_headroom("max_split_size_mb:128,expandable_segments:True") == 0.05
    assert default_headroom("expandable_segments:False") == DEVICE_HEADROOM
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert device_budget(80 * GiB, 64 * GiB, 10 * GiB).budget_bytes == int(74 * GiB * 0.95)


def test_a_small_cap_keeps_a_headroom_of_at_least_256_mib():
    # 5% of 1.3 GiB is less than what the allocator keeps reserved anyway (measured: 95 MiB).
    got = device_budget(80 * GiB, 64 * GiB, 10 * GiB, headroom=0.05, cap_bytes=1300 << 20)
    assert got.budget_bytes == (1300 - 256) << 20
    tiny = device_budget(80 * GiB, 64 * GiB, 10 * GiB, headroom=0.05, cap_bytes=400 << 20)
    assert tiny.budget_bytes == 300 << 20  # the floor takes at most a quarter


def test_a_per_process_cap_bounds_the_budget():
    got = device_budget(80 * GiB, 64 * GiB, 10 * GiB, headroom=0.0, cap_bytes=20 * GiB)
    assert got.budget_bytes == 20 * GiB and got.held_by_others_bytes == 6 * GiB
    assert "capped at 20.0 GiB for this process" in got.describe()


@pytest.mark.parametrize("figures, match", [
    ((80 * GiB, 75 * GiB, 10 * GiB), "exceed the capacity"),
    ((80 * GiB, -1, 0), "free_bytes must be an int"),
    ((80 * GiB, 0, 0), "nothing left"),
])
def test_device_budget_refuses_impossible_figures(figures, match):
    with pytest.raises(ValueError, match=match):
        device_budget(*figures)


def test_choose_device_plans_the_fastest_plan_under_the_resolved_budget(monkeypatch):
    profile = llama_like()
    # What this device gives: less than the plain step needs, more than the lowest plan.
    measured = device_budget(20 * GiB, 14 * GiB, 1 * GiB)
    monkeypatch.setattr(make_mod, "read_device_budget", lambda device, expandable=False, emptied=False: measured)
    made = choose(profile, "device", CUDA0)
    assert made.budget_bytes == measured.budget_bytes < profile.plain_peak_bytes
    assert made.prediction.peak_bytes <= measured.budget_bytes
    assert made == choose(profile, measured.budget_bytes)  # the same as that budget in bytes
    assert made.budget_reason == measured.describe()
    assert f"budget: {measured.describe()}" in made.table()


def test_choose_device_that_cannot_fit_names_the_lowest_peak(monkeypatch):
    monkeypatch.setattr(make_mod, "read_device_budget", lambda device, expandable=False, emptied=False: device_budget(8 * GiB, 7 * GiB, 0))
    with pytest.raises(offload.BudgetError, match=r"lowest peak reachable.*more GPUs"):
        choose(llama_like(), "device", CUDA0)


def test_device_on_cpu_is_refused_at_the_call():
    layers, x = make_gpt_layers(n=2), torch.randn(2, 8, 64)
    with pytest.raises(ValueError, match=r"plan\(\): memory_budget_bytes='device'.*'cpu'.*run on a GPU"):
        offload.plan(layers, lambda: train_step(layers, x), "device", device="cpu")
    with pytest.raises(ValueError, match=r"OffloadActivations: memory_budget_bytes='device'.*'cpu'"):
        offload.OffloadActivations(layers, memory_budget_bytes="device", device="cpu")


def test_other_budget_strings_still_refused():
    with pytest.raises(ValueError, match="'device' \\(what this GPU can give\\) or 'lowest'"):
        offload.OffloadActivations(make_gpt_layers(n=2), memory_budget_bytes="gpu", device="cpu")


def test_budget_above_the_device_capacity_warns_naming_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=80 * GiB))
    with pytest.warns(UserWarning, match=r"capacity of 80.0 GiB \(85899345920 bytes\)"):
        check_device_budget(100 * GiB, CUDA0, "plan():")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_device_budget(60 * GiB, CUDA0, "plan():")  # fits: no warning
        check_device_budget(100 * GiB, torch.device("cpu"), "plan():")  # no device to compare


def test_choose_reports_which_budget_and_why():
    profile = llama_like()
    assert choose(profile, "lowest").budget_reason.startswith("lowest")
    assert choose(profile, None).budget_reason.startswith("none given")
    assert choose(profile, 30 * GiB).budget_reason == "memory_budget_bytes"
    floor = offload.planner.lowest_peak(profile, tolerance=0.0).prediction.peak_bytes
    with pytest.warns(UserWarning, match="within the cost model's error"):
        near = choose(profile, floor - 1)
    assert "no plan fits it, the lowest plan is followed" in near.budget_reason
    assert dataclasses.replace(near, budget_reason="") == near  # not part of a plan's identity
