"""What the first steps cost, phase by phase (issue 50 s1): a planning context's probe steps and
first planned steps, in ``oa.first_steps`` and in ``oa.report()``; each step's phases add up to
no more than its wall time; and, on a clock of the test's own, each second is charged to the step
and phase it was spent in."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import offload
from offload.planner.first_steps import PHASES, PLANNED_STEPS, FirstSteps
from _util import assert_bitwise, make_mlp_layers, oa_step, probe_with_device_limit, train_step


def _run(steps: int, **kw: Any) -> Any:
    torch.manual_seed(0)
    layers = make_mlp_layers(4, width=64)
    oa = offload.OffloadActivations(layers, device="cpu", min_offload_bytes=0, **kw)
    x = torch.randn(8, 64)
    for _ in range(steps):
        oa_step(layers, x, oa)
    return oa


def test_first_steps_add_up_and_are_reported() -> None:
    oa = _run(6, memory_budget_bytes="lowest")
    rows = oa.first_steps
    # On the CPU: the plain probe (a warm-up, the calibration, the measured step), then the first
    # planned steps; none after those.
    assert [r["kind"] for r in rows] == ["warm-up", "calibrate", "measure"] + ["planned"] * PLANNED_STEPS
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    for r in rows:
        assert r["wall_s"] is not None and r["wall_s"] > 0, r
        spent = sum(r[f"{phase}_s"] for phase in PHASES)
        assert 0 <= spent <= r["wall_s"], r
        assert abs(r["other_s"] - (r["wall_s"] - spent)) < 1e-12
    first = rows[3]  # the first planned step made the plan from the measured figures
    assert first["search_s"] > 0 and first["link_s"] > 0 and first["probe_s"] > 0
    assert rows[4]["search_s"] == rows[4]["link_s"] == 0  # made once
    assert rows[1]["device_s"] is not None and rows[3]["device_s"] is None  # probe steps only
    report = oa.report()
    assert "first steps" in report
    for kind in ("warm-up", "calibrate", "measure", "planned"):
        assert kind in report.split("first steps")[1]


def _checked_mlp() -> tuple[torch.nn.ModuleList, torch.Tensor, list[torch.Tensor]]:
    # Four MLP layers, their input, and their plain gradients (the plain step repeats itself).
    torch.manual_seed(0)
    layers = make_mlp_layers(4, width=64)
    x = torch.randn(8, 64)
    expected = train_step(layers, x)
    assert_bitwise(expected, train_step(layers, x))
    return layers, x, expected


def test_auto_probe_sizes_then_measures_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    # The CPU has no device memory to size against, so the auto probe runs there only with a
    # device limit given (as a GPU gives one): the sizing step, then the measured plain step
    # (no calibration step), then planned steps, every one with the plain gradients.
    probe_with_device_limit(monkeypatch)
    layers, x, expected = _checked_mlp()
    oa = offload.OffloadActivations(layers, device="cpu", min_offload_bytes=0, memory_budget_bytes="lowest")
    for _ in range(5):
        assert_bitwise(expected, oa_step(layers, x, oa))
    rows = oa.first_steps
    assert [r["kind"] for r in rows] == ["size", "measure", "planned", "planned"], rows
    assert rows[1]["search_s"] > 0 and rows[1]["link_s"] > 0  # the plan pinned ahead, from the sizing step
    assert rows[2]["search_s"] > 0 and oa.plan.profile.probe == "plain"


def test_a_byte_budget_below_the_plain_peak_keeps_the_probe_at_low_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    # The device has room for the plain step, the budget does not: the budget binds the probe
    # steps too, so the sizing step is the measured one (no plain step over the budget), and
    # every step still gives the plain gradients.
    probe_with_device_limit(monkeypatch)
    layers, x, expected = _checked_mlp()
    sizing = offload.OffloadActivations(layers, device="cpu", min_offload_bytes=0, memory_budget_bytes="lowest")
    for _ in range(3):
        oa_step(layers, x, sizing)
    plain_peak, lowest = sizing.plan.profile.plain_peak_bytes, sizing.plan.prediction.peak_bytes
    sizing.close()
    budget = (plain_peak + lowest) // 2
    assert lowest <= budget < plain_peak
    oa = offload.OffloadActivations(layers, device="cpu", min_offload_bytes=0, memory_budget_bytes=budget)
    for _ in range(4):
        assert_bitwise(expected, oa_step(layers, x, oa))
    assert [r["kind"] for r in oa.first_steps][:2] == ["size", "planned"], oa.first_steps
    profile = oa.plan.profile
    assert profile.probe == "recompute" and "more than the memory budget's" in profile.probe_reason, profile.probe_reason
    assert oa.plan.prediction.peak_bytes <= budget
    oa.close()
    # A budget the plain step fits keeps the measured plain step.
    roomy = offload.OffloadActivations(layers, device="cpu", min_offload_bytes=0, memory_budget_bytes=4 * plain_peak)
    for _ in range(3):
        oa_step(layers, x, roomy)
    assert [r["kind"] for r in roomy.first_steps][:2] == ["size", "measure"]
    assert "fits the memory budget's" in roomy.plan.profile.probe_reason
    roomy.close()


def test_no_table_without_plans() -> None:
    oa = _run(2, num_offload_layers=2)  # a fixed schedule: nothing planned
    assert oa.first_steps == []
    assert "first steps" not in oa.report()


def test_the_engine_counts_its_host_block_acquires() -> None:
    oa = _run(1, num_offload_layers=3)
    assert oa.engine.arena.counters.acquire_s > 0


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def spend(self, seconds: float) -> None:
        self.t += seconds


def test_each_second_is_charged_where_it_was_spent() -> None:
    clock, pinned = _Clock(), [0.0]
    costs = FirstSteps(lambda: pinned[0], now=clock)
    costs.enter()
    costs.kind("size")
    clock.spend(2.0)  # the step itself
    costs.enter()  # its end: the next step's entry, where the probe step is closed
    costs.kind("measure")

    def end_probe_step() -> None:
        clock.spend(0.25)  # reading the probe's figures ...
        costs.timed("link", lambda: clock.spend(0.5))  # ... and the link measured inside that
        costs.device(1.5)  # the closed step's span on the device

    costs.timed("probe", end_probe_step)
    costs.timed("search", lambda: clock.spend(0.125))
    clock.spend(1.0)
    pinned[0] = 0.75  # its copies waited this long for host blocks
    costs.enter()
    costs.kind("planned")
    clock.spend(3.0)
    first, second, third = costs.rows()
    assert (first["kind"], first["wall_s"], first["device_s"], first["other_s"]) == ("size", 2.0, 1.5, 2.0)
    assert second["kind"] == "measure" and second["wall_s"] == 1.875
    assert (second["probe_s"], second["link_s"], second["search_s"], second["pinning_s"]) == (0.25, 0.5, 0.125, 0.75)
    assert second["other_s"] == 1.875 - 1.625
    assert third["wall_s"] is None and third["other_s"] is None  # still running
    assert "running" in costs.table()
    for _ in range(PLANNED_STEPS + 2):
        costs.enter()
        costs.kind("planned")
    assert len(costs.rows()) == 2 + PLANNED_STEPS  # the planned steps after the first ones are not kept


def test_the_background_pinners_seconds_beside_each_step_are_shown_not_charged() -> None:
    clock, background = _Clock(), [0.0]
    costs = FirstSteps(lambda: 0.0, lambda: background[0], now=clock)
    costs.enter()
    costs.kind("size")
    clock.spend(2.0)
    background[0] = 3.5  # the pinner's workers pinned beside the step
    costs.enter()
    costs.kind("planned")
    clock.spend(1.0)
    background[0] = 4.0
    costs.enter()
    first, second, _ = costs.rows()
    assert (first["background_pin_s"], second["background_pin_s"]) == (3.5, 0.5)
    assert first["other_s"] == 2.0 and first["pinning_s"] == 0.0  # not charged to the step
    assert "bg-pin" in costs.table() and "3.500" in costs.table()


def test_the_background_pinner_counts_its_busy_seconds() -> None:
    import time

    from offload.host.pinning import BackgroundPinner

    def slow_allocate(nbytes: int):
        time.sleep(0.05)
        return torch.empty(nbytes, dtype=torch.uint8), nbytes

    pinner = BackgroundPinner(slow_allocate, None)
    futures = [pinner.submit(16) for _ in range(4)]
    for future in futures:
        future.result()
    assert 0.2 <= pinner.busy_s < 2.0
    pinner.close()
