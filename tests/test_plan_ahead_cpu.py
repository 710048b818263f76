"""Plans made ahead (issue 50 s2), on the CPU: a new length bucket's first step (the first planned
step's after the probe steps too) follows a stand-in with no search on the calling thread, its
own plan comes from a background thread at a later step,
gradients stay bitwise the plain run's on every step (the stand-in's and the switch's), the
stand-in's predicted peak fits the budget, and a making that failed in the background is raised at
the bucket's next step, after which the bucket is planned on the calling thread. The ranks' side
(all switch at the same step) is in ``tests/distributed/test_plan_ahead_ranks_cpu.py``."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import offload
from offload import plan_steps
from offload.planner import ahead
from offload.planner.model import simulate
from offload.planner.scaling import profile_at
from offload.planner.search import BudgetError
from offload.planner.shapes import StepShape
from offload.planner.types import Action, LayerPlan

from _util import assert_bitwise, make_gpt_layers, oa_step, plain_reference, train_step

PROBE_LENGTH = 16


pytestmark = pytest.mark.usefixtures("deterministic")


def _budget(layers: torch.nn.ModuleList) -> int:
    # Between the lowest and the plain peak at the longest length (32): the plans per bucket differ.
    profile = offload.planner.profile_step(layers, lambda: train_step(layers, torch.randn(2, 32, 64)), device="cpu",
                                           min_offload_bytes=0)
    return offload.planner.lowest_peak(profile).prediction.peak_bytes * 3 // 2


def _x(step: int, length: int) -> torch.Tensor:
    return torch.randn(2, length, 64, generator=torch.Generator().manual_seed(step))


class _Calls:
    """``choose`` in plan_steps (the calling thread's plans) and in planner.ahead (the background
    ones), recorded with the thread each ran on; the background ones wait for :attr:`gate`, but
    for the probe length's bucket (the first plan's: :func:`_probe` waits for it)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> None:
        self.main: list[int] = []
        self.background: list[int] = []
        self.gate = threading.Event()
        main_choose, ahead_choose = plan_steps.choose, ahead.choose
        first = StepShape(2, PROBE_LENGTH).bucket().length

        def on_main(*args: Any, **kwargs: Any) -> Any:
            self.main.append(threading.get_ident())
            return main_choose(*args, **kwargs)

        def behind(profile: Any, *args: Any, **kwargs: Any) -> Any:
            self.background.append(threading.get_ident())
            if profile.shape[1] != first:
                assert self.gate.wait(30)
                if fail:
                    raise BudgetError("no plan fits (injected in the background)")
            return ahead_choose(profile, *args, **kwargs)

        monkeypatch.setattr(plan_steps, "choose", on_main)
        monkeypatch.setattr(ahead, "choose", behind)


def _made(oa: Any) -> None:
    # Wait for the background making of the latest bucket (the test's thread runs no step meanwhile).
    entry = oa._planned._ahead.started[-1]
    assert entry.future is not None, "the bucket was planned on the calling thread"
    entry.future.exception(timeout=30)


def _probe(layers: torch.nn.ModuleList, oa: Any, calls: _Calls, switch: bool = True) -> None:
    # The probe steps, then the first planned step: with plans ahead it follows a stand-in while
    # its own plan is made in the background (no search on this thread: on the H200 that search
    # took its step 0.17-0.40 s), and (``switch``) the next step switches to it; without, it is
    # made at once.
    for step in range(4):
        x = _x(step, PROBE_LENGTH)
        assert_bitwise(plain_reference(layers, x), oa_step(layers, x, oa))
    planned = oa._planned
    if planned._ahead is None:
        assert planned.last_plan == {**planned.last_plan, "plan": "own", "new": True} and len(calls.main) == 1
        return
    assert planned.last_plan == {**planned.last_plan, "plan": "stand-in", "new": True}
    assert calls.main == []
    if not switch:
        return
    assert len(calls.background) >= 1
    planned._ahead.started[0].future.exception(timeout=30)
    x = _x(4, PROBE_LENGTH)
    assert_bitwise(plain_reference(layers, x), oa_step(layers, x, oa))
    assert planned.last_plan == {**planned.last_plan, "plan": "own", "new": False} and calls.main == []
    assert "follows its own plan from here (made in the background" in planned.ahead_log()[-1]


