"""Contexts that keep working after an error, options checked up front, and reports that say what
happened (issue 32, defects 4, 7, 8, 9, 10 and what a newcomer trips on; issue 49, items 10 and 13).

- After a BudgetError the context raises it again at every entry (it is not broken by it), a
  step outside it still runs plainly, and ``set_budget`` makes it follow a plan.
- ``enabled=False`` checks every option's value as ``enabled=True`` does.
- The form without layers refuses every planner option, naming the layers form.
- A probe step whose backward raised (no out-of-memory anywhere) is not reported as one that ran
  out of memory.
- Under ``torch.compile``, planning runs the probe eagerly and quietly.
- Newcomer items: one layer warns that nothing is offloaded, a non-module in the layer list is
  named, ``selective=`` takes modules with short errors, ``repr`` names the layers.
- A BudgetError names the step's own shape, and its length bucket only as the reason.
- A model-form context holding the model is named by ``tile_head``, with how to release it; one
  collected without ``close()`` does not hold the model.
"""

from __future__ import annotations

import gc
import sys
import warnings
from typing import Any

import pytest
import torch

import offload
from offload.planner import BudgetError

from offload.planner.shapes import StepShape
from offload.tiling import tile_head

from _util import assert_bitwise, llama_grads, make_gpt_layers, oa_step, tiny_llama, train_step
from test_plans_followed_cpu import LINK, MIXED, Stack, grads, made_plan, plain


@pytest.fixture
def model() -> tuple[Stack, torch.Tensor, list[torch.Tensor]]:
    stack, x = Stack(), torch.randn(4, 16, 32)
    return stack, x, plain(stack, x)


# -- defect 4: BudgetError ---------------------------------------------------------------------------------
def test_a_budget_error_repeats_at_each_entry_and_a_new_budget_can_be_set(model) -> None:
    stack, x, expected = model
    oa = offload.OffloadActivations(stack.layers, memory_budget_bytes=1, device="cpu", min_offload_bytes=0)
    errors = []
    for _ in range(6):
        try:
            assert_bitwise(expected, grads(stack, x, oa))  # the probe steps
        except BudgetError as exc:
            errors.append(str(exc))
    assert len(errors) >= 3 and len(set(errors)) == 1 and "no plan fits" in errors[0], errors
    assert oa.plan is None
    assert_bitwise(expected, grads(stack, x))  # a step outside the context runs plainly
    with pytest.raises(BudgetError):
        oa.set_budget(2)  # still no plan fits: the context stays as it was
    assert oa.plan is None
    oa.set_budget("lowest")  # from the figures measured already: no new probe step
    assert oa.plan is not None and oa.budget == "lowest"
    assert_bitwise(expected, grads(stack, x, oa))
    assert oa.stats["offloaded_bytes"] > 0
    oa.close()


def test_a_budget_error_names_the_steps_own_length_and_its_bucket_only_as_the_reason() -> None:
    layers, x = make_gpt_layers(4), torch.randn(2, 16, 64)
    profile = offload.planner.profile_step(layers, lambda: train_step(layers, x), device="cpu", min_offload_bytes=0,
                                           warmup_steps=0)
    budget = offload.planner.lowest_peak(profile).prediction.peak_bytes * 11 // 10  # fits length 16 only
    oa = offload.OffloadActivations(layers, memory_budget_bytes=budget, device="cpu", min_offload_bytes=0)
    for _ in range(3):  # the probe steps
        oa_step(layers, x, oa)
    for length, bucket in ((96, 99), (200, 216)):
        assert StepShape(2, length).bucket() == StepShape(2, bucket)
        with pytest.raises(BudgetError) as caught:
            oa_step(layers, torch.randn(2, length, 64), oa)
        said = str(caught.value)
        assert said.startswith(f"offload: no plan fits a step of batch 2 x length {length} (planned for its "
                               f"length bucket, up to length {bucket}): "), said
        assert f"x length {bucket}" not in said, said
    assert_bitwise(train_step(layers, x), oa_step(layers, x, oa))  # the context goes on


def test_set_budget_is_refused_where_it_cannot_apply(model) -> None:
    stack, _, _ = model
    fixed = offload.OffloadActivations(stack.layers, device="cpu")
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        fixed.set_budget("lowest")
    planned = offload.OffloadActivations(stack.layers, memory_budget_bytes="lowest", device="cpu")
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        planned.set_budget(-5)


# -- defect 7: enabled=False checks the options ------------------------------------------------------------
BAD_OPTIONS = [
    {"timing": "yes"}, {"mode": "v3"}, {"min_offload_bytes": -1}, {"host_budget_bytes": -1},
    {"selection": "some"}, {"wait_for_pinning": 1},
]


