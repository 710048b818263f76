"""The plan report's figures tell the truth (issue 48, section 4), on the CPU.

- The measured peak: a loop that resets CUDA's peak counter itself before each step (as
  benchmarks/step_records.py and many loggers do) must not leave the report with the gap before
  the context's entry (the weights: "measured 15.0 GiB (+399.4%)" for a step that peaked at
  74.95 GiB). CUDA's counter is stood in for by a scripted one (``torch.cuda``'s two functions
  patched), so the test runs without a GPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import offload
from offload.engine.step_peak import StepPeak
from offload.models import run_layers

from _util import make_gpt_layers

WEIGHTS = 1000             # what the counter reads between steps
ACTIVATIONS = 50_000       # what each layer adds while the forward runs (freed by the backward)
SPIKE = 30_000             # a workspace of the last layer's backward


class ScriptedCounter:
    """CUDA's peak counter, scripted: ``allocated`` moves as the test says, the peak follows it
    until reset (by anybody: the loop or the context)."""

    def __init__(self) -> None:
        self.allocated = WEIGHTS
        self.peak = WEIGHTS

    def set(self, allocated: int) -> None:
        self.allocated = allocated
        self.peak = max(self.peak, allocated)

    def max_memory_allocated(self, device: Any = None) -> int:
        return self.peak

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self.peak = self.allocated


@pytest.fixture
def counter(monkeypatch: pytest.MonkeyPatch) -> ScriptedCounter:
    scripted = ScriptedCounter()
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", scripted.max_memory_allocated)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", scripted.reset_peak_memory_stats)
    return scripted


def _planned_context(layers: torch.nn.ModuleList) -> offload.OffloadActivations:
    oa = offload.OffloadActivations(layers, memory_budget_bytes="lowest", device="cpu", min_offload_bytes=0)
    # The CPU has no peak counter: give the planned steps the (scripted) CUDA one, as on a GPU.
    oa._planned._peak = StepPeak("cuda")
    return oa


def test_measured_peak_survives_a_loop_that_resets_the_counter_before_each_step(counter) -> None:
    layers = make_gpt_layers(4)
    x = torch.randn(2, 16, 64)
    oa = _planned_context(layers)
    # Each layer's forward adds its activations; its backward gives them back.
    for layer in layers:
        layer.register_forward_hook(lambda *a: counter.set(counter.allocated + ACTIVATIONS))
        layer.register_full_backward_hook(lambda *a: counter.set(counter.allocated - ACTIVATIONS))
    # The step's peak comes in the backward: a workspace the last layer's backward takes and
    # gives back (read at the backward's end, not at the forward's).
    def workspace(*args: Any) -> None:
        counter.set(counter.allocated + SPIKE)
        counter.set(counter.allocated - SPIKE)

    layers[-1].register_full_backward_pre_hook(workspace)
    step_peak = WEIGHTS + len(layers) * ACTIVATIONS + SPIKE
    for step in range(6):
        torch.cuda.reset_peak_memory_stats()  # the loop's own reset, before each step
        xin = x.detach().requires_grad_(True)
        with oa:
            out = run_layers(layers, xin)
        (out ** 2).mean().backward()
        assert counter.max_memory_allocated() == step_peak  # what the loop reads for the step
        assert counter.allocated == WEIGHTS
    assert oa.plan is not None and oa.measured is not None
    assert oa.measured["peak_bytes"] == step_peak, (
        f"the plan report measured {oa.measured['peak_bytes']} bytes for a step that peaked at "
        f"{step_peak} (the loop reset the peak counter before the step)")
    assert "measured" in oa.plan_report()


def test_step_peak_reads_the_largest_since_its_reset(counter) -> None:
    peak = StepPeak("cuda")
    counter.set(5000)
    peak.reset()
    assert peak.read() == 5000
    counter.set(9000)
    assert peak.read() == 9000
    counter.set(6000)
    torch.cuda.reset_peak_memory_stats()  # somebody else's reset: the reading taken stays
    assert peak.read() == 9000
    peak.reset()
    assert peak.read() == 6000
