"""The final norm inside the tiled head's chunks (``offload.tiling.causal_lm``, ``tile_norm``) on
CPU: the norm sees one chunk at a time, the loss and every gradient agree with the untiled model
within the tiling tolerance (float32: rtol 1e-5, atol 1e-6, as the tiled head alone), the step
repeats itself bit for bit, a call asking for the hidden states runs the norm whole, what cannot
run token by token is refused with a reason, and the planner counts the head's bytes without the
whole norm's (12 bytes a hidden element fewer)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

import offload
from offload.layers import model_form
from offload.planner.scaling import profile_at
from offload.planner.shapes import StepShape
from offload.planner.tiling import HIDDEN_BYTES, NORMED_HIDDEN_BYTES, HeadInfo, tiled_profile
from offload.tiling.causal_lm import final_norm_support, tile_head

from _util import llama_grads
from test_tiled_loss_cpu import FP32_ATOL as ATOL, FP32_RTOL as RTOL, HIDDEN, VOCAB, tiny_llama as plain_llama

transformers = pytest.importorskip("transformers")

CHUNK = 7


def tiny_llama(seed: int = 0) -> Any:
    """The tiled-loss tests' tiny Llama, its final norm's weight not all ones (a trained one's is
    not: its gradient then matters)."""
    model = plain_llama(seed)
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)
    return model


def ids(batch: int = 2, length: int = 30) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


def step(model: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(**kwargs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def norm_rows_seen(model: Any) -> list[tuple[int, ...]]:
    """The shapes the final norm is called on from now (a hook put on after tiling)."""
    seen: list[tuple[int, ...]] = []
    model.model.norm.register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0].shape)))
    return seen


def test_the_norm_runs_chunk_by_chunk_and_agrees_with_the_untiled_model() -> None:
    model, x = tiny_llama(), ids()
    plain = step(model, input_ids=x, labels=x)
    assert final_norm_support(model) == ("norm", "")
    with tile_head(model, CHUNK) as tiled:
        assert tiled.wrapper.norm == "norm"
        seen = norm_rows_seen(model)
        first = step(model, input_ids=x, labels=x)
        second = step(model, input_ids=x, labels=x)
    # Forward and backward each norm every chunk of the 60 tokens, never the whole step.
    assert seen and all(len(s) == 2 and s[0] <= CHUNK for s in seen), seen
    assert sum(s[0] for s in seen) == 2 * 2 * x.numel()
    torch.testing.assert_close(first[0], plain[0], rtol=RTOL, atol=ATOL)
    assert first[1].keys() == plain[1].keys()
    for name, grad in plain[1].items():
        torch.testing.assert_close(first[1][name], grad, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    assert torch.equal(first[0], second[0]) and all(torch.equal(first[1][n], second[1][n]) for n in first[1])
    assert isinstance(model.model.norm, nn.Module) and type(model.model.norm).__name__ == "LlamaRMSNorm"


def test_without_tile_norm_or_with_the_hidden_states_asked_the_norm_runs_whole() -> None:
    model, x = tiny_llama(), ids()
    with tile_head(model, CHUNK, tile_norm=False) as tiled:
        assert tiled.wrapper.norm == ""
        seen = norm_rows_seen(model)
        step(model, input_ids=x, labels=x)
    assert seen == [(2, 30, HIDDEN)]
    model = tiny_llama()
    with tile_head(model, CHUNK):
        seen = norm_rows_seen(model)
        plain_states = step(model, input_ids=x, labels=x, output_hidden_states=True)
    assert seen == [(2, 30, HIDDEN)], "HF returns the normed hidden states: the norm must run whole"
    assert torch.isfinite(plain_states[0])


def test_a_frozen_norm_and_hidden_states_without_grad_still_train_the_head() -> None:
    model, x = tiny_llama(), ids()
    for p in model.model.parameters():
        p.requires_grad_(False)
    plain = step(model, input_ids=x, labels=x)
    with tile_head(model, CHUNK):
        tiled = step(model, input_ids=x, labels=x)
    assert set(tiled[1]) == {"lm_head.weight"} == set(plain[1])
    torch.testing.assert_close(tiled[1]["lm_head.weight"], plain[1]["lm_head.weight"], rtol=RTOL, atol=ATOL)


class _SequenceNorm(nn.Module):
    """Normalises over the tokens: not token by token, so it cannot run chunk by chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HIDDEN))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.weight * (h - h.mean(dim=-2, keepdim=True))


def test_what_is_not_token_by_token_or_not_the_template_is_refused_with_a_reason() -> None:
    model = tiny_llama()
    model.model.norm = _SequenceNorm()
    name, reason = final_norm_support(model)
    assert name == "" and "token by token" in reason, reason
    x = ids()
    with tile_head(model, CHUNK) as tiled:  # the head still tiles; the norm runs whole
        assert tiled.wrapper.norm == ""
        assert torch.isfinite(step(model, input_ids=x, labels=x)[0])
    hooked = tiny_llama()
    hooked.model.norm.register_forward_hook(lambda *a: None)
    assert "hooks" in final_norm_support(hooked)[1]

    class EndsElsewhere(transformers.LlamaModel):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            out = super().forward(*args, **kwargs)
            hidden_states = out.last_hidden_state * 2
            return transformers.modeling_outputs.BaseModelOutputWithPast(last_hidden_state=hidden_states)

    other = tiny_llama()
    other.model.__class__ = EndsElsewhere
    assert "does not end with" in final_norm_support(other)[1]


def test_the_planner_counts_the_head_without_the_whole_norm() -> None:
    model, x = tiny_llama(), ids(1, 32)
    head = model_form.head_info(model)
    assert head.tileable and head.norm == "norm"
    profile = offload.planner.profile_step(model.model.layers, lambda: llama_grads(model, x), device="cpu",
                                           min_offload_bytes=0, warmup_steps=0)
    tokens = 8192
    at = profile_at(profile, StepShape(1, tokens))
    at = dataclasses.replace(at, head_bytes=tokens * VOCAB * 16)  # an untiled head holding its logits
    whole = tiled_profile(at, 0, dataclasses.replace(head, norm=""), 256)
    inside = tiled_profile(at, 0, head, 256)
    saved = tokens * HIDDEN * (HIDDEN_BYTES - NORMED_HIDDEN_BYTES)
    # What the chunked norm adds back is one chunk's working set (256 tokens, with the margin).
    assert saved - 2 * 256 * HIDDEN * 16 <= whole.head_bytes - inside.head_bytes <= saved
    assert HeadInfo(VOCAB, HIDDEN, True, True).norm == ""  # the default: the norm whole


@pytest.mark.parametrize("family,norm_name", [("Phi", "final_layernorm"), ("Gemma", "norm"), ("Qwen3", "norm")])
def test_other_families_norms_run_inside_and_agree(family: str, norm_name: str) -> None:
    # Phi's final norm is a LayerNorm with a bias, under another name; Gemma's scales by 1 + weight.
    if not hasattr(transformers, f"{family}ForCausalLM"):
        pytest.skip(f"this transformers has no {family}")
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    x = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(2))
    plain = step(model, input_ids=x, labels=x)
    with tile_head(model, CHUNK) as tiled:
        assert tiled.wrapper.norm == norm_name
        got = step(model, input_ids=x, labels=x)
    torch.testing.assert_close(got[0], plain[0], rtol=RTOL, atol=ATOL)
    assert got[1].keys() == plain[1].keys() and any(norm_name in n for n in got[1])
    for name, grad in plain[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=RTOL, atol=ATOL, msg=lambda m: f"{family} {name}: {m}")