@pytest.mark.parametrize("bad", BAD_OPTIONS, ids=lambda bad: next(iter(bad)))
@pytest.mark.parametrize("form", ["layers", "no layers", "te"])
def test_a_disabled_context_checks_option_values_as_an_enabled_one_does(model, form: str, bad: dict[str, Any]) -> None:
    stack, _, _ = model

    def make(enabled: bool) -> object:
        if form == "layers":
            return offload.OffloadActivations(stack.layers, enabled=enabled, device="cpu", **bad)
        if form == "no layers":
            return offload.OffloadActivations(enabled=enabled, device="cpu", **bad)
        return offload.get_cpu_offload_context(enabled, 1, 3, device="cpu", **bad)

    with pytest.raises((TypeError, ValueError)) as on:
        make(True)
    with pytest.raises(type(on.value)) as off:
        make(False)
    assert str(off.value) == str(on.value)


def test_transformer_engines_own_disabled_call_stays_accepted() -> None:
    # TE's defaults (num_layers=1, model_layers=1) describe no layer to offload: fine while disabled.
    context, sync = offload.get_cpu_offload_context()
    assert context.stats["mode"] == "disabled" and sync(torch.ones(1)).item() == 1
    offload.get_cpu_offload_context(enabled=False, offload_activations=False)


# -- defect 8: no planner options without layers -----------------------------------------------------------
@pytest.mark.parametrize("option", [{"probe": "plain"}, {"probe": "nonsense"}, {"selective": "mlp"},
                                    {"selective": False}, {"measure_peak": True},
                                    {"memory_budget_bytes": "lowest"}], ids=str)
def test_the_form_without_layers_refuses_every_planner_option(option: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"OffloadActivations\(model.layers"):
        offload.OffloadActivations(device="cpu", **option)


# -- defect 9: what the report says of a failed probe step -------------------------------------------------
def test_a_probe_step_whose_backward_raised_is_not_reported_as_out_of_memory(model) -> None:
    stack, x, expected = model
    oa = offload.OffloadActivations(stack.layers, memory_budget_bytes="lowest", device="cpu", min_offload_bytes=0)
    raised = False
    for step in range(8):
        if oa.plan is not None:
            break
        if step == 2 and not raised:  # the measured probe step: its backward raises once
            raised = True
            with oa:
                out = stack(x)
            with pytest.raises(KeyError):
                out.register_hook(lambda g: (_ for _ in ()).throw(KeyError("batch")))
                (out ** 2).mean().backward()
            continue
        assert_bitwise(expected, grads(stack, x, oa))
    assert oa.plan is not None, "planning never ended"
    reason = oa.plan.profile.probe_reason
    # (Not "out of" alone: a busy host may time a layer's first run slow, and the reason then
    # says its warm-up was "left out of" that layer.)
    assert "ran out of" not in reason and "did not finish" not in reason and oa.plan.profile.probe == "plain", reason
    assert "ran out of device memory" not in oa.plan_report()
    assert_bitwise(expected, grads(stack, x, oa))
    oa.close()


# -- defect 10: torch.compile ------------------------------------------------------------------------------
def test_planning_a_compiled_model_runs_the_probe_eagerly_and_quietly(model, monkeypatch) -> None:
    stack, x, expected = model
    unraisable: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(f"{u.exc_type.__name__}: {u.exc_value}"))
    oa = offload.OffloadActivations(stack.layers, memory_budget_bytes="lowest", device="cpu", min_offload_bytes=0)
    assert not compiled_steps(stack, x, expected, oa, steps=5)  # probe steps, then the plan
    assert oa.plan is not None
    assert not unraisable, unraisable
    oa.close()
    # A plan that recomputes and runs MLPs selectively: its wrappers run in the compiled forward.
    mixed = offload.OffloadActivations(stack.layers, plan=made_plan(stack, x, MIXED), device="cpu", min_offload_bytes=0)
    assert not compiled_steps(stack, x, expected, mixed, steps=2)
    assert mixed.stats["offloaded_bytes"] > 0
    mixed.close()


def compiled_steps(stack: Stack, x: torch.Tensor, expected: list[torch.Tensor], oa: Any, steps: int) -> list[str]:
    """``steps`` steps of ``stack`` compiled (aot_eager) under ``oa``, each bitwise; returns the
    warnings of Dynamo tracing what it should not."""
    torch._dynamo.reset()
    compiled = torch.compile(stack, backend="aot_eager")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                stack.zero_grad(set_to_none=True)
                xx = x.detach().requires_grad_(True)
                with oa:
                    out = compiled(xx)
                (out ** 2).mean().backward()
                assert_bitwise(expected, [p.grad.clone() for p in stack.parameters()] + [xx.grad.clone()])
    finally:
        torch._dynamo.reset()
    return [str(w.message) for w in caught if "Dynamo" in str(w.message) or "trace" in str(w.message)]


