"""HuggingFace's causal-LM loss, bit for bit, holding one chunk of rows' float32 working set at a
time rather than all of it (:func:`exact_causal_lm_loss`).

Why. ``ForCausalLMLoss`` upcasts all ``N x V`` logits to float32, and ``cross_entropy`` keeps their
float32 log-softmax for backward, whose backward then builds two more float32 ``N x V`` tensors.
At LLAMA-1B's 4 x 8192 tokens (V = 32,000) that is 3.9 GiB each: the loss held about 10 GiB at its
forward's peak and more in backward, 40% of a 24 GiB budget, and the planner made room for it by
recomputing the layers (docs/benchmarks.md).

Exact, because every float32 step of HF's loss works row by row: the upcast, the log-softmax (one
row per CUDA block or CPU task, whatever the row count), ``nll_loss``'s gradient (a value written
at each row's label) and the log-softmax's backward. So they run here on :data:`CHUNKS` chunks
of rows and give each row its bits:

- forward keeps only the logits (in their own dtype; HF's output holds them anyway) and takes each
  row's log-probability of its label into an ``N x 1`` column (:class:`_LabelLogProbs`);
- the loss is ``nll_loss`` over that column (labels 0, ignored rows still ignored). Its kernel reads
  ``input[i, label_i]`` and sums rows in an order set by the row count alone (the class count only
  strides the reads), so the loss has HF's bits, and its gradient is the value HF's ``nll_loss``
  writes at each label;
- backward recomputes each chunk's upcast and log-softmax from the saved logits, puts the column's
  gradient at the labels, runs the log-softmax's backward op, and casts to the logits' dtype (the
  backward of the upcast).

Labels, shifting, ``num_items_in_batch`` and ``ignore_index`` are HF's. Where a row could not be
mapped (``ignore_index`` 0, which the column's one class would meet), HF's own loss runs.
Recomputing the log-softmax in backward costs one more pass over the float32 logits (a few ms at
4 x 8192 on an H200).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = ["CHUNKS", "exact_causal_lm_loss", "hf_causal_lm_loss"]

# The rows run in this many chunks: a chunk's backward holds four float32 chunks of logits (the
# upcast, the log-softmax, its gradient, the gradient in), 1 byte a logit, beside the logits'
# gradient (2 bytes in bf16). A fixed share, not a fixed size: the planner scales a profile's head
# bytes with the tokens (offload.planner.scaling), and a fixed-size chunk measured at one length
# would be counted 8x too small at 1/8 of it (a plan for 4096 tokens made from an 8192-token probe
# went 2.5% over its budget on the H200).
CHUNKS = 16


def _rows_per_chunk(rows: int) -> int:
    return max(1, -(-rows // CHUNKS))


class _LabelLogProbs(torch.autograd.Function):
    """``log_softmax(logits.float(), 1).gather(1, labels)`` (an ``N x 1`` float32 column), one
    chunk of rows at a time, saving only the logits and the labels."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, labels: Tensor) -> Tensor:  # type: ignore[override]
        rows = _rows_per_chunk(logits.shape[0])
        column = torch.empty(logits.shape[0], 1, dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], rows):
            end = min(start + rows, logits.shape[0])
            log_probs = torch.log_softmax(logits[start:end].float(), 1)
            torch.gather(log_probs, 1, labels[start:end, None], out=column[start:end])
            del log_probs  # (before the next chunk's: one chunk alive at a time)
        ctx.save_for_backward(logits, labels)
        return column

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_column: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        logits, labels = ctx.saved_tensors
        rows = _rows_per_chunk(logits.shape[0])
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], rows):
            end = min(start + rows, logits.shape[0])
            log_probs = torch.log_softmax(logits[start:end].float(), 1)
            grad_log_probs = torch.zeros_like(log_probs).scatter_(1, labels[start:end, None], grad_column[start:end])
            grad_in = torch.ops.aten._log_softmax_backward_data(grad_log_probs, log_probs, 1, torch.float32)
            grad_logits[start:end].copy_(grad_in)  # (the upcast's backward: a cast, as Tensor.to rounds)
            del log_probs, grad_log_probs, grad_in  # (before the next chunk's: one chunk alive at a time)
        return grad_logits, None


def hf_causal_lm_loss() -> Callable[..., Tensor]:
    """transformers' ``ForCausalLMLoss`` (imported when asked: transformers is optional)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss


def exact_causal_lm_loss(logits: Tensor, labels: Tensor, vocab_size: int, num_items_in_batch: Optional[Tensor] = None,
                         ignore_index: int = -100, shift_labels: Optional[Tensor] = None, **kwargs: Any) -> Tensor:
    """transformers' ``ForCausalLMLoss`` with the same arguments and the same bits (loss and the
    logits' gradient), its float32 working set held one chunk of rows at a time (module notes).
    Set it as a model's ``loss_function``, or let ``OffloadActivations(..., model=model)`` do so
    for its untiled calls."""
    if ignore_index == 0:
        return hf_causal_lm_loss()(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs)
    if shift_labels is None:
        # Shift so that tokens < n predict n (as HF does).
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    flat = logits.reshape(-1, vocab_size)
    targets = shift_labels.reshape(-1).to(flat.device)
    ignored = targets == ignore_index
    column = _LabelLogProbs.apply(flat, targets.masked_fill(ignored, 0))
    # The column's one class is 0: a label row reads its log-probability there, an ignored one
    # stays ignored.
    column_targets = torch.zeros_like(targets).masked_fill_(ignored, ignore_index)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.nll_loss(column, column_targets, ignore_index=ignore_index, reduction=reduction)
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss
