"""The probe sequence moves on by the outcome the ranks agreed on (issue 48), in one process:
``ProbeSequence.judge`` gives this rank's outcome, ``advance`` takes the agreed (worst) one, so a
rank whose own step went well follows the others onto the low-memory probe, measures again, or
raises their ``BudgetError``. The multi-process cases are ``tests/distributed/test_ranks_diverge_cpu.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import offload
from offload.models import MLPBlock
from offload.planner.make import probe_policy
from offload.planner.search import BudgetError
from offload.planner.sequence import ProbeSequence, StepOutcome, Verdict
from offload.planner.types import LinkProfile

LINK = LinkProfile(d2h_gbps=10.0, h2d_gbps=10.0, duplex_gbps=15.0)
CPU = torch.device("cpu")


@pytest.fixture
def layers() -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(MLPBlock(16) for _ in range(3))


def _sequence(layers: torch.nn.ModuleList, limit: int, probe: str = "auto") -> ProbeSequence:
    return ProbeSequence(layers, probe_policy(CPU, 0), CPU, probe=probe, link=lambda: LINK, device_limit=lambda: limit)


def _run(seq: ProbeSequence, layers: torch.nn.ModuleList) -> Any:
    """One whole step under the sequence's next probe; the probe (ended)."""
    probe = seq.next_step()
    if probe is not None:
        probe.begin()
    x = torch.randn(2, 8, 16, requires_grad=True)
    for layer in layers:
        x = layer(x)
    if probe is not None:
        probe.end_forward()
    x.square().mean().backward()
    if probe is not None:
        probe.end_step()
    return probe


def _done(seq: ProbeSequence, layers: torch.nn.ModuleList) -> Any:
    """One step that went as every rank's did: its outcome is the agreed one."""
    probe = _run(seq, layers)
    own = seq.judge(probe)
    return seq.advance(own, own, probe=probe)


def test_outcomes_reduce_to_the_worst_and_any_flag() -> None:
    ranks = [StepOutcome(), StepOutcome(Verdict.LOW_MEMORY), StepOutcome(Verdict.AGAIN, raised=True),
             StepOutcome(low_memory=True)]
    worst = [max(values) for values in zip(*(o.values() for o in ranks))]  # what agree_max computes
    assert StepOutcome.from_values(worst) == StepOutcome(Verdict.LOW_MEMORY, low_memory=True, raised=True)
    assert Verdict.DONE < Verdict.AGAIN < Verdict.LOW_MEMORY < Verdict.NO_FIT


def test_a_rank_whose_plain_step_fits_follows_another_onto_the_low_memory_probe(layers) -> None:
    # Another rank's plain step would not fit: this rank's sizing step is its measured one too,
    # at the same step as everywhere (no plain step follows).
    seq = _sequence(layers, limit=1 << 40)
    probe = _run(seq, layers)
    own = seq.judge(probe)
    assert own.verdict == Verdict.DONE and not own.low_memory  # it fits here
    profile = seq.advance(own, StepOutcome(low_memory=True), probe=probe)
    assert profile is not None and profile.probe == "recompute" and seq.todo == []
    assert "another rank" in profile.probe_reason and "fits" in profile.probe_reason


def test_another_ranks_out_of_memory_in_a_plain_step_moves_every_rank_to_low_memory(layers) -> None:
    seq = _sequence(layers, limit=1 << 40)
    _done(seq, layers)  # sized: the measured plain step follows (the sizing step calibrated)
    assert seq.todo == ["measure"] and seq.mode == "plain"
    probe = _run(seq, layers)  # the measured plain step, fine here
    assert seq.advance(seq.judge(probe), StepOutcome(Verdict.LOW_MEMORY), probe=probe) is None  # its figures dropped
    assert seq.todo == ["measure"] and seq.mode == "recompute" and "another rank" in seq.reason


def test_another_ranks_failed_measured_step_is_measured_again_everywhere(layers) -> None:
    seq = _sequence(layers, limit=1, probe="recompute")
    _done(seq, layers)  # the warm-up
    probe = _run(seq, layers)
    assert seq.advance(seq.judge(probe), StepOutcome(Verdict.AGAIN), probe=probe) is None  # its figures dropped
    assert seq.todo == ["measure"]
    assert _done(seq, layers) is not None


def test_another_ranks_out_of_memory_at_low_memory_is_every_ranks_budget_error(layers) -> None:
    seq = _sequence(layers, limit=1 << 40)
    probe = _run(seq, layers)
    with pytest.raises(BudgetError, match="another rank"):
        seq.advance(seq.judge(probe), StepOutcome(Verdict.NO_FIT), probe=probe)
    assert seq.todo == ["size"]  # the next step sizes again (a shorter batch may fit)


def test_run_raises_when_another_ranks_step_raised(layers) -> None:
    seq = _sequence(layers, limit=1 << 40)

    def step() -> None:
        x = torch.randn(2, 8, 16)
        for layer in layers:
            x = layer(x)
        x.square().mean().backward()

    with pytest.raises(RuntimeError, match="raised on another rank"):
        seq.run(step, "test", agree=lambda own: StepOutcome(Verdict.AGAIN, raised=True))


def test_alone_out_of_memory_in_a_low_memory_probe_step_raises_at_the_withs_exit(layers) -> None:
    # Without a process group the outcome is acted on at once, as before: the BudgetError comes
    # from the failing step's own with, and the context is clean after it.
    oa = offload.OffloadActivations(layers, memory_budget_bytes=1 << 30, device="cpu", probe="recompute")
    with pytest.raises(BudgetError, match="even with every layer recomputed"):
        with oa:
            raise torch.OutOfMemoryError("CUDA out of memory. (simulated)")
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    oa.close()


def test_without_a_process_group_planned_steps_make_no_collective(layers, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_collective(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a collective without a process group")

    monkeypatch.setattr(dist, "all_reduce", no_collective)
    oa = offload.OffloadActivations(layers, memory_budget_bytes=1 << 30, device="cpu", min_offload_bytes=0)
    for length in (8, 12, 8, 30, 16, 8):
        with oa:
            x = torch.randn(2, length, 16, requires_grad=True)
            for layer in layers:
                x = layer(x)
        x.square().mean().backward()
    assert oa.plan is not None
    oa.close()
