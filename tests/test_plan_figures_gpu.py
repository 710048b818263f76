"""The plan report's measured peak on a CUDA GPU (issue 48, section 4): it is the step's own
``torch.cuda.max_memory_allocated()``, whether or not the loop resets the counter itself before
each step (before the fix it read the gap between the loop's reset and the context's entry: the
weights)."""

from __future__ import annotations

import pytest
import torch

import offload

from _util import make_gpt_layers, oa_step

pytestmark = pytest.mark.cuda

HIDDEN, HEADS = 512, 8


@pytest.mark.parametrize("loop_resets", [False, True])
def test_plan_report_measures_the_steps_own_peak(loop_resets: bool) -> None:
    layers = make_gpt_layers(6, HIDDEN, HEADS, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 1024, HIDDEN, device="cuda", dtype=torch.bfloat16)
    oa = offload.OffloadActivations(layers, memory_budget_bytes="lowest", measure_peak=True)
    peak = 0
    for _ in range(6):  # the probe steps, then planned ones
        torch.cuda.synchronize()
        if loop_resets:
            torch.cuda.reset_peak_memory_stats()  # the loop's own, before each step
        oa_step(layers, x, oa)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()  # the loop's reading of the step
    assert oa.plan is not None
    # oa.measured is the last whole step's (entry to the next entry): the next entry closes it.
    if loop_resets:
        torch.cuda.reset_peak_memory_stats()
    oa_step(layers, x, oa)
    measured = oa.measured["peak_bytes"]
    assert abs(measured - peak) <= 0.01 * peak, (
        f"the plan report measured a peak of {measured} bytes; torch.cuda.max_memory_allocated "
        f"read {peak} over the same step")
