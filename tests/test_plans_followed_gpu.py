"""Plans on the GPU (issue 32): layers called by keyword really give their checkpoint inputs to
the host, micro-batched planning and planning a compiled model are exact, and a context stays
usable after a BudgetError. Gradients bit for bit against the plain step; memory read from the
allocator."""

from __future__ import annotations

import dataclasses
import gc
import sys

import pytest
import torch

import offload
from offload.planner import Action, BudgetError, LayerPlan

from _util import assert_bitwise
from test_context_errors_cpu import compiled_steps
from test_plans_followed_cpu import Stack, grads, plain

pytestmark = pytest.mark.cuda

HIDDEN, TOKENS = 1024, 4 * 512


def cuda_stack(by_keyword: bool) -> tuple[Stack, torch.Tensor]:
    model = Stack(n=6, hidden=HIDDEN, by_keyword=by_keyword).cuda()
    torch.manual_seed(1)
    return model, torch.randn(4, 512, HIDDEN, device="cuda")


@pytest.fixture(autouse=True)
def _clean() -> None:
    yield
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def test_keyword_layers_offload_their_checkpoint_inputs_on_the_gpu() -> None:
    model, x = cuda_stack(by_keyword=True)
    expected = plain(model, x)
    made = offload.plan(model.layers, lambda: grads(model, x), "lowest", min_offload_bytes=0)
    input_bytes = TOKENS * HIDDEN * 4
    assert all(layer.input_bytes == input_bytes for layer in made.profile.layers)
    # budget_bytes=1: every group is released by force at the next layer's start (the compute
    # stream waits for its copy), so the end of the forward shows what left the device.
    recompute = dataclasses.replace(made, layers=(LayerPlan(Action.RECOMPUTE),) * 5 + (LayerPlan(Action.KEEP),),
                                    budget_bytes=1)
    oa = offload.OffloadActivations(model.layers, plan=recompute, min_offload_bytes=0)
    # The same plan with no host memory keeps the checkpoint inputs on the device, as the
    # checkpoint did with keyword inputs before.
    kept = offload.OffloadActivations(model.layers, plan=recompute, min_offload_bytes=0, host_budget_bytes=0)
    held = {}
    for name, context in (("offloaded", oa), ("kept", kept)):
        for _ in range(2):
            assert_bitwise(expected, grads(model, x, context))
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        xx = x.detach().requires_grad_(True)
        with context:
            out = model(xx)
        torch.cuda.synchronize()
        held[name] = torch.cuda.memory_allocated() - base
        (out ** 2).mean().backward()
        del out, xx
    assert oa.stats["released_bytes"] >= 5 * input_bytes, oa.report()
    assert kept.stats["released_bytes"] == 0
    assert held["offloaded"] <= held["kept"] - 0.95 * 5 * input_bytes, held
    oa.close()
    kept.close()


def test_micro_batched_planning_on_the_gpu_is_exact() -> None:
    model, x = cuda_stack(by_keyword=False)
    micro = list(x.chunk(2))
    expected = [plain(model, m) for m in micro]

    def step_fn() -> None:
        for m in micro:
            grads(model, m)

    made = offload.plan(model.layers, step_fn, "lowest", min_offload_bytes=0)
    assert len(made.layers) == 6
    assert all(layer.input_bytes == TOKENS // 2 * HIDDEN * 4 for layer in made.profile.layers)
    oa = offload.OffloadActivations(model.layers, plan=made, min_offload_bytes=0)
    for _ in range(2):
        for m, e in zip(micro, expected):
            assert_bitwise(e, grads(model, m, oa))
    oa.close()


def test_planning_a_compiled_model_on_the_gpu_is_exact_and_quiet(monkeypatch) -> None:
    model, x = cuda_stack(by_keyword=False)
    expected = plain(model, x)
    unraisable: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(str(u.exc_value)))
    oa = offload.OffloadActivations(model.layers, memory_budget_bytes="lowest", min_offload_bytes=0)
    assert not compiled_steps(model, x, expected, oa, steps=5)
    assert oa.plan is not None
    assert not unraisable, unraisable
    oa.close()


def test_a_budget_error_on_the_gpu_repeats_and_a_new_budget_is_followed() -> None:
    model, x = cuda_stack(by_keyword=False)
    expected = plain(model, x)
    oa = offload.OffloadActivations(model.layers, memory_budget_bytes=1 << 20, min_offload_bytes=0)
    errors = 0
    for _ in range(6):
        try:
            assert_bitwise(expected, grads(model, x, oa))
        except BudgetError:
            errors += 1
    assert errors >= 2 and oa.plan is None
    assert_bitwise(expected, grads(model, x))
    oa.set_budget("lowest")
    for _ in range(2):
        assert_bitwise(expected, grads(model, x, oa))
    assert oa.stats["offloaded_bytes"] > 0
    oa.close()
