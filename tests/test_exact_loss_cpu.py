"""HF's causal-LM loss over chunks of rows (``offload.tiling.exact_loss``): the same bits as
transformers' ``ForCausalLMLoss`` (loss and the logits' gradient), no float32 ``N x V`` tensor
saved for backward, and ``OffloadActivations(..., model=model)`` running it for its calls only."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import offload
from offload.tiling import exact_loss
from offload.tiling.exact_loss import exact_causal_lm_loss

from _util import llama_grads, tiny_llama

transformers = pytest.importorskip("transformers")
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402


def loss_and_grad(fn: Any, logits: torch.Tensor, labels: torch.Tensor, vocab: int, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.detach().clone().requires_grad_(True)
    loss = fn(x, labels, vocab, **kw)
    loss.backward()
    return loss.detach(), x.grad


def case(dtype: torch.dtype, batch: int, length: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    logits = (torch.randn(batch, length, vocab) * 3).to(dtype)
    labels = torch.randint(0, vocab, (batch, length))
    labels[0, :5] = -100  # some rows ignored
    return logits, labels


@pytest.mark.parametrize("dtype, vocab, chunks", [(torch.float32, 1000, 28), (torch.bfloat16, 5000, 15), (torch.bfloat16, 300, 1)])
@pytest.mark.parametrize("extra", ["none", "num_items", "shift_labels"])
def test_the_loss_and_the_logits_gradient_are_hfs_bit_for_bit(dtype: torch.dtype, vocab: int, chunks: int, extra: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # 28 and 15 chunks of the 2 x 97 rows: 7 and 13 rows each, the last one shorter; or one chunk.
    monkeypatch.setattr(exact_loss, "CHUNKS", chunks)
    logits, labels = case(dtype, 2, 97, vocab)
    kw: dict[str, Any] = {"none": {}, "num_items": {"num_items_in_batch": torch.tensor(123)},
                          "shift_labels": {"shift_labels": torch.randint(0, vocab, (2, 97))}}[extra]
    hf = loss_and_grad(ForCausalLMLoss, logits, labels, vocab, **kw)
    assert torch.equal(hf[0], loss_and_grad(ForCausalLMLoss, logits, labels, vocab, **kw)[0])  # HF repeats itself
    ours = loss_and_grad(exact_causal_lm_loss, logits, labels, vocab, **kw)
    assert torch.equal(hf[0], ours[0]), (hf[0].item(), ours[0].item())
    assert ours[1].dtype == dtype and torch.equal(hf[1], ours[1])


def test_every_row_ignored_gives_hfs_nan_and_zero_gradient() -> None:
    logits, labels = case(torch.float32, 2, 16, 50)
    labels[:] = -100
    hf, ours = loss_and_grad(ForCausalLMLoss, logits, labels, 50), loss_and_grad(exact_causal_lm_loss, logits, labels, 50)
    assert torch.isnan(hf[0]) and torch.isnan(ours[0]) and torch.equal(hf[1], ours[1])


def test_ignore_index_zero_runs_hfs_own_loss() -> None:
    # The column's one class is 0: a label 0 could not be told from an ignored row there.
    logits, labels = case(torch.float32, 2, 16, 50)
    labels[labels == -100] = 0
    hf = loss_and_grad(ForCausalLMLoss, logits, labels, 50, ignore_index=0)
    ours = loss_and_grad(exact_causal_lm_loss, logits, labels, 50, ignore_index=0)
    assert torch.equal(hf[0], ours[0]) and torch.equal(hf[1], ours[1])


def saved_bytes(fn: Any, logits: torch.Tensor, labels: torch.Tensor, vocab: int) -> int:
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    x = logits.detach().clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(x, labels, vocab)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    del loss
    return sum(storages.values())


def test_backward_keeps_the_logits_not_a_float32_copy_of_them() -> None:
    logits, labels = case(torch.bfloat16, 2, 128, 4000)
    logit_bytes = logits.numel() * logits.element_size()
    hf, ours = saved_bytes(ForCausalLMLoss, logits, labels, 4000), saved_bytes(exact_causal_lm_loss, logits, labels, 4000)
    assert hf >= 2 * logit_bytes  # the float32 log-softmax: twice the bf16 logits
    assert logit_bytes <= ours <= logit_bytes + 64 * 1024  # the logits, the labels and a column


@pytest.mark.usefixtures("deterministic")
def test_a_planning_context_given_the_model_runs_it_for_its_calls_only(monkeypatch: pytest.MonkeyPatch) -> None:
    model, ids = tiny_llama()
    expected = llama_grads(model, ids)
    assert all(torch.equal(a, b) for a, b in zip(expected, llama_grads(model, ids)))
    calls: list[int] = []
    real = exact_loss.exact_causal_lm_loss

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr("offload.layers.model_form.exact_causal_lm_loss", counted)
    ctx = offload.OffloadActivations(model.model.layers, model=model, memory_budget_bytes="lowest", device="cpu",
                                     min_offload_bytes=0)
    for step in range(4):  # probe steps, then planned ones: each loss through it, bit for bit
        got = llama_grads(model, ids, ctx)
        assert all(torch.equal(a, b) for a, b in zip(expected, got)), step
        assert len(calls) == step + 1
        assert model.loss_function is ForCausalLMLoss and "_loss_function" not in model.__dict__
    llama_grads(model, ids)  # outside the context: HF's own loss
    assert len(calls) == 4
    ctx.close()


def test_a_loss_function_the_user_set_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    model, ids = tiny_llama()
    ctx = offload.OffloadActivations(model.model.layers, model=model, memory_budget_bytes="lowest", device="cpu",
                                     min_offload_bytes=0)
    seen: list[int] = []

    def users_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(1)
        return ForCausalLMLoss(*args, **kwargs)

    model.loss_function = users_loss
    llama_grads(model, ids, ctx)
    assert seen == [1] and model.loss_function is users_loss
    ctx.close()
