"""The one-line default on a CUDA GPU (issue 33, items 6 and 8): ``OffloadActivations(layers)``
plans for ``memory_budget_bytes="device"`` after its probe steps, with gradients bitwise those of
the plain run and measured peaks in the plan table; an explicit count keeps the fixed schedule.

Bitwise comparisons use the efficient/math SDPA backends (``repeatable_attention``), never flash.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import offload

from _util import assert_bitwise, make_gpt_layers, oa_step, plain_reference, wait_ready

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("repeatable_attention")]

HIDDEN, HEADS, LAYERS = 256, 4, 6


def gpt() -> nn.ModuleList:
    return make_gpt_layers(LAYERS, HIDDEN, HEADS, device="cuda", dtype=torch.bfloat16)


def tokens(seq: int = 512, batch: int = 2) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(1)
    return torch.randn(batch, seq, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)


def clean_device() -> None:
    """The probe reads the allocator: leftovers of earlier tests freed mid-probe skew it."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def test_the_default_plans_for_what_the_gpu_gives_with_bitwise_gradients() -> None:
    clean_device()
    layers, x = gpt(), tokens()
    expected = plain_reference(layers, x)
    oa = offload.OffloadActivations(layers)
    assert oa.budget == "device" and "the default on CUDA" in repr(oa)
    assert oa.measure_peak is True  # planned steps on CUDA measure their peak by default
    for step in range(6):  # probe steps (at most three), then planned steps
        if step == 5:
            wait_ready(oa)  # the first plan's own, made in the searches' process (these steps outrun its start)
        assert_bitwise(expected, oa_step(layers, x, oa))
    assert oa.plan is not None, oa.plan_report()
    assert oa.plan.budget_bytes is not None and oa.plan.prediction.peak_bytes <= oa.plan.budget_bytes
    assert "budget: device (" in oa.plan_report()
    assert oa.stats["mode"] == "planned"
    measured = oa.measured
    assert measured is not None and measured["peak_bytes"] is not None and measured["peak_bytes"] > 0, measured
    oa.close()


def test_measure_peak_false_leaves_the_peak_out() -> None:
    clean_device()
    layers, x = gpt(), tokens()
    oa = offload.OffloadActivations(layers, measure_peak=False)
    assert oa.budget == "device" and oa.measure_peak is False
    for _ in range(6):
        oa_step(layers, x, oa)
    assert oa.plan is not None and oa.measured is not None and oa.measured["peak_bytes"] is None
    oa.close()


def test_an_explicit_count_keeps_the_fixed_schedule_on_cuda() -> None:
    layers, x = gpt(), tokens()
    expected = plain_reference(layers, x)
    oa = offload.OffloadActivations(layers, num_offload_layers=LAYERS - 1, group_bytes=0)  # a group per layer
    assert oa.budget is None and oa.measure_peak is False
    for _ in range(2):
        assert_bitwise(expected, oa_step(layers, x, oa))
    stats = oa.stats
    assert stats["mode"] == "v2" and stats["groups_offloaded"] == LAYERS - 1 and stats["offloaded_bytes"] > 0, stats
    oa.close()


def test_the_default_on_device_cpu_stays_fixed_on_a_gpu_machine() -> None:
    oa = offload.OffloadActivations(make_gpt_layers(4), device="cpu")
    assert oa.budget is None and repr(oa).endswith("offloading 3 of them)")
