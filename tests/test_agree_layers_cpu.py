"""The ranks' own plans made to recompute the same layers and keep attention in the same ones
(``offload.planner.agree.follow_layers``; the collective itself, on two gloo processes, is in
``tests/distributed/test_plan_ahead_ranks_cpu.py``): never more memory than the rank's own plan."""

from __future__ import annotations

import torch

import offload
from offload.planner import Action, LayerPlan, plan_for
from offload.planner.agree import agree_layers, follow_layers
from offload.planner.layer_costs import held_bytes, offloaded_bytes, resident_bytes

from _util import make_gpt_layers, train_step

K, O, R = LayerPlan(Action.KEEP), LayerPlan(Action.OFFLOAD), LayerPlan(Action.RECOMPUTE)
RA = LayerPlan(Action.RECOMPUTE, keep_attention=True)


def test_a_plan_follows_the_agreed_layers_without_holding_more() -> None:
    layers, x = make_gpt_layers(4, 64, 4), torch.randn(2, 32, 64)
    profile = offload.planner.profile_step(layers, lambda: train_step(layers, x), device="cpu", min_offload_bytes=0)
    own = plan_for(profile, [K, O, RA, RA], budget_bytes=profile.plain_peak_bytes)
    # Another rank recomputes layers 0 and 1, and keeps attention in layer 3 only.
    agreed = follow_layers(own, [True, True, True, True], [False, False, False, True])
    assert agreed.layers == (LayerPlan(Action.RECOMPUTE, keep_inputs=True), R, R, RA)
    for layer, mine, theirs in zip(profile.layers, own.layers, agreed.layers):
        assert held_bytes(layer, theirs) <= held_bytes(layer, mine)
        assert resident_bytes(layer, theirs) <= resident_bytes(layer, mine)
        assert offloaded_bytes(layer, theirs) <= offloaded_bytes(layer, mine)
    assert agreed.prediction.peak_bytes <= own.prediction.peak_bytes
    assert agreed.prediction == offload.planner.simulate(profile, list(agreed.layers), own.budget_bytes)
    # Nothing to change: the plan itself, not a copy.
    assert follow_layers(own, [False, False, True, True], [False, False, True, True]) is own


def test_without_a_process_group_the_layers_are_this_ranks_own() -> None:
    assert agree_layers([True, False], [True, False], torch.device("cpu")) == ([True, False], [True, False])
