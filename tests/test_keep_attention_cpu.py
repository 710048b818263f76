"""Recomputed layers that keep attention's outputs (``LayerPlan.keep_attention``), on the CPU: the
probe counts what attention outputs, the cost model holds it and takes attention out of the
recompute, the recompute really skips the attention kernel, gradients stay bitwise the plain
run's, and the search takes the variant only where it is predicted faster and fits."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import offload
from offload.planner import Action, LayerPlan, LinkProfile, Plan, plan_for
from offload.planner import make as make_mod
from offload.planner.layer_costs import backward_cost_ms, held_bytes, offloaded_bytes, resident_bytes
from offload.planner.make import best_recomputing
from offload.planner.search import best_plan

from _util import assert_bitwise, attention_kernels_in_backward, make_gpt_layers, oa_step, plain_reference, train_step

pytestmark = pytest.mark.usefixtures("deterministic")

R, RA = LayerPlan(Action.RECOMPUTE), LayerPlan(Action.RECOMPUTE, keep_attention=True)
B, T, H, HEADS = 2, 32, 64, 4


def _profile(layers: torch.nn.ModuleList, x: torch.Tensor) -> Any:
    return offload.planner.profile_step(layers, lambda: train_step(layers, x), device="cpu", min_offload_bytes=0)


def test_the_probe_counts_what_attention_outputs() -> None:
    layers, x = make_gpt_layers(3, H, HEADS), torch.randn(B, T, H)
    profile = _profile(layers, x)
    # float32 output (B, heads, T, H / heads) and a float32 logsumexp per query row and head
    expected = B * T * H * 4 + B * HEADS * T * 4
    assert [layer.attention_bytes for layer in profile.layers] == [expected] * 3
    assert all(0 < layer.attention_forward_ms <= layer.forward_ms for layer in profile.layers)
    # scaled to another shape with the tokens
    longer = offload.planner.scaling.profile_at(profile, offload.planner.shapes.StepShape(B, 2 * T))
    assert longer.layers[0].attention_bytes == 2 * expected


def test_the_cost_model_holds_the_outputs_and_skips_attention_in_the_recompute() -> None:
    layer = _profile(make_gpt_layers(2, H, HEADS), torch.randn(B, T, H)).layers[0]
    assert held_bytes(layer, RA) == layer.input_bytes + layer.attention_bytes
    assert offloaded_bytes(layer, RA) == offloaded_bytes(layer, R) == layer.input_bytes
    assert resident_bytes(layer, RA) == layer.attention_bytes and resident_bytes(layer, R) == 0
    kept_inputs = LayerPlan(Action.RECOMPUTE, keep_inputs=True, keep_attention=True)
    assert resident_bytes(layer, kept_inputs) == layer.input_bytes + layer.attention_bytes
    skipped = backward_cost_ms(layer, R, 1.5) - backward_cost_ms(layer, RA, 1.5)
    assert skipped == pytest.approx(1.5 * layer.attention_forward_ms)


def test_the_plan_type_checks_saves_and_describes_kept_attention() -> None:
    with pytest.raises(ValueError, match="keep_attention applies to RECOMPUTE only"):
        LayerPlan(Action.KEEP, keep_attention=True)
    with pytest.raises(ValueError, match="runs untiled"):
        LayerPlan(Action.RECOMPUTE, keep_attention=True, tile_tokens=64)
    with pytest.raises(ValueError, match="keep_attention must be a bool"):
        LayerPlan(Action.RECOMPUTE, keep_attention=1)  # type: ignore[arg-type]
    layers, x = make_gpt_layers(3, H, HEADS), torch.randn(B, T, H)
    plan = plan_for(_profile(layers, x), [RA, LayerPlan(Action.RECOMPUTE, keep_inputs=True), LayerPlan(Action.KEEP)])
    assert plan.describe() == "keep 1, recompute 2 (1 inputs kept, 1 attention kept)"
    assert "recompute, attention kept" in plan.table()
    data = plan.to_dict()
    assert Plan.from_dict(data).layers == plan.layers
    data["layers"] = [row[:5] for row in data["layers"]]  # saved before kept attention existed
    assert [lp.keep_attention for lp in Plan.from_dict(data).layers] == [False] * 3


@pytest.mark.parametrize("keep", [False, True])
def test_recomputed_layers_keeping_attention_are_bitwise_and_skip_the_kernel(keep: bool) -> None:
    layers, x = make_gpt_layers(4, H, HEADS), torch.randn(B, T, H)
    expected = plain_reference(layers, x)
    rec = RA if keep else R
    plan = plan_for(_profile(layers, x), [rec, rec, LayerPlan(Action.OFFLOAD), LayerPlan(Action.KEEP)])
    oa = offload.OffloadActivations(layers, plan=plan, device="cpu", min_offload_bytes=0)
    for _ in range(2):
        assert_bitwise(expected, oa_step(layers, x, oa))
    # The backward alone: the two recomputed layers run attention again unless they keep it.
    assert attention_kernels_in_backward(layers, x, oa) == (0 if keep else 2)
    oa.close()


def _attention_heavy(profile: Any, share: float, scale_bytes: float = 1.0) -> Any:
    # The measured profile with attention taking ``share`` of each layer's forward (CPU timings
    # make the real share whatever the host gives), and its outputs ``scale_bytes`` as large.
    # Fixed times (the host's would make the search's choices vary from run to run), and a slow
    # link, so that the budget is met by recomputing rather than by copies.
    layers = tuple(dataclasses.replace(layer, forward_ms=1.0, backward_ms=2.0, attention_forward_ms=share,
                                       attention_backward_ms=0.0,
                                       attention_bytes=int(layer.attention_bytes * scale_bytes))
                   for layer in profile.layers)
    return dataclasses.replace(profile, layers=layers, link=LinkProfile(0.1, 0.1, 0.1), pre_ms=0.1, head_ms=0.5,
                               post_ms=0.1)


def test_the_search_keeps_attention_where_it_is_faster_and_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    profile = _profile(make_gpt_layers(4, H, HEADS), torch.randn(B, T, H))
    heavy = _attention_heavy(profile, 0.8)
    lowest = offload.planner.lowest_peak(heavy, tolerance=0.0)
    budget = lowest.prediction.peak_bytes + 4 * heavy.layers[0].attention_bytes + 1
    plain = best_plan(heavy, budget)
    assert any(lp.action is Action.RECOMPUTE for lp in plain.layers)  # the budget makes it recompute
    made = best_recomputing(heavy, budget, 0.04, None, None)
    recomputed = [lp for lp in made.layers if lp.action is Action.RECOMPUTE]
    assert recomputed and all(lp.keep_attention for lp in recomputed)
    assert made.prediction.step_ms < plain.prediction.step_ms and made.prediction.peak_bytes <= budget
    # Outputs too large to hold at that budget: the plain search's plan.
    assert best_recomputing(_attention_heavy(profile, 0.8, 1e4), budget, 0.04, None, None).layers == \
        best_plan(_attention_heavy(profile, 0.8, 1e4), budget).layers
    # Attention under the share worth a second search: no second search at all.
    searches: list[bool] = []
    real = make_mod.best_plan
    monkeypatch.setattr(make_mod, "best_plan", lambda *a, **k: searches.append(k.get("keep_attention", False)) or real(*a, **k))
    best_recomputing(_attention_heavy(profile, 0.001), budget, 0.04, None, None)
    assert searches == [False]
    best_recomputing(heavy, budget, 0.04, None, None)
    assert searches == [False, False, True]
    # A tiled variant's plans are never searched with kept attention (tiled MLPs run untiled there).
    best_recomputing(heavy, budget, 0.04, None, None, untiled=False)
    assert searches == [False, False, True, False]


def test_the_variant_is_searched_without_the_models_tolerance(monkeypatch: pytest.MonkeyPatch) -> None:
    # Over its budget, the kept-attention search must be left out (BudgetError), not fall back to
    # the lowest plan with a warning: that is the plain search's answer.
    profile = _attention_heavy(_profile(make_gpt_layers(4, H, HEADS), torch.randn(B, T, H)), 0.8)
    budget = offload.planner.lowest_peak(profile, tolerance=0.0).prediction.peak_bytes + 4 * profile.layers[0].attention_bytes
    errors: list[tuple[bool, float]] = []
    real = make_mod.best_plan
    monkeypatch.setattr(make_mod, "best_plan", lambda p, b, e, **k: errors.append((k.get("keep_attention", False), e))
                        or real(p, b, e, **k))
    best_recomputing(profile, budget, 0.04, None, None)
    assert errors == [(False, 0.04), (True, 0.0)]


def test_attention_run_as_torchs_context_parallel_ring_is_not_offered_to_keep(monkeypatch: pytest.MonkeyPatch) -> None:
    # SDPA patched by torch.distributed (context parallelism's monkey-patching mode): the probe
    # times it as attention but records no bytes, so no plan keeps it (not run on GPUs yet).
    real = torch.nn.functional.scaled_dot_product_attention

    def ring_like(*args: Any, **kwargs: Any) -> Any:
        return real(*args, **kwargs)

    ring_like.__module__ = "torch.distributed.tensor.experimental._context_parallel._attention"
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", ring_like)
    profile = _profile(make_gpt_layers(3, H, HEADS), torch.randn(B, T, H))
    assert all(layer.attention_forward_ms > 0 and layer.attention_bytes == 0 for layer in profile.layers)
    heavy = _attention_heavy(profile, 0.8)
    budget = offload.planner.lowest_peak(heavy, tolerance=0.0).prediction.peak_bytes + (1 << 20)
    assert not any(lp.keep_attention for lp in best_recomputing(heavy, budget, 0.04, None, None).layers)


def test_compiled_layers_keeping_attention_are_bitwise() -> None:
    # Each layer compiled (aot_eager): the recompute's policy goes through the checkpoint as a plain
    # context function, which the compiled region accepts.
    layers, x = make_gpt_layers(4, H, HEADS), torch.randn(B, T, H)
    profile = _profile(layers, x)
    compiled = torch.nn.ModuleList(torch.compile(layer, backend="aot_eager") for layer in layers)
    expected = plain_reference(compiled, x)
    oa = offload.OffloadActivations(compiled, plan=plan_for(profile, [RA, RA, LayerPlan(Action.OFFLOAD), LayerPlan(Action.KEEP)]),
                                    device="cpu", min_offload_bytes=0)
    for _ in range(2):
        assert_bitwise(expected, oa_step(compiled, x, oa))
    assert oa.stats["offloaded_bytes"] > 0
    oa.close()