def test_a_new_bucket_runs_a_stand_in_then_its_own_plan_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    layers = make_gpt_layers(4)
    budget = _budget(layers)
    oa = offload.OffloadActivations(layers, memory_budget_bytes=budget, device="cpu", min_offload_bytes=0,
                                    plan_ahead=True)
    calls = _Calls(monkeypatch)
    _probe(layers, oa, calls)
    calls.main.clear()
    calls.background.clear()
    planned = oa._planned
    kinds = []
    for step, length in enumerate([32, 32, 32, 24, 24], start=4):
        if step == 6:  # the background making may finish now: the next step of bucket 32 switches
            calls.gate.set()
        if step in (6, 8):
            _made(oa)
        x = _x(step, length)
        assert_bitwise(plain_reference(layers, x), oa_step(layers, x, oa))
        assert calls.main == [], f"step {step} (length {length}) searched on the calling thread"
        kinds.append(planned.last_plan["plan"])
        plan, top = oa.plan, StepShape(2, length).bucket()
        if planned.last_plan["plan"] == "stand-in":
            # The stand-in's predicted peak at the bucket fits the budget (and so, at its own top).
            assert simulate(profile_at(planned.profile, top), plan.layers, budget).peak_bytes <= budget
            assert plan.prediction.peak_bytes <= budget
        # A bucket new to the group holds the arena's background pinning for its step (its
        # allocator growth and graph builds would wait behind registrations); the next lets it go.
        assert planned.engine.arena.pinner.held == planned.last_plan["new"], (step, planned.last_plan)
        if step == 4:  # a new bucket: the last layers kept, the others recomputed, inputs kept (nothing to pin)
            recomputed = [lp for lp in plan.layers if lp.action == Action.RECOMPUTE]
            assert plan.prediction.d2h_bytes == 0 and recomputed and all(lp.keep_inputs for lp in recomputed), plan.describe()
            assert all(lp.action == Action.KEEP for lp in plan.layers[len(recomputed):]), plan.describe()
        if step == 7:  # a new bucket under 32: the covering bucket's plan, pinned already
            assert plan is planned._plans[StepShape(2, 32)]
    assert kinds == ["stand-in", "stand-in", "own", "stand-in", "own"], kinds
    assert oa.plan.profile.shape == (2, StepShape(2, 24).bucket().length)
    # Every making on another thread.
    assert len(calls.background) == 2 and threading.get_ident() not in calls.background
    log = "\n".join(planned.ahead_log())
    assert "follows a stand-in, the last " in log and "follows a stand-in, bucket 32's plan" in log, log
    assert "follows its own plan from here" in oa.plan_report()


