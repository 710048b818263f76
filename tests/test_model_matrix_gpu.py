"""The model matrix's cache cells on the GPU (issue 48): the default (``"device"``, whose first step
is the low-memory sizing probe: every layer checkpointed), ``"lowest"`` and the model form, each 5
steps bitwise against plain with the returned cache as plain's; a cache written in place refused
at the first step, or, where transformers creates its tensors lazily, left exactly as plain leaves it. The cells and helpers are those of ``test_model_matrix_cpu.py``."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch

import offload
from offload.forwards.stateful import StatefulArgumentError

transformers = pytest.importorskip("transformers")
from test_model_matrix_cpu import (  # noqa: E402
    LENGTH, _cache_name, assert_same_contents, assert_step_equal, batch, cache_contents, layers_of, make_context,
    reference, run_step,
)

pytestmark = pytest.mark.cuda

CELLS = [("llama", "eager"), ("llama", "sdpa"), ("gemma2", "eager"), ("gpt2", "eager"), ("mixtral", "eager")]


def _context(mode: str, model: torch.nn.Module, saved_bytes: int) -> offload.OffloadActivations:
    if mode == "default":
        return offload.OffloadActivations(layers_of(model), min_offload_bytes=0)
    return make_context(mode, model, saved_bytes, device="cuda")


@pytest.mark.parametrize("mode", ["default", "lowest", "model"])
@pytest.mark.parametrize("family,attention", CELLS, ids=[f"{f}-{a}" for f, a in CELLS])
def test_cache_cell_is_plain_bit_for_bit_on_the_gpu(family: str, attention: str, mode: str,
                                                    repeatable_attention: None) -> None:
    ref = reference(family, attention, True, device="cuda")
    model = copy.deepcopy(ref.model)
    context = _context(mode, model, ref.saved_bytes)
    try:
        for i, expected in enumerate(ref.steps):
            assert_step_equal(expected, run_step(model, i, context), f"step {i}")
    finally:
        context.close()


def _static_cache_step(model: torch.nn.Module, context: object = None) -> tuple[torch.Tensor, dict, list]:
    """One step against a fresh ``StaticCache``: the loss, every gradient, the cache's contents."""
    ids, mask, labels = batch(0, "cuda")
    cache = transformers.StaticCache(config=model.config, max_cache_len=LENGTH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with context if context is not None else contextlib.nullcontext():
            out = model(input_ids=ids, attention_mask=mask, labels=labels, **{_cache_name(model): cache})
        out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads, cache_contents(cache)


def test_a_cache_written_in_place_is_refused_or_left_exact_at_the_first_step_on_the_gpu(repeatable_attention: None) -> None:
    # A StaticCache whose tensors exist before the call is written in place: refused in the forward
    # of the first step (the low-memory sizing probe checkpoints every layer). Where the installed
    # transformers creates them lazily, in the first update (5.17 does), the recompute runs against
    # the state before the call, which has none, and the objects the forward left are put back: then
    # the step must be plain's bit for bit, the cache's contents included. Never silently wrong.
    ref = reference("llama", "eager", True, device="cuda")
    plain = copy.deepcopy(ref.model)
    expected = _static_cache_step(plain)
    assert_same_contents(expected[2], _static_cache_step(copy.deepcopy(ref.model))[2], "plain, twice")
    model = copy.deepcopy(ref.model)
    context = _context("default", model, ref.saved_bytes)
    try:
        try:
            loss, grads, contents = _static_cache_step(model, context)
        except StatefulArgumentError as exc:
            message = str(exc)
            assert "LlamaDecoderLayer" in message and "StaticCache" in message and "use_cache=False" in message, message
            return
        assert torch.equal(loss, expected[0]), "the loss differs from plain's"
        assert grads.keys() == expected[1].keys()
        for name, grad in grads.items():
            assert torch.equal(grad, expected[1][name]), f"{name}'s gradient differs from plain's"
        assert_same_contents(expected[2], contents, "the StaticCache after the step")
    finally:
        context.close()
