"""A head is tiled only when shown exact (issue 49, item 1): ``head_support`` runs the model's own
forward and the tiled one once on a few tokens, so a head that scales its logits (FalconH1's
``lm_head_multiplier``) or its loss (a subclass) is refused with the reason named, however its
source reads, while a standard head, in any dtype, with or without a bias, is accepted."""

from __future__ import annotations

import inspect
import linecache
import textwrap

import pytest
import torch

from offload.tiling import causal_lm
from offload.tiling.causal_lm import head_support, tile_head

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN = 1000, 64
LOSS_LINE = "vocab_size=self.config.vocab_size, **kwargs)"


def tiny_llama(cls=None, seed: int = 0):
    config = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB)
    torch.manual_seed(seed)
    return (cls or transformers.LlamaForCausalLM)(config)


def scaled_loss_llama(factor: float) -> type:
    """A LlamaForCausalLM subclass whose forward is transformers' own with the loss times
    ``factor`` on the template's line: its source passes every textual check."""
    from transformers.models.llama import modeling_llama

    source = textwrap.dedent(inspect.getsource(transformers.LlamaForCausalLM.forward))
    assert LOSS_LINE in source, "transformers' Llama forward no longer has the template's loss line"
    # auto_docstring reads the defining file's path, which a compiled string has none of.
    source = source.replace(LOSS_LINE, f"{LOSS_LINE} * {factor}").replace("@auto_docstring\n", "")
    filename = f"<scaled-loss-llama-{factor}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = dict(vars(modeling_llama))
    exec(compile(source, filename, "exec"), namespace)
    return type("ScaledLossLlama", (transformers.LlamaForCausalLM,), {"forward": namespace["forward"]})


def falcon_h1(multiplier: float):
    if not hasattr(transformers, "FalconH1Config"):
        pytest.skip("this transformers has no FalconH1")
    config = transformers.FalconH1Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
        mamba_chunk_size=16, lm_head_multiplier=multiplier)
    torch.manual_seed(0)
    return transformers.FalconH1ForCausalLM(config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_a_standard_head_is_accepted(dtype: torch.dtype, bias: bool) -> None:
    for seed in range(2):
        model = tiny_llama(seed=seed)
        if bias:
            model.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=True)
        model = model.to(dtype)
        assert head_support(model) == (True, ""), f"seed {seed}"


@pytest.mark.parametrize("multiplier", [3.0, 0.5])
def test_falcon_h1_scaled_logits_are_refused(multiplier: float) -> None:
    model = falcon_h1(multiplier)
    ok, reason = head_support(model)
    assert not ok and "returns other logits than self.lm_head's" in reason, reason
    with pytest.raises(ValueError, match="scales or changes them"):
        tile_head(model)
    assert "forward" not in model.__dict__


def test_falcon_h1_with_a_unit_multiplier_is_exact_and_accepted() -> None:
    # x * 1.0 is the same bits: the tiled loss is the model's own.
    assert head_support(falcon_h1(1.0)) == (True, "")


@pytest.mark.parametrize("factor", [0.5, 3.0])
def test_a_subclass_scaling_its_loss_is_refused(factor: float) -> None:
    model = tiny_llama(scaled_loss_llama(factor))
    assert causal_lm._read_template(type(model)).reason == "", "the subclass should pass the textual checks"
    ok, reason = head_support(model)
    assert not ok and "scales or changes the loss" in reason, reason


def test_the_check_has_a_wide_margin() -> None:
    # The tolerance is for float32 sums in another order (measured 2e-7 relative); a loss scaled
    # by 1 + 2**-10, far less than any real multiplier, is still caught.
    model = tiny_llama(scaled_loss_llama(1.0 + 2.0 ** -10))
    ok, reason = head_support(model)
    assert not ok and "scales or changes the loss" in reason, reason


def test_weights_that_cannot_be_checked_are_refused() -> None:
    model = tiny_llama()
    with torch.no_grad():
        model.lm_head.weight.zero_()
    ok, reason = head_support(model)
    assert not ok and "cannot be checked" in reason, reason
    with torch.device("meta"):
        model = tiny_llama()
    ok, reason = head_support(model)
    assert not ok and "meta device" in reason, reason


def test_the_check_leaves_the_model_as_it_was() -> None:
    model = tiny_llama()
    calls = []
    model.model.register_forward_hook(lambda *a: calls.append(1))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    assert head_support(model)[0]
    assert calls == [], "the check ran the base model (its hooks fired)"
    assert model._modules["model"] is model.model and isinstance(model.model, transformers.LlamaModel)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(rng, torch.get_rng_state())
