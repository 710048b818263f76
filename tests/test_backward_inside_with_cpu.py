"""``loss.backward()`` inside ``with oa:`` (issue 48, section 5): harmless, the same gradients bit
for bit and the same figures as the backward after the ``with``; a second ``with`` around the
backward alone is a mistake the warnings (and, while probing, the error) name."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch

import offload
from offload.models import run_layers
from offload.planner import Action, LayerPlan, plan_for

from _util import assert_bitwise, make_gpt_layers, train_step

FIGURES = ("offloaded_tensors", "offloaded_bytes", "released_bytes", "groups_offloaded", "reloads", "kept")


pytestmark = pytest.mark.usefixtures("deterministic")


def _grads(layers: torch.nn.ModuleList, xin: torch.Tensor) -> list[torch.Tensor]:
    return [p.grad.clone() for p in layers.parameters()] + [xin.grad.clone()]


def _fresh(layers: torch.nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    # No gradients left from the step before; the input a leaf that takes its own.
    layers.zero_grad(set_to_none=True)
    return x.detach().requires_grad_(True)


def _inside(layers: torch.nn.ModuleList, x: torch.Tensor, oa: Any) -> list[torch.Tensor]:
    xin = _fresh(layers, x)
    with oa:
        out = run_layers(layers, xin)
        (out.float() ** 2).mean().backward()
    return _grads(layers, xin)


def _after(layers: torch.nn.ModuleList, x: torch.Tensor, oa: Any) -> list[torch.Tensor]:
    xin = _fresh(layers, x)
    with oa:
        out = run_layers(layers, xin)
    (out.float() ** 2).mean().backward()
    return _grads(layers, xin)


def _separate(layers: torch.nn.ModuleList, x: torch.Tensor, oa: Any) -> list[torch.Tensor]:
    xin = _fresh(layers, x)
    with oa:
        out = run_layers(layers, xin)
    with oa:  # the mistake: a second `with`, around the backward alone
        (out.float() ** 2).mean().backward()
    return _grads(layers, xin)


def _fixed(layers: torch.nn.ModuleList, x: torch.Tensor) -> dict[str, Any]:
    return {"num_offload_layers": 3}


def _plan(layers: torch.nn.ModuleList, x: torch.Tensor) -> dict[str, Any]:
    # Offloaded, recomputed (its checkpoint recomputes the layer inside the backward, so inside
    # the `with`), partly offloaded and kept layers.
    profile = offload.planner.profile_step(layers, lambda: train_step(layers, x), device="cpu", min_offload_bytes=0)
    floor = sorted(set(profile.layers[2].slot_keys))[-1]
    actions = [LayerPlan(Action.OFFLOAD), LayerPlan(Action.RECOMPUTE), LayerPlan(Action.OFFLOAD, floor),
               LayerPlan(Action.KEEP)]
    return {"plan": plan_for(profile, actions)}


@pytest.mark.parametrize("options", [_fixed, _plan], ids=["fixed", "plan"])
def test_a_backward_inside_the_forwards_with_is_harmless(options: Callable[..., dict[str, Any]]) -> None:
    layers, x = make_gpt_layers(4), torch.randn(2, 16, 64)
    expected = train_step(layers, x)
    assert_bitwise(expected, train_step(layers, x))  # the plain run repeats itself
    kwargs = options(layers, x)
    figures = {}
    for name, step in (("after", _after), ("inside", _inside)):
        oa = offload.OffloadActivations(layers, device="cpu", min_offload_bytes=0, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(3):
                assert_bitwise(expected, step(layers, x, oa))
        stats = oa.stats
        assert stats["finished"] and stats["offloaded_bytes"] > 0
        figures[name] = {key: stats[key] for key in FIGURES}
        oa.close()
    assert figures["inside"] == figures["after"]


def test_a_backward_inside_the_forwards_with_is_harmless_while_probing() -> None:
    layers, x = make_gpt_layers(4), torch.randn(2, 16, 64)
    expected = train_step(layers, x)
    oa = offload.OffloadActivations(layers, memory_budget_bytes="lowest", device="cpu", min_offload_bytes=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(5):  # the probe steps, then planned ones
            assert_bitwise(expected, _inside(layers, x, oa))
    assert oa.plan is not None


def test_a_with_around_the_backward_alone_is_named_in_the_warning() -> None:
    layers, x = make_gpt_layers(4), torch.randn(2, 16, 64)
    expected = train_step(layers, x)
    oa = offload.OffloadActivations(layers, num_offload_layers=3, device="cpu", min_offload_bytes=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert_bitwise(expected, _separate(layers, x, oa))  # still exact
    said = [str(w.message) for w in caught]
    assert said, "a `with` around the backward alone passed silently"
    for message in said:
        assert "backward" in message and "around the forward only" in message, message


def test_a_with_around_the_backward_alone_is_named_in_the_probes_error() -> None:
    layers, x = make_gpt_layers(4), torch.randn(2, 16, 64)
    oa = offload.OffloadActivations(layers, memory_budget_bytes="lowest", device="cpu", min_offload_bytes=0)
    with pytest.raises(ValueError, match=r"held the backward.*around the forward only"):
        for _ in range(3):
            _separate(layers, x, oa)
