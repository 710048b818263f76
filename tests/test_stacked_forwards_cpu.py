"""Forward stand-ins stacked by several tools on one module or model (issue 49, items 4 and 7):
a user's ``tile_tokenwise(...).remove()`` really removes the tiling when a plan has wrapped it
since, and ``close()`` does not put it back; and a second model-form context on one model does
not take the model over from the first (whose long first batch must still be probed short)."""

from __future__ import annotations

import pytest
import torch

import offload
from offload.forwards.instance import splice_out
from offload.layers import model_form
from offload.tiling.tokenwise import TiledForward, tile_tokenwise

transformers = pytest.importorskip("transformers")


def tiny_llama(seed: int = 0):
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def grads(model, tokens, ctx=None):
    model.zero_grad(set_to_none=True)
    if ctx is None:
        loss = model(input_ids=tokens, labels=tokens).loss
    else:
        with ctx:
            loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def bitwise(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def chain(module) -> list:
    """The forward stand-ins on ``module``, outermost first (each calls the next through ``fn``)."""
    out, current = [], module.__dict__.get("forward")
    while current is not None:
        out.append(current)
        current = getattr(current, "fn", None)
    return out


def user_tiling(module) -> bool:
    return any(isinstance(w, TiledForward) and w.chunk == 8 for w in chain(module))


# The plan was made with the user's tiling: once it is removed, the layers save more than the plan
# says, and the planned schedule warns so (rightly).
@pytest.mark.filterwarnings("ignore:offload. layer .* saved")
def test_tile_tokenwise_remove_works_under_a_planned_context() -> None:
    torch.use_deterministic_algorithms(True)
    try:
        model = tiny_llama()
        tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
        plain = grads(model, tokens)
        assert bitwise(plain, grads(model, tokens)), "the plain step does not repeat itself"
        mlps = [layer.mlp for layer in model.model.layers]
        tiling = tile_tokenwise(mlps, 8)
        ctx = offload.OffloadActivations(model.model.layers, memory_budget_bytes=1 << 40, device="cpu",
                                         min_offload_bytes=0)
        for _ in range(4):  # the probe steps, then planned ones: the plan wraps the user's tiling
            tiled = grads(model, tokens, ctx)
        assert user_tiling(mlps[0]) and not isinstance(mlps[0].__dict__["forward"], TiledForward), \
            "the plan did not wrap the user's tiling (nothing to test)"
        assert not bitwise(tiled, plain), "tiled at 8 tokens, the gradients should differ in their last bits"
        tiling.remove()
        assert not any(user_tiling(m) for m in mlps), "remove() left the user's tiling in place"
        assert bitwise(grads(model, tokens, ctx), plain), "after remove() the gradients are not plain's"
        ctx.close()
        assert all("forward" not in m.__dict__ for m in mlps), "close() put a forward back on the MLPs"
        assert bitwise(grads(model, tokens), plain)
    finally:
        torch.use_deterministic_algorithms(False)


def test_splice_out_takes_a_wrapper_out_of_any_place_in_a_chain() -> None:
    module = torch.nn.Linear(4, 4)
    own = module.forward
    inner = TiledForward(module, module.forward, 2)
    module.forward = inner
    outer = TiledForward(module, inner, 0)
    module.forward = outer
    assert splice_out(module, inner) and outer.fn == own
    assert not splice_out(module, inner), "a wrapper taken out already is not found again"
    assert splice_out(module, outer) and "forward" not in module.__dict__


def test_a_second_model_form_context_does_not_take_the_model_over(monkeypatch) -> None:
    monkeypatch.setattr(model_form, "SHORT_PROBE_TOKENS", 16)
    model = tiny_llama()
    tokens = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(1))

    def make():
        return offload.OffloadActivations(model.model.layers, model=model, memory_budget_bytes=1 << 40,
                                          device="cpu", min_offload_bytes=0)

    first, second = make(), make()  # the first is neither closed nor dropped
    grads(model, tokens, first)
    profile = first._planned.profile
    assert profile is not None and profile.shape == (2, 8), "the first context's long first batch was not probed short"
    grads(model, tokens, second)
    assert second._planned.profile.shape == (2, 8)
    first.close()
    assert isinstance(model.__dict__.get("forward"), model_form.ModelForward), "closing the first unhooked the second"
    grads(model, tokens, second)
    second.close()
    assert "forward" not in model.__dict__
    third = make()
    del third  # collected: the stand-in holds it weakly, and a new context finds it gone
    fourth = make()
    assert len(model.__dict__["forward"].owners) == 1
    fourth.close()
    assert "forward" not in model.__dict__
