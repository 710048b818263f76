"""The model matrix's cache cells on the GPU (issue 48): the default (``"device"``, whose first step
is the low-memory sizing probe: every layer checkpointed), ``"lowest"`` and the model form, each 5
steps bitwise against plain with the returned cache as plain's; a cache written in place refused
at the first step. The cells and helpers are those of ``test_model_matrix_cpu.py``."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import offload
from offload.forwards.stateful import StatefulArgumentError

transformers = pytest.importorskip("transformers")
from test_model_matrix_cpu import (  # noqa: E402
    LENGTH, _cache_name, assert_step_equal, batch, layers_of, make_context, reference, run_step,
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


def test_a_cache_written_in_place_is_refused_at_the_first_step_on_the_gpu(repeatable_attention: None) -> None:
    ref = reference("llama", "eager", True, device="cuda")
    model = copy.deepcopy(ref.model)
    context = _context("default", model, ref.saved_bytes)
    ids, mask, labels = batch(0, "cuda")
    cache = transformers.StaticCache(config=model.config, max_cache_len=LENGTH)
    try:
        with pytest.raises(StatefulArgumentError, match="LlamaDecoderLayer.*StaticCache.*use_cache=False"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with context:
                    model(input_ids=ids, attention_mask=mask, labels=labels, **{_cache_name(model): cache})
    finally:
        context.close()
