"""Plans on CPU: probing, following a plan (keep / offload / partial / recompute) bit for bit,
planning on the first step of a budget, a tiny HF Llama, and the errors of bad input."""

from __future__ import annotations

import dataclasses
import itertools
import warnings

import pytest
import torch
from torch import nn

import offload
from offload.models import run_layers
from offload.planner import Action, BudgetError, LayerPlan, plan_for

from _util import assert_bitwise, llama_grads, make_gpt_layers, oa_step, tiny_llama, train_step



@pytest.fixture
def gpt() -> tuple[nn.ModuleList, torch.Tensor]:
    return make_gpt_layers(n=4), torch.randn(2, 16, 64)


def probe(layers: nn.ModuleList, x: torch.Tensor, budget: object = "lowest") -> offload.planner.Plan:
    return offload.plan(layers, lambda: train_step(layers, x), budget, device="cpu", min_offload_bytes=0)


def measure(layers: nn.ModuleList, x: torch.Tensor) -> offload.planner.StepProfile:
    return offload.planner.profile_step(layers, lambda: train_step(layers, x), device="cpu", min_offload_bytes=0)


def test_probe_measures_every_layer(gpt) -> None:
    layers, x = gpt
    plan = probe(layers, x)
    profile = plan.profile
    assert len(profile.layers) == 4 and profile.device == "cpu"
    for layer in profile.layers:
        assert layer.saved_bytes > 10 * x.nbytes  # a GPT block saves many activations
        assert layer.input_bytes == x.nbytes
        assert layer.forward_ms > 0 and layer.backward_ms > 0
    # The lowest-memory plan recomputes (or offloads) every layer but keeps nothing big.
    assert plan.prediction.peak_bytes < profile.plain_peak_bytes / 3


ACTIONS = [LayerPlan(Action.KEEP), LayerPlan(Action.OFFLOAD), LayerPlan(Action.RECOMPUTE)]


@pytest.mark.parametrize("actions", list(itertools.product(ACTIONS, repeat=2)))
def test_every_plan_is_bitwise_exact(gpt, actions) -> None:
    layers, x = gpt
    expected = train_step(layers, x)
    profile = measure(layers, x)
    made = plan_for(profile, [actions[0], actions[1], actions[0], LayerPlan(Action.KEEP)])
    oa = offload.OffloadActivations(layers, plan=made, device="cpu", min_offload_bytes=0)
    for _ in range(2):
        assert_bitwise(expected, oa_step(layers, x, oa))
    stats = oa.stats
    recomputed = [i for i, a in enumerate(made.layers) if a.action is Action.RECOMPUTE]
    offloaded = [i for i, a in enumerate(made.layers) if a.action is Action.OFFLOAD]
    # A recomputed layer moves only its input (layer 0's input is the leaf x: kept); an
    # offloaded layer moves all its saved activations.
    expected_bytes = sum(x.nbytes for i in recomputed if i > 0) + sum(profile.layers[i].saved_bytes for i in offloaded)
    assert stats["offloaded_bytes"] == expected_bytes, (made.describe(), stats)
    assert oa.engine.schedule.name == "planned"
    oa.close()
    assert all("forward" not in m.__dict__ for m in layers)


def test_partial_offload_moves_only_large_slots(gpt) -> None:
    layers, x = gpt
    expected = train_step(layers, x)
    profile = measure(layers, x)
    floor = sorted(set(profile.layers[1].slot_bytes))[-1]  # the largest slots only
    made = plan_for(profile, [LayerPlan(Action.KEEP), LayerPlan(Action.OFFLOAD, floor), LayerPlan(Action.KEEP), LayerPlan(Action.KEEP)])
    oa = offload.OffloadActivations(layers, plan=made, device="cpu", min_offload_bytes=0)
    assert_bitwise(expected, oa_step(layers, x, oa))
    big = sum(s for s in profile.layers[1].slot_bytes if s >= floor)
    assert oa.stats["offloaded_bytes"] == big < profile.layers[1].saved_bytes


def test_budget_plans_after_warm_up_calibration_and_probe(gpt) -> None:
    layers, x = gpt
    expected = train_step(layers, x)
    plain = measure(layers, x).plain_peak_bytes
    oa = offload.OffloadActivations(layers, memory_budget_bytes=plain // 2, device="cpu", min_offload_bytes=0)
    for _ in range(3):  # warm-up, calibration (one layer recomputed), probe: no offload
        assert_bitwise(expected, oa_step(layers, x, oa))
        assert oa.plan is None and oa.stats["offloaded_tensors"] == 0
    for _ in range(2):
        assert_bitwise(expected, oa_step(layers, x, oa))
    assert oa.plan is not None and oa.plan.prediction.peak_bytes <= plain // 2
    assert oa.stats["offloaded_bytes"] > 0
    assert oa.measured is not None and oa.measured["step_ms"] > 0  # the entry closes a step's figures
    table = oa.plan_report()
    assert "measured" in table and "predicted" in table


def test_budget_below_the_lowest_peak_names_it(gpt) -> None:
    layers, x = gpt
    with pytest.raises(BudgetError, match=r"lowest peak reachable"):
        probe(layers, x, 1024)


def test_plan_for_another_model_is_refused(gpt) -> None:
    layers, x = gpt
    made = probe(layers, x)
    with pytest.raises(ValueError, match="made for 4 layers, but 3"):
        offload.OffloadActivations(layers[:3], plan=made, device="cpu")


def test_bad_budgets_and_probe_failures(gpt) -> None:
    layers, x = gpt
    with pytest.raises(ValueError, match="no layers"):
        offload.plan([], lambda: None, 1 << 20, device="cpu")
    with pytest.raises(ValueError, match="memory_budget_bytes must be a number of bytes from 1 "):
        offload.OffloadActivations(layers, memory_budget_bytes=-5, device="cpu")
    with pytest.raises(ValueError, match="not both"):
        offload.OffloadActivations(layers, num_offload_layers=2, memory_budget_bytes=1 << 20, device="cpu")

    def broken() -> None:
        raise KeyError("boom")

    with pytest.raises(RuntimeError, match="probe step raised KeyError"):
        offload.plan(layers, broken, 1 << 20, device="cpu")
    with pytest.raises(ValueError, match="ran none of the given layers"):
        offload.plan(layers, lambda: None, 1 << 20, device="cpu")


def test_hf_llama_plan_on_cpu() -> None:
    pytest.importorskip("transformers")
    model, ids = tiny_llama(4)

    def step(oa: object = None) -> list[torch.Tensor]:
        return llama_grads(model, ids, oa)

    expected = step()
    assert_bitwise(expected, step())
    made = offload.plan(model.model.layers, step, "lowest", device="cpu", min_offload_bytes=0)
    assert {lp.action for lp in made.layers} != {Action.KEEP}
    oa = offload.OffloadActivations(model.model.layers, plan=made, device="cpu", min_offload_bytes=0)
    for _ in range(2):
        assert_bitwise(expected, step(oa))
    assert oa.stats["offloaded_bytes"] > 0
    print(made.table())


class _Exp(nn.Module):
    """Saves a mask that needs no gradient (so no alias of it is made) and remembers it weakly."""

    seen: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = (x > 0).to(x.dtype)
        _Exp.seen.append(__import__("weakref").ref(mask))
        return x * mask + x


def test_probe_holds_no_saved_tensor_during_backward() -> None:
    # The probe step is plain: what backward has finished with must be freed as it goes, or
    # every reading of memory in backward is off by the activations (it was, by 1.7 GiB a layer).
    layers = nn.ModuleList(_Exp() for _ in range(3))
    x = torch.randn(64, 64)
    freed_before_end: list[bool] = []

    def step() -> None:
        _Exp.seen = []
        h = x.requires_grad_(True) * 1.0
        for layer in layers:
            h = layer(h)
        h.sum().backward()
        del h
        freed_before_end.append(all(r() is None for r in _Exp.seen))

    offload.planner.profile_step(layers, step, device="cpu", min_offload_bytes=0, warmup_steps=0)
    assert freed_before_end == [True]


def test_plan_followed_at_another_shape_is_planned_for_it(gpt) -> None:
    # A plan carries its profile and the shape it was measured at: a batch of another length
    # gets a plan of its own, whose figures are what that step saves (no "plan was made for"
    # warning), and the gradients stay exact.
    layers, x = gpt
    profile = measure(layers, x)
    made = plan_for(profile, [LayerPlan(Action.OFFLOAD)] * 3 + [LayerPlan(Action.KEEP)])
    oa = offload.OffloadActivations(layers, plan=made, device="cpu", min_offload_bytes=0)
    longer = torch.randn(2, 32, 64)  # twice the sequence the plan was made for
    expected = train_step(layers, longer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_bitwise(expected, oa_step(layers, longer, oa))
    assert oa.plan.profile.shape == (2, 32) and oa.plan is not made


def test_plan_without_a_shape_warns_at_other_shapes(gpt) -> None:
    # A profile that does not say its shape (an older version's) plans its own shape only: at
    # another one the runtime says that the plan's figures no longer hold.
    layers, x = gpt
    profile = dataclasses.replace(measure(layers, x), shape=None)
    made = plan_for(profile, [LayerPlan(Action.OFFLOAD)] * 3 + [LayerPlan(Action.KEEP)])
    oa = offload.OffloadActivations(layers, plan=made, device="cpu", min_offload_bytes=0)
    longer = torch.randn(2, 32, 64)
    expected = train_step(layers, longer)
    with pytest.warns(UserWarning, match="layer 0 saved .* but the plan was made for"):
        assert_bitwise(expected, oa_step(layers, longer, oa))  # still exact


def test_planned_schedule_counts_the_gradients_backward_has_made() -> None:
    # The budget accounting in backward counts the head's leftovers and the weight gradients of
    # every layer whose backward is done (above the one backward has reached).
    from types import SimpleNamespace

    from offload.planner import LayerProfile, LinkProfile, StepProfile
    from offload.engine.schedules.planned import PlannedSchedule
    from offload.engine.step import StepGroups

    layers = tuple(LayerProfile((1000,), 10, 1.0, 2.0, "l", grad_bytes=g) for g in (1, 20, 300, 4000))
    profile = StepProfile(layers, LinkProfile(1.0, 1.0, 2.0), 0, 0, 0.0, 0.0, 0.0, 10.0, 5000, "cuda",
                          head_residual_bytes=50000)
    schedule = PlannedSchedule(plan_for(profile, [LayerPlan(Action.KEEP)] * 4), profile)
    engine = SimpleNamespace(step=SimpleNamespace(index=1, groups=StepGroups()), in_flight=(), transport=None)
    seen = []
    for layer in (3, 2, 1, 0):
        schedule.on_backward_reach(engine, engine.step, layer)
        seen.append(schedule.grads)
    assert seen == [50000, 54000, 54300, 54320]
