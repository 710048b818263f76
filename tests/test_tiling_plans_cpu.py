"""Tiling as a planner action (issue 34), on the CPU: the tiled profile derived from the untiled
one, plans that tile only where no untiled plan fits, the host budget bounding a plan, the
longest length named when nothing fits, and ``OffloadActivations(layers, model=model)``: a long
first batch probed at a short length (its gradients thrown away), plans per shape with tiled MLPs
followed bit for bit with and without offload, and the tiled step within tolerance of the plain
one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import offload
from offload.layers import model_form
from offload.planner import BudgetError
from offload.planner.make import choose
from offload.planner.model import simulate
from offload.planner.scaling import profile_at
from offload.planner.search import _floor, _space, best_plan, lowest_peak
from offload.planner.shapes import StepShape
from offload.planner import tiling
from offload.planner.tiling import HeadInfo, longest_fitting, lowest_tiled, mlp_chunk_tokens, tiled_profile
from offload.planner.types import Action, LayerPlan, Plan

from _util import llama_grads, rel_err

transformers = pytest.importorskip("transformers")

HEAD = HeadInfo(vocab_size=128, hidden_size=64, weight_trains=True, tileable=True)
# A tiled MLP's weight gradients are summed chunk by chunk: float32 within this of untiled.
TILED_RTOL = 1e-4


def _model(layers: int = 2, seed: int = 0):
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=4096, use_cache=False,
        attn_implementation="sdpa")
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    # Chunks of 8 tokens (a GPU's are thousands): the tiny model's MLPs gain from tiling.
    monkeypatch.setattr(tiling, "MIN_MLP_CHUNK", 8)
    monkeypatch.setattr(tiling, "MLP_CHUNKS", 8)


@pytest.fixture(scope="module")
def profile():
    model = _model()
    ids = torch.randint(0, 128, (2, 32))
    return offload.planner.profile_step(model.model.layers, lambda: llama_grads(model, ids), device="cpu",
                                        min_offload_bytes=0, warmup_steps=0)


def test_tiled_profile_swaps_the_mlp_insides_for_its_input(profile) -> None:
    tiled = tiled_profile(profile, 16, None, 0)
    for plain, t in zip(profile.layers, tiled.layers):
        assert plain.selective is not None and t.selective is None
        assert t.slot_bytes == plain.selective.slot_bytes and t.saved_bytes < plain.saved_bytes
        assert t.backward_ms == pytest.approx(plain.backward_ms + plain.selective.forward_ms)
        assert plain.selective.forward_ms > 0
    # The plain step's figures stay the untiled ones (the table's "x plain").
    assert tiled.plain_peak_bytes == profile.plain_peak_bytes


def test_tiled_head_drops_the_logits() -> None:
    base = _synthetic(tokens=4096, vocab=32000, hidden=256)
    tiled = tiled_profile(base, 0, HeadInfo(32000, 256, False, True), 256)
    assert tiled.head_bytes < base.head_bytes // 4
    assert tiled.head_ms > base.head_ms
    # What the untiled head left for backward held logit-sized buffers (T29 at cp=4 measured ~5
    # bytes a logit, which scaled to 157 GiB and made no plan fit): the tiled head leaves no more
    # than its own working set, and a residual under that stays as measured.
    assert tiled.head_residual_bytes <= tiled.head_bytes < base.head_residual_bytes
    small = dataclasses.replace(base, head_residual_bytes=1 << 20)
    assert tiled_profile(small, 0, HeadInfo(32000, 256, False, True), 256).head_residual_bytes == 1 << 20


def test_the_head_is_tiled_only_where_it_would_hold_less_than_untiled() -> None:
    # The untiled head's loss runs over chunks of rows (offload.tiling.exact_loss): about 5 bytes
    # a logit, under a tiled head's one 2048-token chunk at 4096 tokens, over it at 65536.
    head = HeadInfo(32000, 256, False, True)
    for tokens, tiled in ((4096, False), (65536, True)):
        base = dataclasses.replace(_synthetic(tokens, 32000, 256), head_bytes=tokens * 32000 * 5)
        variant, _, head_tokens = tiling.lowest_tiled(base, head)
        assert bool(head_tokens) is tiled, (tokens, head_tokens)
        assert variant.head_bytes <= base.head_bytes
        # A head tiled anyway is counted as it runs, not capped at the untiled head's bytes.
        assert tiled_profile(base, 0, head, 2048).head_bytes == tiling.tiled_head_bytes(tokens, head, 2048)


def _synthetic(tokens: int, vocab: int, hidden: int):
    # A profile whose head holds its logits (10 bytes each), as a CUDA probe would measure.
    model = _model()
    ids = torch.randint(0, 128, (1, 32))
    p = offload.planner.profile_step(model.model.layers, lambda: llama_grads(model, ids), device="cpu",
                                     min_offload_bytes=0, warmup_steps=0)
    p = profile_at(p, StepShape(1, tokens))
    return dataclasses.replace(p, head_bytes=tokens * vocab * 10 + tokens * hidden * 8,
                               head_residual_bytes=tokens * vocab * 5 + tokens * hidden * 2)


def _floors(profile):
    # The lowest peaks best_plan can reach untiled and tiled (every release forced).
    variant, _, _ = lowest_tiled(profile, HEAD)
    return tuple(_floor(p, _space(p))[0] for p in (profile, variant))


def test_plans_tile_only_where_no_untiled_plan_fits(profile) -> None:
    untiled, tiled = _floors(profile)
    assert tiled < untiled
    roomy = choose(profile, profile.plain_peak_bytes, head=HEAD)
    assert not roomy.tiles() and roomy.head_note == ""
    tight = choose(profile, (untiled + tiled) // 2, head=HEAD)
    assert tight.tiles() and all(lp.tile_tokens == mlp_chunk_tokens(64) < 64 for lp in tight.layers)
    assert tight.prediction.peak_bytes <= (untiled + tiled) // 2
    assert "MLPs tiled" in tight.describe()
    with pytest.raises(BudgetError, match="tiled"):
        choose(profile, tiled // 2, head=HEAD)


def test_an_untileable_head_says_why(profile) -> None:
    head = HeadInfo(0, 0, False, False, "the head is not an nn.Linear followed by cross-entropy")
    plan = choose(profile, profile.plain_peak_bytes, head=head)
    assert "not an nn.Linear" in plan.head_note
    with pytest.raises(BudgetError, match="pass the model"):
        choose(profile, 1, head=None)


def test_tiled_plans_round_trip(profile) -> None:
    untiled, tiled = _floors(profile)
    plan = choose(profile, (untiled + tiled) // 2, head=HEAD)
    again = Plan.from_dict(plan.to_dict())
    assert again.layers == plan.layers and again.head_tokens == plan.head_tokens
    assert "tiled" in plan.table()
    with pytest.raises(ValueError, match="tiled or selectively"):
        LayerPlan(Action.KEEP, selective=True, tile_tokens=8)


def test_the_host_budget_bounds_a_plan(profile) -> None:
    # A budget near the lowest peak: the fastest plan there copies a lot; half of that as the
    # host budget must give a plan that copies at most that much.
    budget = _floor(profile, _space(profile))[0] * 11 // 10
    free = best_plan(profile, budget)
    copied = free.prediction.d2h_bytes
    assert copied > 0
    plan = best_plan(profile, budget, host_budget=copied // 2)
    assert plan.prediction.d2h_bytes <= copied // 2 and plan.prediction.peak_bytes <= budget
    # No host memory at all: the plan copies nothing (and keeps what it must on the GPU).
    assert lowest_peak(profile, host_budget=0).prediction.d2h_bytes == 0


def test_longest_fitting_length(profile) -> None:
    at = lowest_tiled(profile_at(profile, StepShape(2, 256)), HEAD)[0]
    budget = simulate(at, [LayerPlan(Action.RECOMPUTE)] * 2, 1).peak_bytes
    longest = longest_fitting(profile, 2, budget, HEAD, None)
    assert longest is not None and 256 <= longest
    fits = lambda n: simulate(lowest_tiled(profile_at(profile, StepShape(2, n)), HEAD)[0],
                              [LayerPlan(Action.RECOMPUTE)] * 2, 1).peak_bytes <= budget
    assert fits(longest) and not fits(longest * 2)
    assert longest_fitting(profile, 2, 1, HEAD, None) is None


# ---------------------------------------------------------------------------------- the model form

def _grads(model):
    return [p.grad.clone() if p.grad is not None else None for p in model.parameters()]


def _step(model, ids, ctx=None):
    model.zero_grad(set_to_none=True)
    if ctx is None:
        loss = model(input_ids=ids, labels=ids).loss
    else:
        with ctx:
            loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), _grads(model)


def test_a_long_first_batch_is_probed_short_and_its_gradients_thrown_away(monkeypatch) -> None:
    monkeypatch.setattr(model_form, "SHORT_PROBE_TOKENS", 16)
    model = _model()
    ids = torch.randint(0, 128, (2, 48))
    want_loss, want = _step(model, ids)
    ctx = offload.OffloadActivations(model.model.layers, model=model, memory_budget_bytes=1 << 40, device="cpu",
                                     min_offload_bytes=0)
    got_loss, got = _step(model, ids, ctx)
    # The first step ran planned at its own shape after probe steps at 8 tokens a sequence.
    assert ctx.plan is not None and ctx._planned.profile.shape == (2, 8)
    assert torch.equal(got_loss, want_loss)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    again_loss, again = _step(model, ids, ctx)
    assert torch.equal(again_loss, want_loss)


def test_model_form_tiles_where_the_budget_needs_it_bit_for_bit_with_offload(monkeypatch) -> None:
    monkeypatch.setattr(model_form, "SHORT_PROBE_TOKENS", 16)
    model = _model(layers=3)
    ids = torch.randint(0, 128, (2, 64))
    want_loss, want = _step(model, ids)
    probe_ctx = offload.OffloadActivations(model.model.layers, model=model, memory_budget_bytes=1 << 40,
                                           device="cpu", min_offload_bytes=0)
    _step(model, ids, probe_ctx)
    at = profile_at(probe_ctx._planned.profile, StepShape(2, 64))
    untiled, tiled = _floors(at)
    budget = (untiled + tiled) // 2
    runs = []
    for _ in range(2):
        ctx = offload.OffloadActivations(model.model.layers, model=model, memory_budget_bytes=budget, device="cpu",
                                         min_offload_bytes=0)
        runs.append(_step(model, ids, ctx))
        assert ctx.plan is not None and ctx.plan.tiles(), ctx.plan.describe()
        ctx.close()
    # Repeatable bit for bit, and within tolerance of the untiled step.
    assert torch.equal(runs[0][0], runs[1][0])
    for a, b, ref in zip(runs[0][1], runs[1][1], want):
        assert torch.equal(a, b)
        assert rel_err(a, ref) < TILED_RTOL
    # The same tiled plan without offload (the engine off): bit for bit the offloaded run.
    plan = ctx.plan
    keep = dataclasses.replace(plan, layers=tuple(dataclasses.replace(lp, action=Action.KEEP, min_offload_bytes=0)
                                                 for lp in plan.layers))
    ctx2 = offload.OffloadActivations(model.model.layers, model=model, plan=keep, device="cpu", min_offload_bytes=0)
    _, kept = _step(model, ids, ctx2)
    for a, b in zip(runs[0][1], kept):
        assert torch.equal(a, b)


def test_model_option_is_checked() -> None:
    model, other = _model(), _model()
    with pytest.raises(ValueError, match="does not contain the layers"):
        offload.OffloadActivations(model.model.layers, model=other, memory_budget_bytes=1 << 30, device="cpu")
    with pytest.raises(TypeError, match="nn.Module"):
        offload.OffloadActivations(model.model.layers, model="model", memory_budget_bytes=1 << 30, device="cpu")
    with pytest.raises(ValueError, match="model"):
        offload.OffloadActivations(model=model)


def test_recomputed_layers_replay_their_tiling(profile) -> None:
    # Every layer recomputed with its MLP tiled: the recompute in backward must tile as the
    # forward did (or the checkpoint sees other saved tensors), and the gradients are those of
    # the same tiling kept.
    model = _model()
    ids = torch.randint(0, 128, (2, 32))
    variant = tiled_profile(profile, 8, None, 0)

    def plan(action):
        made = offload.planner.plan_for(variant, [action] * len(variant.layers))
        return dataclasses.replace(made, layers=tuple(dataclasses.replace(lp, tile_tokens=8) for lp in made.layers))

    grads = []
    for action in (Action.RECOMPUTE, Action.KEEP):
        ctx = offload.OffloadActivations(model.model.layers, model=model, plan=plan(action), device="cpu",
                                         min_offload_bytes=0)
        grads.append(_step(model, ids, ctx)[1])
        ctx.close()
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_the_short_probe_drops_the_logits_before_its_backward() -> None:
    # Held through the probe's backward, the logits would be counted as the head's residual
    # (on the GPU: 58 GiB predicted at 262,144 tokens for LLAMA-8B-SHAPE's head).
    import types
    import weakref

    seen = []
    weight = torch.randn(4, requires_grad=True)

    def forward(input_ids, labels):
        logits = input_ids.float() * weight
        loss = logits.sum()
        alive = weakref.ref(logits)
        loss.register_hook(lambda g: seen.append(alive() is None) or g)
        return types.SimpleNamespace(loss=loss, logits=logits)

    ids = torch.ones(1, 4, dtype=torch.long)
    holder = torch.nn.Linear(1, 1)
    step = model_form.short_step(holder, forward, (), {"input_ids": ids, "labels": ids}, StepShape(1, 4))
    step(4)
    assert seen == [True]


def test_the_model_keeps_its_forward_signature_and_gets_it_back() -> None:
    # The HF Trainer keeps only the dataset columns the model's forward names.
    import inspect

    model = _model()
    before = inspect.signature(model.forward)
    ctx = offload.OffloadActivations(model.model.layers, model=model, memory_budget_bytes=1 << 40, device="cpu")
    assert isinstance(model.__dict__["forward"], model_form.ModelForward)
    assert inspect.signature(model.forward) == before
    ctx.close()
    assert "forward" not in model.__dict__


def test_a_length_no_plan_fits_is_refused_before_the_forward_naming_what_fits(profile) -> None:
    from offload.planner.tiling import lowest_at

    model = _model()
    budget = lowest_at(profile, StepShape(2, 64), HEAD)[0]
    ctx = offload.OffloadActivations(model.model.layers, model=model, memory_budget_bytes=budget, device="cpu",
                                     min_offload_bytes=0)
    short = torch.randint(0, 128, (2, 32))
    for _ in range(4):  # the probe steps, then a planned one
        _step(model, short, ctx)
    assert ctx.plan is not None
    calls = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(BudgetError) as caught:
        _step(model, torch.randint(0, 128, (2, 4096)), ctx)
    hook.remove()
    text = str(caught.value)
    assert "length 4096" in text and "device memory" in text and "host memory" in text, text
    assert "lengths up to about" in text, text
    assert not calls, "a layer ran before the BudgetError"
    _step(model, short, ctx)  # the context goes on at a length that fits
