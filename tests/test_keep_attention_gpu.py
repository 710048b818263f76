"""Recomputed layers that keep attention's outputs, on a CUDA GPU: bitwise under delayed copy
streams, the attention kernel skipped in the recompute, the outputs' bytes held as the cost model
says, and an HF Llama as shipped (``use_cache=True``, SDPA, tied embeddings) under such a plan.

Bitwise comparisons use the efficient/math SDPA backends (``repeatable_attention``); each test
first checks that the plain run repeats itself.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

import offload
from offload.planner import Action, LayerPlan, plan_for

from _util import assert_bitwise, attention_kernels_in_backward, make_gpt_layers, oa_step, sleepy, train_step

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("repeatable_attention")]

HIDDEN, HEADS, SEQ, BATCH = 256, 4, 1024, 2
CYCLES = 20_000_000  # ~10 ms: longer than any copy here
R, RA = LayerPlan(Action.RECOMPUTE), LayerPlan(Action.RECOMPUTE, keep_attention=True)
O, K = LayerPlan(Action.OFFLOAD), LayerPlan(Action.KEEP)


def _setup() -> tuple[torch.nn.ModuleList, torch.Tensor, list[torch.Tensor], Any]:
    layers = make_gpt_layers(6, HIDDEN, HEADS, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(BATCH, SEQ, HIDDEN, device="cuda", dtype=torch.bfloat16,
                    generator=torch.Generator(device="cuda").manual_seed(1))
    expected = train_step(layers, x)
    assert_bitwise(expected, train_step(layers, x))
    profile = offload.planner.profile_step(layers, lambda: train_step(layers, x))
    return layers, x, expected, profile


@pytest.mark.parametrize("delay", ["none", "copies"])
def test_kept_attention_is_bitwise_under_delayed_copies_and_skips_the_kernel(delay: str) -> None:
    layers, x, expected, profile = _setup()
    assert all(layer.attention_bytes > 0 and layer.attention_forward_ms > 0 for layer in profile.layers)
    oa = offload.OffloadActivations(layers, plan=plan_for(profile, [RA, O, RA, R, O, K]))
    if delay == "copies":
        sleepy(oa, CYCLES)
    for _ in range(3):
        assert_bitwise(expected, oa_step(layers, x, oa))
    assert attention_kernels_in_backward(layers, x, oa) == 1  # layer 3's plain recompute; layers 0 and 2 keep theirs
    oa.close()


def test_the_outputs_held_are_the_bytes_the_cost_model_holds() -> None:
    # Inputs kept on the GPU (no copies in flight): what the forward leaves allocated grows, when
    # one layer's recompute keeps attention, by that layer's attention_bytes.
    layers, x, _, profile = _setup()
    plain = LayerPlan(Action.RECOMPUTE, keep_inputs=True)

    def held_after_forward(kept_at: int) -> int:
        plans = [LayerPlan(Action.RECOMPUTE, keep_inputs=True, keep_attention=True) if i == kept_at else plain
                 for i in range(len(layers))]
        oa = offload.OffloadActivations(layers, plan=plan_for(profile, plans))
        oa_step(layers, x, oa)  # warm: allocator and pinned blocks
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        xin = x.detach().requires_grad_(True)
        with oa:
            out = xin
            for layer in layers:
                out = layer(out)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        (out.float() ** 2).mean().backward()
        del out, xin
        torch.cuda.synchronize()
        # The kept outputs die with the backward: nothing of the step outlives it.
        assert torch.cuda.memory_allocated() <= before, (kept_at, torch.cuda.memory_allocated() - before)
        oa.close()
        return held

    none = held_after_forward(-1)
    extra = {i: held_after_forward(i) - none for i in (0, 2, len(layers) - 1)}
    for i, nbytes in extra.items():
        assert abs(nbytes - profile.layers[i].attention_bytes) <= 0.05 * profile.layers[i].attention_bytes, \
            (extra, [layer.attention_bytes for layer in profile.layers])


def test_hf_llama_as_shipped_follows_a_kept_attention_plan_bitwise() -> None:
    import transformers

    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      max_position_embeddings=2048, tie_word_embeddings=True,
                                      attn_implementation="sdpa")
    assert config.use_cache  # as a pretrained config ships
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 512, (2, 1024), device="cuda")

    def step(wrapper: Any = None) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with wrapper if wrapper is not None else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    expected = step()
    assert_bitwise(expected, step())
    layers = model.model.layers
    profile = offload.planner.profile_step(layers, step)
    assert all(layer.attention_bytes > 0 for layer in profile.layers)
    oa = offload.OffloadActivations(layers, plan=plan_for(profile, [RA, RA, O, K]))
    for _ in range(2):
        assert_bitwise(expected, step(oa))
    assert oa.stats["offloaded_bytes"] > 0
    oa.close()