def test_a_new_buckets_stand_in_sends_the_inputs_where_keeping_them_does_not_fit() -> None:
    # Kept inputs hold every boundary on the device; under a budget between the two recomputes'
    # peaks the stand-in sends them to the host (as before kept inputs existed).
    from offload.planner.search import plan_for

    layers = make_gpt_layers(4)
    profile = offload.planner.profile_step(layers, lambda: train_step(layers, _x(0, 16)), device="cpu", min_offload_bytes=0)
    bucket = StepShape(2, 32)
    at = profile_at(profile, bucket)
    peaks = [plan_for(at, [LayerPlan(Action.RECOMPUTE, keep_inputs=k)] * 4, None).prediction.peak_bytes for k in (False, True)]
    assert peaks[0] < peaks[1]
    for budget, kind in ((peaks[1], ahead.LOWEST_KEPT_STAND_IN), ((peaks[0] + peaks[1]) // 2, ahead.LOWEST_STAND_IN)):
        low = ahead.stand_ins(profile, bucket, {}, budget, host_bytes=1 << 40).lowest
        assert low is not None and low.kind == kind, (budget, low)
        assert (low.plan.prediction.d2h_bytes == 0) is (kind == ahead.LOWEST_KEPT_STAND_IN)


def _stand_ins_at_plain_peak() -> tuple[ahead.StandIns, ahead.StandIns]:
    # A bucket's stand-ins under its plain step's peak, and one byte under it.
    layers = make_gpt_layers(4)
    profile = offload.planner.profile_step(layers, lambda: train_step(layers, _x(0, 16)), device="cpu", min_offload_bytes=0)
    bucket = StepShape(2, 32)
    plain = profile_at(profile, bucket).plain_peak_bytes
    return tuple(ahead.stand_ins(profile, bucket, {}, budget, host_bytes=1 << 40)  # type: ignore[return-value]
                 for budget in (plain, plain - 1))


def test_a_new_bucket_whose_plain_step_fits_keeps_every_layer_meanwhile() -> None:
    # A short bucket whose plain step fits the budget: recomputing every layer would only slow
    # it (its own plan keeps every layer too); a budget under its plain peak leaves the others.
    options, under = _stand_ins_at_plain_peak()
    assert options.kept is not None and options.kept.kind == ahead.KEPT_STAND_IN
    assert all(layer.action == Action.KEEP and not layer.selective for layer in options.kept.plan.layers)
    assert options.kept.plan.prediction.d2h_bytes == 0 and options.first() is options.kept
    assert under.kept is None and under.first() is under.some is not None and under.lowest is not None
    # Under it, every layer but one kept (the last ones), nothing copied.
    assert under.some.recomputed == 1 and under.some.plan.prediction.d2h_bytes == 0


def test_the_last_layers_kept_are_as_many_as_fit() -> None:
    # Between the lowest peak and the plain one: the most of the last layers kept whose peak
    # fits; one more does not (bisected, a peak grows with each layer kept).
    layers = make_gpt_layers(8)
    profile = offload.planner.profile_step(layers, lambda: train_step(layers, _x(0, 16)), device="cpu", min_offload_bytes=0)
    bucket = StepShape(2, 32)
    at = profile_at(profile, bucket)
    low = ahead.stand_ins(profile, bucket, {}, at.plain_peak_bytes, host_bytes=1 << 40).lowest
    budget = (low.plan.prediction.peak_bytes + at.plain_peak_bytes) // 2
    some = ahead.stand_ins(profile, bucket, {}, budget, host_bytes=1 << 40).some
    kept = 8 - some.recomputed
    assert 0 < kept < 8, some.kind
    assert some.kind == ahead.SOME_KEPT_STAND_IN.format(kept="layer" if kept == 1 else f"{kept} layers")
    peaks = [simulate(at, ahead._last_kept(8, k), budget).peak_bytes for k in (kept, kept + 1)]
    assert peaks[0] <= budget < peaks[1], (kept, peaks, budget)
    # Rebuilt at the count the ranks agreed on (more recomputed): it fits too.
    fewer = ahead.some_kept(profile, bucket, budget, some.recomputed + 2)
    assert fewer.recomputed == some.recomputed + 2 and fewer.plan.prediction.peak_bytes <= budget


def test_the_ranks_follow_the_fastest_stand_in_that_fits_every_one() -> None:
    # Each rank's own options, agreed by the ranks' max of "does not fit": one rank without
    # room for the plain step moves every rank to the next option that fits all.
    roomy, tight = _stand_ins_at_plain_peak()
    unfit = [max(a, b) for a, b in zip(roomy.unfit(), tight.unfit())]
    assert unfit == [True, True, False, False]
    assert roomy.agreed(unfit) is roomy.some and tight.agreed(unfit) is tight.some
    assert max(roomy.recomputed(), tight.recomputed()) == tight.recomputed() >= 1
    assert roomy.agreed(roomy.unfit()) is roomy.kept
    assert ahead.NO_STAND_INS.agreed([True, True, True, True]) is None


def test_a_failure_in_the_background_is_raised_at_the_buckets_next_step(monkeypatch: pytest.MonkeyPatch) -> None:
    layers = make_gpt_layers(4)
    oa = offload.OffloadActivations(layers, memory_budget_bytes=_budget(layers), device="cpu", min_offload_bytes=0,
                                    plan_ahead=True)
    calls = _Calls(monkeypatch, fail=True)
    calls.gate.set()
    _probe(layers, oa, calls)
    calls.main.clear()
    calls.background.clear()
    x = _x(4, 32)
    assert_bitwise(plain_reference(layers, x), oa_step(layers, x, oa))  # the stand-in
    assert oa._planned.last_plan["plan"] == "stand-in" and calls.main == []
    _made(oa)
    x = _x(5, 32)
    with pytest.raises(BudgetError, match=r"no plan fits a step of batch 2 x length 32 \(made in the background"):
        oa_step(layers, x, oa)
    assert calls.main == []
    # The bucket's next step is planned on the calling thread (it fits there: the failure was injected).
    assert_bitwise(plain_reference(layers, x), oa_step(layers, x, oa))
    assert len(calls.main) == 1 and oa._planned.last_plan["plan"] == "own"
    assert oa.plan.profile.shape == (2, 32)


def test_plan_ahead_off_plans_a_new_bucket_on_its_first_step(monkeypatch: pytest.MonkeyPatch) -> None:
    layers = make_gpt_layers(4)
    budget = _budget(layers)
    assert offload.OffloadActivations(layers, memory_budget_bytes=budget, device="cpu")._planned._ahead is None
    for wrong in ("yes", [32, 0], [32.0]):
        with pytest.raises(TypeError, match="plan_ahead must be True, False or the sequence lengths"):
            offload.OffloadActivations(layers, memory_budget_bytes=budget, device="cpu", plan_ahead=wrong)
    oa = offload.OffloadActivations(layers, memory_budget_bytes=budget, device="cpu", min_offload_bytes=0,
                                    plan_ahead=False)
    calls = _Calls(monkeypatch)
    _probe(layers, oa, calls)
    calls.main.clear()
    calls.background.clear()
    x = _x(4, 32)
    assert_bitwise(plain_reference(layers, x), oa_step(layers, x, oa))
    assert oa._planned.last_plan["plan"] == "own" and oa.plan.profile.shape == (2, 32)
    assert len(calls.main) == 1 and calls.background == []


def test_known_lengths_are_planned_ahead_of_their_first_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # plan_ahead=[lengths]: their buckets are made in the background as soon as the first plan is
    # in force, largest first and those longer than the first plan's bucket before it (their
    # blocks serve its regions); a bucket whose plan is ready runs it from its first step, one
    # whose plan is not follows a stand-in meanwhile (its making is not started twice), and so
    # does the first plan's bucket until the plans before it are ready too.
    layers = make_gpt_layers(4)
    oa = offload.OffloadActivations(layers, memory_budget_bytes=_budget(layers), device="cpu", min_offload_bytes=0,
                                    plan_ahead=[24, 32])
    calls = _Calls(monkeypatch)
    _probe(layers, oa, calls, switch=False)  # (the longer buckets' makings wait at the gate)
    planned = oa._planned
    assert [e.bucket.length for e in planned._ahead.started] == [32, 25, PROBE_LENGTH]
    calls.main.clear()
    for step, length in ((4, PROBE_LENGTH), (5, 24)):
        x = _x(step, length)
        assert_bitwise(plain_reference(layers, x), oa_step(layers, x, oa))
        assert planned.last_plan["plan"] == "stand-in"
    assert "the others recomputed" in planned.ahead_log()[-1]
    calls.gate.set()
    for entry in planned._ahead.started:
        entry.future.exception(timeout=30)
    for step, length, kind in ((6, PROBE_LENGTH, "own"), (7, 32, "own"), (8, 24, "own")):
        x = _x(step, length)
        assert_bitwise(plain_reference(layers, x), oa_step(layers, x, oa))
        assert planned.last_plan["plan"] == kind and oa.plan.profile.shape == (2, StepShape(2, length).bucket().length)
    assert planned.last_plan["new"] is False
    assert calls.main == [] and len(calls.background) == 3  # the two known, then the first plan's


def test_two_ranks_figures_give_the_same_switches_and_failures() -> None:
    # Two ranks' PlansAhead, the same buckets started in the same order; their figures reduced by
    # max, as agree_planned_step does: a bucket switches on both once both have it ready, and the
    # first failure on either is every rank's.
    import concurrent.futures

    from offload.planner.ahead import Made, PlansAhead, StandIn

    buckets = [StepShape(2, n) for n in (32, 64, 128)]
    pending: list[concurrent.futures.Future] = []

    def rank(outcomes: list[Any]) -> PlansAhead:
        plans = PlansAhead(lambda plan: [], lambda sizes: True)
        for bucket, outcome in zip(buckets, outcomes):
            future: concurrent.futures.Future = concurrent.futures.Future()
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            elif outcome is not None:
                future.set_result(outcome)
            else:
                pending.append(future)
            plans.started.append(ahead._Entry(bucket, future, stand_in=StandIn(None, "test", bucket)))  # type: ignore[arg-type]
        return plans

    made = Made(None, 0, None, 0.0)  # type: ignore[arg-type]
    ranks = [rank([made, made, made]), rank([made, None, BudgetError("injected")])]

    def step(bucket: StepShape) -> list[Any]:
        figures = [plans.values() for plans in ranks]
        behind, failed = (max(f[i] for f in figures) for i in range(2))
        switches = [plans.switch(bucket, behind, failed) for plans in ranks]
        assert switches[0][1] == switches[1][1]  # the group's switch step: the same on both
        return [made for made, _ in switches]

    assert step(buckets[1]) == [None, None]  # rank 1 has bucket 64 in flight
    assert step(buckets[0]) == [made, made]
    pending[0].set_result(made)  # rank 1's 64 is made; its 128 failed
    assert step(buckets[1]) == [made, made]
    assert [plans.failed for plans in ranks] == [{buckets[2]: None}, {buckets[2]: ranks[1].failed[buckets[2]]}]
    assert isinstance(ranks[1].failed[buckets[2]], BudgetError)


@pytest.mark.parametrize("budget, cap, agreed, empties", [
    ("device", None, set(), True),            # the first plan under "device": read from an emptied cache
    ("device", None, {StepShape(2, 32)}, False),  # a later bucket: its step must not wait for the device
    (1 << 30, 1 << 29, set(), True),          # the first plan after an out-of-memory step's ceiling
    (1 << 30, None, set(), False),            # a budget in bytes reads nothing from the device
])
def test_only_the_first_plan_of_a_budget_empties_the_cache(monkeypatch: pytest.MonkeyPatch, budget: Any, cap: Any,
                                                         agreed: set, empties: bool) -> None:
    # One rule for a plan made on the calling thread and a bucket's stand-ins and plan made ahead.
    from types import SimpleNamespace

    from offload.planner.ahead_steps import AheadSteps

    emptied: list[bool] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    steps = SimpleNamespace(engine=SimpleNamespace(transport=SimpleNamespace(device=torch.device("cuda"))),
                            _agreed=agreed, budget=budget, _cap=cap,
                            costs=SimpleNamespace(timed=lambda name, fn: fn()))
    assert AheadSteps._empty_for_first_plan(steps) is empties  # type: ignore[arg-type]
    assert emptied == ([True] if empties else [])


def test_a_plan_made_during_a_cuda_graph_capture_is_taken_up_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # Asking for a plan's blocks pins and unpins host memory, which a capture forbids: a poll under
    # capture leaves the made plan alone, and the first poll after the capture asks for its blocks.
    import concurrent.futures

    from offload.planner.ahead import Made, PlansAhead, StandIn

    asked: list[Any] = []
    plans = PlansAhead(lambda plan: asked.append(plan) or [], lambda sizes: True)
    future: concurrent.futures.Future = concurrent.futures.Future()
    made = Made(object(), 0, None, 0.0)  # type: ignore[arg-type]
    future.set_result(made)
    bucket = StepShape(2, 32)
    plans.started.append(ahead._Entry(bucket, future, stand_in=StandIn(None, "test", bucket)))  # type: ignore[arg-type]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    plans.poll()
    assert plans.values() == (1, 0) and asked == []  # behind by one bucket, nothing asked
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert plans.values() == (0, 0) and asked == [made.plan]
    assert plans.switch(bucket, 0, 0) == (made, True)


def test_a_plan_is_ready_once_its_own_blocks_are_pinned() -> None:
    # Readiness is asked per plan: the first plan does not wait behind the blocks of the buckets
    # queued after it (the probe steps' lengths), nor they behind it.
    import concurrent.futures

    from offload.planner.ahead import Made, PlansAhead, StandIn

    plans_made = [Made(object(), 0, None, 0.0) for _ in range(2)]  # type: ignore[arg-type]
    pinned = {id(plans_made[1].plan)}
    # (each plan's one "region" stands for the plan: pinned once its plan is in ``pinned``)
    plans = PlansAhead(lambda plan: [id(plan)], lambda sizes: sizes[0] in pinned)
    for made, length in zip(plans_made, (32, 64)):
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(made)
        bucket = StepShape(2, length)
        plans.started.append(ahead._Entry(bucket, future, stand_in=StandIn(None, "test", bucket)))  # type: ignore[arg-type]
    plans.poll()
    assert [e.ready for e in plans.started] == [False, True]
    pinned.add(id(plans_made[0].plan))
    plans.poll()
    assert [e.ready for e in plans.started] == [True, True]
