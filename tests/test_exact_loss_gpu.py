"""GPU tests of HF's causal-LM loss over chunks of rows (``offload.tiling.exact_loss``): HF's bits
on CUDA at LLAMA's vocabulary with chunks that do not divide the rows, and the memory it holds
against HF's, measured with ``max_memory_allocated``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from offload.tiling import exact_loss
from offload.tiling.exact_loss import exact_causal_lm_loss

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
transformers = pytest.importorskip("transformers")
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

VOCAB = 32000


def batch(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    logits = (torch.randn(4, rows // 4, VOCAB, device="cuda") * 3).to(torch.bfloat16)
    labels = torch.randint(0, VOCAB, (4, rows // 4), device="cuda")
    labels[1, :100] = -100
    return logits, labels


def step(fn: Any, logits: torch.Tensor, labels: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Loss, the logits' gradient and the peak bytes above what was allocated before."""
    x = logits.detach().clone().requires_grad_(True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = fn(x, labels, VOCAB, **kw)
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), x.grad, torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("kw", [{}, {"num_items_in_batch": torch.tensor(5000)}])
def test_hfs_bits_on_cuda_with_chunks_that_do_not_divide_the_rows(kw: dict[str, Any]) -> None:
    logits, labels = batch(8196)
    hf = step(ForCausalLMLoss, logits, labels, **kw)
    assert torch.equal(hf[0], step(ForCausalLMLoss, logits, labels, **kw)[0])
    assert torch.equal(hf[1], step(ForCausalLMLoss, logits, labels, **kw)[1])  # HF repeats itself
    assert 8196 % exact_loss._rows_per_chunk(8196) != 0
    ours = step(exact_causal_lm_loss, logits, labels, **kw)
    assert torch.equal(hf[0], ours[0]), (hf[0].item(), ours[0].item())
    assert torch.equal(hf[1], ours[1])


def test_it_holds_the_logits_gradient_and_a_chunk_where_hf_holds_float32_copies() -> None:
    logits, labels = batch(16384)
    float_bytes = logits.numel() * 4  # one float32 N x V tensor: 1.95 GiB
    hf, ours = step(ForCausalLMLoss, logits, labels), step(exact_causal_lm_loss, logits, labels)
    assert torch.equal(hf[1], ours[1])
    # HF: the upcast, the log-softmax, nll's gradient and the log-softmax's backward output
    # overlap (at least three float32 copies); ours: the gradient in bf16 plus one chunk's four.
    assert hf[2] >= 3 * float_bytes, hf[2]
    assert ours[2] <= float_bytes // 2 + 4 * float_bytes // exact_loss.CHUNKS + (64 << 20), (ours[2], hf[2])


def test_its_working_set_grows_with_the_rows_as_the_planner_scales_it() -> None:
    # offload.planner.scaling scales a profile's head bytes with its tokens: the chunks are a
    # share of the rows, so 4x the rows holds 4x the bytes (a fixed-size chunk would not).
    peaks = []
    for rows in (4096, 16384):
        logits, labels = batch(rows)
        peaks.append(step(exact_causal_lm_loss, logits, labels)[2])
        del logits, labels
    assert 3.8 <= peaks[1] / peaks[0] <= 4.2, peaks