# -- what a newcomer trips on ------------------------------------------------------------------------------
def test_one_layer_warns_that_nothing_is_offloaded(model) -> None:
    stack, _, _ = model
    with pytest.warns(UserWarning, match="offloads nothing"):
        offload.OffloadActivations([stack.layers[0]], device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        offload.OffloadActivations(stack.layers, device="cpu")  # all but the last: no warning


def test_a_non_module_in_the_layer_list_is_named(model) -> None:
    stack, _, _ = model
    with pytest.raises(TypeError, match=r"layers\[2\] is 'mlp' \(str\)"):
        offload.OffloadActivations([stack.layers[0], stack.layers[1], "mlp"], device="cpu")


def test_selective_takes_a_list_of_modules_like_selective_recompute(model) -> None:
    stack, x, expected = model
    by_name = offload.plan(stack.layers, lambda: grads(stack, x), "lowest", device="cpu", min_offload_bytes=0,
                           link=LINK, selective="mlp")
    mlps = [layer.mlp for layer in stack.layers]
    by_module = offload.plan(stack.layers, lambda: grads(stack, x), "lowest", device="cpu", min_offload_bytes=0,
                             link=LINK, selective=mlps)
    assert [l.selective is not None for l in by_module.profile.layers] == [True] * 4
    assert [l.selective.slot_bytes for l in by_module.profile.layers] == \
        [l.selective.slot_bytes for l in by_name.profile.layers]
    oa = offload.OffloadActivations(stack.layers, plan=by_module, device="cpu", min_offload_bytes=0, selective=mlps)
    assert_bitwise(expected, grads(stack, x, oa))
    oa.close()


def test_selective_errors_are_short(model) -> None:
    stack, _, _ = model
    outside = [torch.nn.Sequential(torch.nn.Linear(2, 2)) for _ in range(16)]
    with pytest.raises(ValueError) as err:
        offload.OffloadActivations(stack.layers, memory_budget_bytes="lowest", device="cpu", selective=outside)
    assert "inside none of the layers" in str(err.value) and len(str(err.value)) < 200
    with pytest.raises(TypeError) as err:
        offload.OffloadActivations(stack.layers, memory_budget_bytes="lowest", device="cpu",
                                   selective=list(range(1000)))
    assert "a list of 1000 (int)" in str(err.value) and len(str(err.value)) < 300


def test_repr_names_the_layers_and_what_is_done_with_them(model) -> None:
    stack, _, _ = model
    assert repr(offload.OffloadActivations(stack.layers, device="cpu")) == \
        "OffloadActivations(4 layers (Block), offloading 3 of them)"
    assert "planning" in repr(offload.OffloadActivations(stack.layers, memory_budget_bytes="lowest", device="cpu"))
    assert repr(offload.OffloadActivations(stack.layers, enabled=False)).endswith(", disabled)")


def test_the_nothing_offloaded_warning_names_a_nested_context(model) -> None:
    stack, x, expected = model
    outer = offload.OffloadActivations(stack.layers, device="cpu", min_offload_bytes=0)
    inner = offload.OffloadActivations(stack.layers, device="cpu", min_offload_bytes=0)
    stack.zero_grad(set_to_none=True)
    xx = x.detach().requires_grad_(True)
    with pytest.warns(UserWarning, match="another offload context entered inside this one"):
        with outer:
            with inner:
                out = stack(xx)
        (out ** 2).mean().backward()
    assert_bitwise(expected, [p.grad.clone() for p in stack.parameters()] + [xx.grad.clone()])
    inner.close()
    outer.close()


# -- issue 49, item 10: a model-form context and tile_head ------------------------------------------------
def test_tile_head_names_a_live_model_form_context_and_is_not_blocked_by_a_dead_one() -> None:
    pytest.importorskip("transformers")
    llama, ids = tiny_llama(2)
    expected = llama_grads(llama, ids)
    assert_bitwise(expected, llama_grads(llama, ids))  # the plain step repeats itself

    def context() -> offload.OffloadActivations:
        return offload.OffloadActivations(llama.model.layers, model=llama, memory_budget_bytes="lowest", device="cpu",
                                          min_offload_bytes=0)

    oa = context()
    with pytest.raises(ValueError, match=r"^offload.tile_head: LlamaForCausalLM has its forward held by the "
                                         r"OffloadActivations\(2 layers \(LlamaDecoderLayer\), .*\) it was given to as "
                                         r"model= .*: call that context's close\(\) \(oa.close\(\)\) first"):
        tile_head(llama, 16)
    oa.close()  # what the message says releases the model
    with tile_head(llama, 16):
        pass
    assert "forward" not in llama.__dict__
    # Dropped without close() after a step: the model runs its own forward, and tile_head is not
    # refused (it takes the inert stand-in off).
    oa = context()
    assert_bitwise(expected, llama_grads(llama, ids, oa))  # a probe step
    del oa
    gc.collect()
    assert_bitwise(expected, llama_grads(llama, ids))
    with tile_head(llama, 16) as head:
        assert llama.__dict__["forward"] is head.wrapper
    assert "forward" not in llama.__dict__
