"""What a step's entry holds against the plans' base (offload.planner.entry_base): the drift that
plans again, the profile it rebases, and, with a reading of the test's own (the CPU has no
allocator), a context that plans every bucket again when its entry holds more than its plans'
base allowed for, with the plain gradients throughout."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import offload
from offload.planner import replan_steps
from offload.planner.entry_base import base_drift, grads_held, held_at_entry, rebased
from offload.planner.search import PEAK_MODEL_ERROR
from _util import assert_bitwise, make_mlp_layers, oa_step, train_step


def test_the_drift_counts_past_the_models_error_only() -> None:
    budget = 1000
    assert base_drift(100, 100 + int(PEAK_MODEL_ERROR * budget), budget) == 0  # within what the model errs by
    assert base_drift(100, 200, budget) == 100
    assert base_drift(200, 100, budget) == 0  # shrank: what a loop held once, it may hold again
    assert base_drift(100, 10**9, None) == 0  # no budget in bytes: nothing to overrun


def test_a_rebased_profile_holds_more_from_the_forwards_start(tiny_profile) -> None:
    grown = rebased(tiny_profile, 4096)
    assert grown.base_bytes == tiny_profile.base_bytes + 4096
    assert grown.plain_peak_bytes == tiny_profile.plain_peak_bytes + 4096
    assert grown.layers == tiny_profile.layers and grown.head_bytes == tiny_profile.head_bytes
    assert rebased(tiny_profile, 0) is tiny_profile and rebased(tiny_profile, -5) is tiny_profile
    # A reading that held the layers' gradients has them in the base: the backward makes none.
    with_grads = dataclasses.replace(tiny_profile, layers=tuple(dataclasses.replace(l, grad_bytes=512) for l in tiny_profile.layers))
    held = rebased(with_grads, 4096, grads_in_base=True)
    assert [l.grad_bytes for l in held.layers] == [0] * len(held.layers) and held.base_bytes == with_grads.base_bytes + 4096
    assert [l.grad_bytes for l in rebased(with_grads, 4096).layers] == [512] * len(held.layers)


def test_the_host_has_no_allocator_to_read() -> None:
    layers = make_mlp_layers(2, width=8)
    assert held_at_entry(torch.device("cpu")) == 0 and not grads_held(layers)
    train_step(layers, torch.randn(2, 8))
    assert grads_held(layers)  # (train_step leaves the gradients set)


@pytest.fixture
def tiny_profile() -> offload.planner.StepProfile:
    layers = make_mlp_layers(2, width=16)
    x = torch.randn(4, 16)
    return offload.planner.profile_step(layers, lambda: train_step(layers, x), device="cpu")


def test_an_entry_holding_more_plans_every_bucket_again(monkeypatch: pytest.MonkeyPatch) -> None:
    reading = [0]
    monkeypatch.setattr(replan_steps, "held_at_entry", lambda device: reading[0])
    torch.manual_seed(0)
    layers = make_mlp_layers(4, width=64)
    x = torch.randn(8, 64)
    expected = train_step(layers, x)
    assert_bitwise(expected, train_step(layers, x))
    sizing = offload.OffloadActivations(layers, device="cpu", min_offload_bytes=0, memory_budget_bytes="lowest")
    for _ in range(4):
        oa_step(layers, x, sizing)
    plain_peak, lowest = sizing.plan.profile.plain_peak_bytes, sizing.plan.prediction.peak_bytes
    sizing.close()
    budget = (plain_peak + 3 * lowest) // 4
    oa = offload.OffloadActivations(layers, device="cpu", min_offload_bytes=0, memory_budget_bytes=budget)
    for _ in range(4):
        assert_bitwise(expected, oa_step(layers, x, oa))
    first = oa.plan
    base = first.profile.base_bytes
    reading[0] += int(PEAK_MODEL_ERROR * budget) // 2  # within the model's error: nothing happens
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_bitwise(expected, oa_step(layers, x, oa))
    assert oa.plan is first
    grown = max(int(0.3 * (budget - lowest)), int(PEAK_MODEL_ERROR * budget) + 1)
    reading[0] = grown  # e.g. AdamW's state, made after the plans were
    with pytest.warns(UserWarning, match="planned again: the memory held at the forward's entry grew"):
        assert_bitwise(expected, oa_step(layers, x, oa))
    for _ in range(2):
        assert_bitwise(expected, oa_step(layers, x, oa))
    assert oa.plan is not first and oa.plan.profile.base_bytes == base + grown
    assert oa.plan.prediction.peak_bytes <= budget
    assert "grew by" in oa.plan.budget_reason
    oa.close()
