"""The first plan off the critical path (issue 50 s1, T14, and s2, T22), on the CPU with a fake
slow pinner (the CPU arena pins nothing): with ``plan_ahead``, nothing is pinned ahead during the
probe steps (so the measured step never waits for it); the first planned step follows a stand-in
that copies nothing (its predicted peak within the budget) while its own plan is made on the
background thread, as a new bucket's is (no search on the calling thread: on the H200 it took the
first planned step 0.17-0.40 s), and the plan's blocks are pinned once it is made; the steps
switch to it once they are, bit for bit on every step; the first steps' table and ``ahead_log``
say so. Without ``plan_ahead`` the first plan runs at once. The ranks' side (both switch at the
same step with one rank's pinning delayed) is in ``tests/distributed/test_plan_ahead_ranks_cpu.py``."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import pytest
import torch

import offload
from offload import plan_steps
from offload.engine.schedules.planned import PlannedSchedule
from offload.planner.model import simulate
from offload.planner.search import BudgetError

from _util import assert_bitwise, make_gpt_layers, make_mlp_layers, oa_step, plain_reference, probe_with_device_limit, train_step

LENGTH = 16


pytestmark = pytest.mark.usefixtures("deterministic")


def _x(step: int) -> torch.Tensor:
    return torch.randn(2, LENGTH, 64, generator=torch.Generator().manual_seed(step))


def copies(plan: Any) -> bool:
    return bool(PlannedSchedule(plan, plan.profile).region_bytes())


def fake_slow_pinner(oa: Any) -> tuple[threading.Event, list[Any]]:
    """The context's arena as a pinned one whose pinning takes until the returned event is set:
    what a plan made ahead asks is pinned once the event is set."""
    planned, gate, asked = oa._planned, threading.Event(), []
    real_pin = planned._pin
    planned._pin = lambda sizes: (asked.append(list(sizes)), real_pin(sizes))
    if planned._ahead is not None:
        def pin(plan: Any) -> list[int]:
            asked.append(PlannedSchedule(plan, plan.profile).region_bytes())
            return asked[-1]

        planned._ahead._pin = pin
        planned._ahead._pinned = lambda sizes: gate.is_set()
    return gate, asked


def _context(layers: torch.nn.ModuleList, budget: Any, **kw: Any) -> Any:
    return offload.OffloadActivations(layers, memory_budget_bytes=budget, device="cpu", min_offload_bytes=0, **kw)


def _budget(layers: torch.nn.ModuleList) -> int:
    # Above the lowest peak, below the plain one: the own plan offloads, keep and recompute fit too.
    profile = offload.planner.profile_step(layers, lambda: train_step(layers, _x(0)), device="cpu", min_offload_bytes=0)
    return (offload.planner.lowest_peak(profile).prediction.peak_bytes + profile.plain_peak_bytes) // 2


def test_the_first_plan_is_made_behind_a_stand_in_and_followed_once_pinned_bit_for_bit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    layers = make_gpt_layers(4)
    budget = _budget(layers)
    oa = _context(layers, budget, plan_ahead=True)
    gate, asked = fake_slow_pinner(oa)
    on_main: list[int] = []
    real_choose = plan_steps.choose
    monkeypatch.setattr(plan_steps, "choose", lambda *a, **k: (on_main.append(threading.get_ident()), real_choose(*a, **k))[1])
    planned, kinds = oa._planned, []
    for step in range(7):
        if step == 5:
            gate.set()  # the blocks are pinned now: the next step switches
        x = _x(step)
        assert_bitwise(plain_reference(layers, x), oa_step(layers, x, oa))
        if step == 3:
            # The first planned step searched nothing here; its own plan's blocks are asked once
            # it is made (at this forward's end, or the next step's entry: below).
            assert on_main == [], on_main
            planned._ahead.started[0].future.exception(timeout=30)
        if planned.profile is not None and step >= 3:
            kinds.append(planned.last_plan["plan"])
            if kinds[-1] == "stand-in":
                # Copies nothing (no host block to wait for), and its predicted peak fits the budget.
                stand_in = oa.plan
                assert stand_in.prediction.d2h_bytes == 0 and not copies(stand_in), stand_in.describe()
                assert simulate(stand_in.profile, stand_in.layers, budget).peak_bytes <= budget
    assert kinds == ["stand-in", "stand-in", "own", "own"], kinds
    own = oa.plan
    assert copies(own) and on_main == []
    # The own plan's blocks asked first (the stand-in copies nothing), then again as it is
    # followed (served by those).
    regions = PlannedSchedule(own, own.profile).region_bytes()
    asked = [a for a in asked if a]
    assert asked[0] == regions and asked[-1] == regions, asked
    assert not planned._pinned_ahead  # nothing pinned during the probe steps
    log = "\n".join(planned.ahead_log())
    assert f"step 4: batch 2 x length {LENGTH} (new) follows a stand-in, the last " in log, log
    assert "its own plan is made in the background" in log and "step 6: batch 2 x length" in log, log
    assert "follows its own plan from here (made in the background in" in log, log
    # When it came: the search, then the wait from being asked to made, then to pinned.
    import re
    search, made_after, pinned = map(float, re.search(r"in ([\d.]+) s of search, ([\d.]+) s after it was asked; "
                                                      r"its blocks pinned (-?[\d.]+) s later", log).groups())
    assert made_after >= search > 0 and pinned >= 0, log
    rows = oa.first_steps
    assert [r["kind"] for r in rows][-4:] == ["stand-in", "stand-in", "planned", "planned"], rows
    assert all(r["search_s"] == 0 for r in rows), rows
    assert "stand-in" in oa.report().split("first steps")[1]


def test_the_first_plan_runs_at_once_without_plans_ahead() -> None:
    layers = make_gpt_layers(4)
    oa = _context(layers, _budget(layers), plan_ahead=False)
    fake_slow_pinner(oa)
    for step in range(4):
        x = _x(step)
        assert_bitwise(plain_reference(layers, x), oa_step(layers, x, oa))
    assert oa._planned.last_plan["plan"] == "own" and copies(oa.plan)
    assert oa._planned.ahead_log() == []
    assert oa.first_steps[3]["search_s"] > 0


def test_no_plan_fits_is_raised_at_the_first_planned_step() -> None:
    layers = make_gpt_layers(4)
    oa = _context(layers, 1, plan_ahead=True)
    fake_slow_pinner(oa)
    with pytest.raises(BudgetError):
        for step in range(4):
            oa_step(layers, _x(step), oa)
    assert oa._planned.plan is None and oa._planned._ahead.started == []


@pytest.mark.parametrize("ahead", [True, False])
def test_the_measured_step_waits_for_nothing_pinned_ahead(monkeypatch: pytest.MonkeyPatch, ahead: bool) -> None:
    # The auto probe with a device limit (as a GPU gives one): the sizing step, then the measured
    # one. With plans ahead, where a stand-in fits the sizing step's figures, nothing is pinned
    # ahead (so nothing is waited for at the measured step's entry).
    probe_with_device_limit(monkeypatch)
    torch.manual_seed(0)
    layers = make_mlp_layers(4, width=64)
    x = torch.randn(8, 64)
    expected = train_step(layers, x)
    oa = offload.OffloadActivations(layers, device="cpu", min_offload_bytes=0, memory_budget_bytes=1 << 40,
                                    plan_ahead=ahead)
    pins: list[Any] = []
    real_pin = oa._planned._pin
    oa._planned._pin = lambda sizes: (pins.append(oa._planned.profile), real_pin(sizes))
    # The plan pinned ahead is searched (plan_steps.choose before the profile exists) only where
    # it is pinned: not where a stand-in fits.
    searched_ahead: list[bool] = []
    real_choose = offload.plan_steps.choose
    monkeypatch.setattr(offload.plan_steps, "choose",
                        lambda *a, **k: (searched_ahead.append(oa._planned.profile is None), real_choose(*a, **k))[1])
    for _ in range(4):
        assert_bitwise(expected, oa_step(layers, x, oa))
    rows = oa.first_steps
    assert [r["kind"] for r in rows][:2] == ["size", "measure"], rows
    # The sizing figures' plan searched only where it is pinned; a stand-in's check is simulated.
    assert (rows[1]["search_s"] > 0) is not ahead and oa._planned._pinned_ahead
    assert (None in pins) is not ahead, pins  # pinned during the probe steps only without plans ahead
    assert searched_ahead.count(True) == (0 if ahead else 1), searched_ahead


def test_no_stand_in_is_followed_over_the_budget() -> None:
    # A budget 2% under the plain peak: with no host copies the lowest plan (keep everything) is
    # within the cost model's error above it, which an own plan may follow with a warning; a
    # stand-in is optional and must not (on the H200 such a stand-in ran out of memory). Every
    # plan followed predicts a peak within the budget, and nothing warns.
    layers = make_gpt_layers(4)
    profile = offload.planner.profile_step(layers, lambda: train_step(layers, _x(0)), device="cpu", min_offload_bytes=0)
    budget = int(profile.plain_peak_bytes * 0.98)
    oa = _context(layers, budget, plan_ahead=True)
    gate, _ = fake_slow_pinner(oa)
    kinds = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for step in range(6):
            if step == 4:
                gate.set()
            x = _x(step)
            assert_bitwise(plain_reference(layers, x), oa_step(layers, x, oa))
            if oa.plan is not None and step >= 3:
                kinds.append(oa._planned.last_plan["plan"])
                assert simulate(oa.plan.profile, oa.plan.layers, budget).peak_bytes <= budget, (kinds, oa.plan.describe())
                if kinds[-1] == "stand-in":
                    # Recomputed layers keep their inputs (no host block to wait for): on the H200
                    # stand-ins that copied took 5x a steady step beside the own plan's pinning.
                    assert oa.plan.prediction.d2h_bytes == 0 and "inputs kept" in oa.plan.describe(), oa.plan.describe()
    assert kinds[-1] == "own" and "stand-in" in kinds, kinds


def test_a_plan_made_during_the_forward_has_its_blocks_asked_at_the_forwards_end() -> None:
    # On the H200 (T14, the 8B shape) the first plan's search took 0.4 s beside a 0.7 s forward;
    # asked at the next step's entry, its blocks pinned a whole step later. Asked at the forward's
    # end, they pin beside the backward; the step stays bit for bit.
    from offload.models import run_layers

    layers = make_gpt_layers(4)
    oa = _context(layers, _budget(layers), plan_ahead=True)
    _, asked = fake_slow_pinner(oa)
    for step in range(3):  # the probe steps
        oa_step(layers, _x(step), oa)
    planned = oa._planned
    x = _x(3)
    expected = plain_reference(layers, x)
    made = []

    def forward(h: torch.Tensor) -> torch.Tensor:
        h = layers[0](h)  # the first layer's entry: the stand-in, the own plan queued
        made.append(planned._ahead.started[0].future.result(timeout=30))  # made while the forward runs
        return run_layers(layers[1:], h)

    for p in layers.parameters():
        p.grad = None
    xin = x.detach().requires_grad_(True)
    with oa:
        out = forward(xin)
    asked.append("forward ended")  # the with's exit has run; the backward has not
    (out.float() ** 2).mean().backward()
    assert_bitwise(expected, [p.grad.clone() for p in layers.parameters()] + [xin.grad.clone()])
    own = made[0].plan
    assert planned.last_plan["plan"] == "stand-in" and copies(own)
    # Asked before the forward's end, not at the next step's entry.
    at_end = asked.index("forward ended")
    assert PlannedSchedule(own, own.profile).region_bytes() in asked[:at_end], asked
