"""Plans keep being followed, whatever the life of the context (issue 32, defects 2, 3, 5, 6).

- A context that was closed follows its plan again when entered again; a second context on the
  same layers follows its own plan, whether the first is alive, closed or garbage collected.
- A layer called by keyword (``layer(hidden_states=h)``) has its inputs counted by the probe and
  offloaded when recomputed, exactly as when called positionally.
- A plan saved with ``to_dict`` (through JSON) can be followed after ``from_dict``.
- ``offload.plan`` with a step of several micro-batches plans one micro-batch.

Every step's gradients are compared bit for bit with the plain step's.
"""

from __future__ import annotations

import dataclasses
import gc
import json

import pytest
import torch

import offload
from offload.planner import Action, LayerPlan, Plan, profile_step
from _util import assert_bitwise
from test_low_memory_probe_cpu import LINK, MLP

class Block(torch.nn.Module):
    """An HF-style layer: its input is called ``hidden_states`` and it has an ``mlp``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.mix = torch.nn.Linear(hidden, hidden)
        self.mlp = MLP(hidden)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states + torch.tanh(self.mix(self.norm(hidden_states)))
        return x + self.mlp(x)


class Stack(torch.nn.Module):
    def __init__(self, n: int = 4, hidden: int = 32, by_keyword: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(Block(hidden) for _ in range(n))
        self.by_keyword = by_keyword

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 1.0  # layer 0's input is an activation, not the leaf input
        for layer in self.layers:
            x = layer(hidden_states=x) if self.by_keyword else layer(x)
        return x


def grads(model: Stack, x: torch.Tensor, context: object = None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    if context is None:
        out = model(x)
    else:
        with context:  # type: ignore[attr-defined]
            out = model(x)
    (out ** 2).mean().backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def plain(model: Stack, x: torch.Tensor) -> list[torch.Tensor]:
    expected = grads(model, x)
    assert_bitwise(expected, grads(model, x))  # the plain step repeats itself
    return expected


def made_plan(model: Stack, x: torch.Tensor, actions: list[LayerPlan]) -> Plan:
    """A plan with the given per-layer actions and a real profile of ``model``."""
    made = offload.plan(model.layers, lambda: grads(model, x), "lowest", device="cpu", min_offload_bytes=0,
                        link=LINK)
    return dataclasses.replace(made, layers=tuple(actions))


MIXED = [LayerPlan(Action.RECOMPUTE), LayerPlan(Action.OFFLOAD, selective=True),
         LayerPlan(Action.KEEP, selective=True), LayerPlan(Action.KEEP)]


@pytest.fixture
def setup() -> tuple[Stack, torch.Tensor, list[torch.Tensor], Plan]:
    model, x = Stack(), torch.randn(4, 16, 32)
    return model, x, plain(model, x), made_plan(model, x, MIXED)


def followed(model: Stack, x: torch.Tensor, expected: list[torch.Tensor], oa: offload.OffloadActivations) -> int:
    """One step under ``oa``: bitwise gradients; returns the bytes it offloaded."""
    assert_bitwise(expected, grads(model, x, oa))
    return oa.stats["offloaded_bytes"]


# -- defect 2: close(), a second context, a dead one ------------------------------------------------------
def test_a_closed_context_follows_its_plan_again(setup) -> None:
    model, x, expected, plan = setup
    oa = offload.OffloadActivations(model.layers, plan=plan, device="cpu", min_offload_bytes=0)
    first = followed(model, x, expected, oa)
    oa.close()
    assert all("forward" not in m.__dict__ for m in model.modules()), "close() left a wrapper on"
    assert followed(model, x, expected, oa) == first, "after close(), the plan's recompute and selective were dropped"
    oa.close()


def test_a_second_context_follows_its_plan_while_the_first_is_alive_closed_or_dead(setup) -> None:
    model, x, expected, plan = setup
    first = offload.OffloadActivations(model.layers, plan=plan, device="cpu", min_offload_bytes=0)
    bytes_planned = followed(model, x, expected, first)
    second = offload.OffloadActivations(model.layers, plan=plan, device="cpu", min_offload_bytes=0)
    assert followed(model, x, expected, second) == bytes_planned
    first.close()  # the wrappers stay for the second context
    assert followed(model, x, expected, second) == bytes_planned
    second.close()
    # A context that dies without close() leaves wrappers whose context is gone: a new context
    # must take them over, not skip the modules that carry them.
    dead = offload.OffloadActivations(model.layers, plan=plan, device="cpu", min_offload_bytes=0)
    followed(model, x, expected, dead)
    del dead
    gc.collect()
    third = offload.OffloadActivations(model.layers, plan=plan, device="cpu", min_offload_bytes=0)
    assert followed(model, x, expected, third) == bytes_planned
    third.close()
    assert all("forward" not in m.__dict__ for m in model.modules())


# -- defect 3: layers called by keyword -------------------------------------------------------------------
def test_layers_called_by_keyword_have_their_inputs_counted_and_offloaded() -> None:
    x = torch.randn(4, 16, 32)
    positional, keyword = Stack(), Stack(by_keyword=True)
    keyword.load_state_dict(positional.state_dict())
    expected = plain(positional, x)
    assert_bitwise(expected, plain(keyword, x))
    counted = {}
    for name, model in (("positional", positional), ("keyword", keyword)):
        profile = profile_step(model.layers, lambda: grads(model, x), device="cpu", min_offload_bytes=0, link=LINK)
        counted[name] = [layer.input_bytes for layer in profile.layers]
    assert counted["keyword"] == counted["positional"] and all(b == 4 * 16 * 32 * 4 for b in counted["keyword"])
    offloaded = {}
    for name, model in (("positional", positional), ("keyword", keyword)):
        plan = made_plan(model, x, [LayerPlan(Action.RECOMPUTE)] * 3 + [LayerPlan(Action.KEEP)])
        oa = offload.OffloadActivations(model.layers, plan=plan, device="cpu", min_offload_bytes=0)
        offloaded[name] = followed(model, x, expected, oa)
        oa.close()
    # The three recomputed layers' checkpoint inputs go to the host in both call shapes.
    assert offloaded["keyword"] == offloaded["positional"] >= 3 * 4 * 16 * 32 * 4


def test_the_low_memory_probe_counts_keyword_inputs_as_the_plain_probe_does() -> None:
    model, x = Stack(by_keyword=True), torch.randn(4, 16, 32)
    got = {mode: profile_step(model.layers, lambda: grads(model, x), device="cpu", min_offload_bytes=0,
                              link=LINK, probe=mode) for mode in ("plain", "recompute")}
    for p, r in zip(got["plain"].layers, got["recompute"].layers):
        assert p.input_bytes == r.input_bytes > 0
        assert sorted(p.slot_bytes) == sorted(r.slot_bytes)


# -- defect 5: a saved plan --------------------------------------------------------------------------------
def test_a_plan_saved_as_json_is_followed_like_the_original(setup) -> None:
    model, x, expected, plan = setup
    loaded = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert loaded == plan and loaded.profile == plan.profile and loaded.table() == plan.table()
    bytes_moved = []
    for p in (plan, loaded):
        oa = offload.OffloadActivations(model.layers, plan=p, device="cpu", min_offload_bytes=0)
        bytes_moved.append(followed(model, x, expected, oa))
        oa.close()
    assert bytes_moved[0] == bytes_moved[1] > 0


def test_a_plan_saved_without_its_profile_says_how_to_get_a_usable_one(setup) -> None:
    model, _, _, plan = setup
    old = plan.to_dict()
    del old["profile"]  # as an older version saved it
    with pytest.raises(ValueError, match="offload.plan"):
        offload.OffloadActivations(model.layers, plan=Plan.from_dict(old), device="cpu")


# -- defect 6: micro-batches --------------------------------------------------------------------------------
def test_offload_plan_with_micro_batches_plans_one_micro_batch() -> None:
    model, x = Stack(), torch.randn(8, 16, 32)
    micro = list(x.chunk(2))
    expected = [plain(model, m) for m in micro]
    seen = []

    def step_fn() -> None:  # gradient accumulation: two forwards and backwards
        for m in micro:
            seen.append(grads(model, m))

    made = offload.plan(model.layers, step_fn, "lowest", device="cpu", min_offload_bytes=0, link=LINK)
    assert len(made.layers) == len(model.layers) == len(made.profile.layers)
    # The profile is one micro-batch's: each layer's input is one micro-batch of hidden states.
    assert all(layer.input_bytes == 4 * 16 * 32 * 4 for layer in made.profile.layers)
    for i, g in enumerate(seen):  # the probe steps changed no gradient
        assert_bitwise(expected[i % 2], g)
    oa = offload.OffloadActivations(model.layers, plan=made, device="cpu", min_offload_bytes=0)
    for m, e in zip(micro, expected):
        assert_bitwise(e, grads(model, m, oa))
    oa.close()


def test_offload_plan_refuses_a_step_whose_forwards_all_run_before_their_backwards() -> None:
    model, x = Stack(), torch.randn(8, 16, 32)

    def step_fn() -> None:
        losses = [(model(m) ** 2).mean() for m in x.chunk(2)]
        sum(losses).backward()

    with pytest.raises(RuntimeError, match="one micro-batch, forward and backward"):
        offload.plan(model.layers, step_fn, "lowest", device="cpu", min_offload_bytes=0, link=LINK)
    assert all("forward" not in m.__dict__ for m in model.modules()), "the failed probe left a wrapper"
