"""torch.compile and OffloadActivations in either order.

Offload first, compile second: the compiled model calls the layer hooks (they exist when Dynamo
traces it), so layers are offloaded and gradients are exact. Compile first (one compiled step run
before the context is created): Dynamo does not guard on module hooks by default, so the compiled
code never calls them and nothing is offloaded; the warning must say so and give the fix, not
blame the layer list, and the fix it gives must work.
"""

from __future__ import annotations

import re

import warnings
from typing import Any, Iterator

import pytest
import torch

import offload
from offload.models import GPT


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model() -> tuple[GPT, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(vocab=100, hidden=64, heads=4, layers=4, max_seq=32)
    return model, torch.randint(0, 100, (2, 32))


def _step(model: GPT, run: Any, idx: torch.Tensor, oa: Any = None) -> tuple[list[torch.Tensor], list[str]]:
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with oa if oa is not None else torch.enable_grad():
            loss = run(idx).float().mean()
        loss.backward()
    return [p.grad.clone() for p in model.parameters()], [str(w.message) for w in caught]


def test_offload_first_then_compile_offloads_with_exact_gradients(fresh_dynamo: None) -> None:
    model, idx = _model()
    expected, _ = _step(model, model, idx)
    oa = offload.OffloadActivations(model.layers, device="cpu", min_offload_bytes=0, group_bytes=0)
    compiled = torch.compile(model, backend="aot_eager")
    for _ in range(2):
        got, messages = _step(model, compiled, idx, oa)
        assert all(torch.equal(a, b) for a, b in zip(expected, got))
        assert oa.stats["groups_offloaded"] == 3, messages


def test_compile_first_then_offload_names_the_real_cause_and_its_fix_works(fresh_dynamo: None) -> None:
    model, idx = _model()
    expected, _ = _step(model, model, idx)
    compiled = torch.compile(model, backend="aot_eager")
    _step(model, compiled, idx)  # one compiled step before the context exists
    oa = offload.OffloadActivations(model.layers, device="cpu", min_offload_bytes=0, group_bytes=0)
    got, messages = _step(model, compiled, idx, oa)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert oa.stats["groups_offloaded"] == 0
    told = [m for m in messages if "ran none of the 4 layers" in m]
    assert told, f"no warning says why nothing was offloaded: {messages}"
    assert "torch.compile" in told[0] and "skip_nnmodule_hook_guards" in told[0]
    assert "torch.compiler.reset()" in told[0]
    assert not any(re.search("pass the modules (one|the) forward really calls", m) for m in messages), \
        "the warning blames the layer list, which was right"
    # The fix it gives: compile again now that the hooks exist.
    torch.compiler.reset()
    got, messages = _step(model, compiled, idx, oa)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert oa.stats["groups_offloaded"] == 3, messages


def test_a_wrong_layer_list_without_compiled_code_still_blames_the_list(fresh_dynamo: None) -> None:
    model, idx = _model()
    other, _ = _model()
    oa = offload.OffloadActivations(other.layers, device="cpu", min_offload_bytes=0, group_bytes=0)
    _, messages = _step(model, model, idx, oa)
    assert any("pass the modules the forward really calls" in m for m in messages), messages
