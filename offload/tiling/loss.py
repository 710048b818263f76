"""The LM head and its cross-entropy over chunks of tokens: the ``N x vocab`` logits never exist
whole, and backward recomputes each chunk's logits from the saved hidden states.

Why. HuggingFace's causal-LM loss computes the logits for every token, upcasts them to float32
and keeps a gradient of that size: at 262,144 tokens and a 128,256-word vocabulary that is
125 GiB. Here the head runs ``chunk_tokens`` rows at a time, so at most one chunk's logits
(:func:`head_chunk_bytes`) are alive, in forward and in backward.

Numerics follow HF's ``ForCausalLMLoss``: each chunk's logits are ``F.linear`` in the hidden
states' dtype, then ``.float()``, then ``F.cross_entropy(..., reduction="sum")``; the loss is the
sum over chunks divided by ``num_items`` (HF's ``num_items_in_batch``) or by the number of rows
not ignored (HF's mean: all rows ignored gives nan, as there). Backward writes the gradient
autograd would: ``(softmax - onehot) * grad / denominator`` in float32, zero on ignored rows,
cast to the hidden dtype (the backward of ``.float()``), then the two GEMMs of the linear.

What differs from the untiled head is the order of sums: the loss is a sum of per-chunk sums,
and the weight (and bias) gradient a float32 sum of per-chunk products. Agreement with the
untiled computation, as the tests hold it:

- float32: loss and gradients within rtol 1e-5, atol 1e-6 (measured: 4e-7 of the largest entry);
- bfloat16: the loss within rtol 1e-5 (summed in float32 either way); each gradient within 2**-6
  of its largest entry. HF's own bf16 gradients are off from a float64 computation by up to 8e-3
  of their largest entry, and tiling adds one bf16 rounding per chunk to the weight gradient
  (each chunk's GEMM rounds before the float32 sum; measured differences up to 4.4e-3), so the
  bound is about twice HF's own error; the tiled error against float64 stays within twice HF's.

Under autocast (float32 weights, bf16 GEMMs: HF Trainer's ``bf16=True``) the logits come out in
autocast's dtype, as HF's do; backward recomputes them under the forward's autocast state even
when it runs outside the ``with torch.autocast`` block, and its GEMMs run in that dtype.

The final norm may run inside the chunks too (``norm``: a module that works token by token, the
base model's ``RMSNorm``): then the hidden states given are the last layer's, before the norm, and
each chunk is normed, projected and scored in turn; backward recomputes the chunk's norm and
takes its gradients from autograd. Untiled, the norm's float32 upcast and its saved tensors are
held for the whole step (the head's peak 6.75 bytes a hidden element higher on the H200, bf16);
chunked, one chunk's. Its weight gradient is a float32 sum of per-chunk gradients.

Repeatable: chunks run in a fixed order and every sum is ours or a GEMM's (no atomics of ours),
so two runs give the same bits. Saved tensors go through ``ctx.save_for_backward``, hence through
the saved-tensor hooks: an offload context may move the hidden states to the host until backward.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = [
    "check_chunk_tokens", "head_chunk_bytes", "default_head_chunk", "linear_cross_entropy", "causal_lm_loss",
]

# Bytes per (token, vocabulary word) of one chunk's working set: the logits in the hidden dtype
# (2), their float32 copy (4), the float32 softmax that becomes the gradient (4), and that
# gradient cast back to the hidden dtype (2).
_CHUNK_BYTES_PER_LOGIT = 12

# The smallest chunk default_head_chunk picks: smaller GEMMs lose more speed than they save.
_MIN_DEFAULT_CHUNK = 1024


def check_chunk_tokens(chunk_tokens: object, where: str) -> int:
    """``chunk_tokens`` as an int of at least 1, or a ``ValueError`` that names it and ``where``
    (the call that was given it)."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int):
        raise ValueError(f"{where}: chunk_tokens must be an int >= 1 (tokens per chunk), got {chunk_tokens!r}")
    if chunk_tokens < 1:
        raise ValueError(f"{where}: chunk_tokens must be >= 1 (tokens per chunk), got {chunk_tokens}")
    return chunk_tokens


def head_chunk_bytes(chunk_tokens: int, vocab_size: int) -> int:
    """Device bytes one chunk of the tiled head holds at its peak, for a 2-byte hidden dtype:
    ``12 x chunk_tokens x vocab_size`` (the logits in the hidden dtype, 2 B; their float32 copy,
    4 B; the float32 softmax that becomes the logits' gradient, 4 B; that gradient in the hidden
    dtype, 2 B). The planner adds this to the head's peak when it tiles the head; the float32
    weight-gradient sum (``vocab x hidden x 4``) is counted apart."""
    return _CHUNK_BYTES_PER_LOGIT * chunk_tokens * vocab_size


def default_head_chunk(vocab_size: int, target_bytes: int = 1 << 30) -> int:
    """The largest power of two whose :func:`head_chunk_bytes` is at most ``target_bytes``, and
    at least 1024 (e.g. 2048 tokens for a 32,000-word vocabulary, 1024 for 128,256)."""
    if vocab_size < 1:
        raise ValueError(f"offload.tiling.default_head_chunk: vocab_size must be >= 1, got {vocab_size}")
    chunk = _MIN_DEFAULT_CHUNK
    while head_chunk_bytes(chunk * 2, vocab_size) <= target_bytes:
        chunk *= 2
    return chunk


def _check_inputs(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor]) -> None:
    where = "offload.tiling.linear_cross_entropy"
    if hidden.dim() != 2:
        raise ValueError(f"{where}: hidden must be 2-D (tokens, hidden size), got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"{where}: weight must be (vocab, hidden size) with hidden size {hidden.shape[1]} like hidden's, "
            f"got shape {tuple(weight.shape)}"
        )
    if labels.dim() != 1 or labels.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"{where}: labels must be 1-D with one target per row of hidden ({hidden.shape[0]}), "
            f"got shape {tuple(labels.shape)}"
        )
    if labels.dtype != torch.int64:
        raise ValueError(f"{where}: labels must be int64 (class indices), got {labels.dtype}")
    if labels.device != hidden.device:
        raise ValueError(f"{where}: labels are on {labels.device}, hidden on {hidden.device}; move them first")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{where}: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")


def _denominator(labels: Tensor, ignore_index: int, num_items: Optional[Union[int, Tensor]]) -> Tensor:
    # A float32 scalar on the labels' device, so that neither the loss nor its gradient waits
    # on the host (no .item()).
    if num_items is None:
        return (labels != ignore_index).sum().to(torch.float32)
    if isinstance(num_items, Tensor):
        return num_items.detach().to(device=labels.device, dtype=torch.float32).reshape(())
    return torch.tensor(float(num_items), dtype=torch.float32, device=labels.device)


class _LinearCrossEntropy(torch.autograd.Function):
    """The tiled head and loss (see the module notes); called by :func:`linear_cross_entropy`.
    ``norm`` (or None) runs on each chunk first; its parameters come last among the inputs, so
    that their gradients reach autograd's accumulation (and FSDP's or DDP's hooks) as any
    input's do."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                denom: Tensor, chunk_tokens: int, ignore_index: int, norm: Optional[torch.nn.Module],
                *norm_params: Tensor) -> Tensor:
        device_type = hidden.device.type
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        compute_dtype = hidden.dtype
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = hidden[start:start + chunk_tokens]
            logits = F.linear(norm(rows) if norm is not None else rows, weight, bias)
            compute_dtype = logits.dtype  # hidden's, or autocast's
            loss = F.cross_entropy(logits.float(), labels[start:start + chunk_tokens],
                                   ignore_index=ignore_index, reduction="sum")
            del logits  # one chunk's logits alive at a time
            total = total + loss
        ctx.save_for_backward(hidden, weight, bias, labels, denom)
        ctx.chunk_tokens, ctx.ignore_index, ctx.compute_dtype = chunk_tokens, ignore_index, compute_dtype
        ctx.norm = norm
        # Backward recomputes the logits under this autocast state, so that they are the
        # forward's bits: callers usually run backward outside their autocast block.
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        return total / denom

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Optional[Tensor], ...]:
        hidden, weight, bias, labels, denom = ctx.saved_tensors
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        want_bias = want_bias and bias is not None
        chunk, ignore_index, dtype = ctx.chunk_tokens, ctx.ignore_index, ctx.compute_dtype
        device_type, autocast_on, autocast_dtype = ctx.autocast
        norm = ctx.norm
        # The norm's parameters as its forward reads them now (FSDP has gathered them again for
        # backward), those that want a gradient.
        params = list(norm.parameters()) if norm is not None else []
        want_params = [want and p.requires_grad for want, p in zip(ctx.needs_input_grad[8:], params)]
        grad_params = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) if want else None
                       for want, p in zip(want_params, params)]
        # The gradient into the norm's output, chunk by chunk: wanted for the hidden states or
        # the norm's parameters.
        want_normed = want_hidden or any(want_params)
        scale = grad_loss.to(torch.float32) / denom
        # The weight as the head's GEMM saw it (a no-op unless autocast cast it), cast once.
        weight_c = weight.to(dtype) if want_normed else weight
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        # float32 sums in a fixed chunk order; no buffer at all for a frozen head.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if want_bias else None
        for start in range(0, hidden.shape[0], chunk):
            stop = start + chunk
            y = labels[start:stop]
            rows, normed = hidden[start:stop], None
            if norm is not None:
                # The chunk's norm again, now recorded, so that autograd gives its gradients.
                rows = rows.detach().requires_grad_(want_hidden)
                with torch.enable_grad(), torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on):
                    normed = norm(rows)
            with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on):
                logits = F.linear(normed.detach() if normed is not None else rows, weight, bias)
            # The gradient of cross_entropy in float32, written over the softmax in place:
            # softmax * s - onehot * s, with s = grad / denom on kept rows and 0 on ignored ones.
            grad = torch.softmax(logits.float(), dim=-1)
            del logits
            keep = y != ignore_index
            # where, not a product: with every row ignored the denominator is 0 and s is inf,
            # yet autograd's gradient is 0 there (ignored rows get none).
            row_scale = torch.where(keep, scale, 0.0).unsqueeze(1)
            grad.mul_(row_scale)
            # One target per row: gather and scatter, not scatter_add_ (atomics on CUDA).
            target = torch.where(keep, y, 0).unsqueeze(1)
            grad.scatter_(1, target, grad.gather(1, target) - row_scale)
            # The backward of .float(): the gradient reaches the linear in the logits' dtype.
            grad = grad.to(dtype)
            head_input = normed.detach() if normed is not None else rows
            if normed is not None and want_normed:
                _norm_backward(normed, rows, torch.mm(grad, weight_c), params, want_params, grad_params,
                               grad_hidden[start:stop] if grad_hidden is not None else None)
            elif grad_hidden is not None:
                if grad_hidden.dtype == dtype:
                    torch.mm(grad, weight_c, out=grad_hidden[start:stop])
                else:  # autocast: the GEMM ran in its dtype, the input keeps its own
                    grad_hidden[start:stop] = torch.mm(grad, weight_c)
            if grad_weight is not None:
                grad_weight.add_(torch.mm(grad.t(), head_input.to(dtype)))
            if grad_bias is not None:
                grad_bias.add_(grad.sum(0, dtype=torch.float32))
            del grad, normed
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            grad_bias.to(bias.dtype) if grad_bias is not None else None,
            None, None, None, None, None,
            *(g.to(p.dtype) if g is not None else None for g, p in zip(grad_params, params)),
        )


def _norm_backward(normed: Tensor, rows: Tensor, grad_normed: Tensor, params: list[Tensor],
                   want_params: list[bool], grad_params: list[Optional[Tensor]], grad_rows: Optional[Tensor]) -> None:
    """One chunk's norm backward: its input's gradient written into ``grad_rows`` (when wanted),
    its parameters' added to their float32 sums."""
    inputs = ([rows] if grad_rows is not None else []) + [p for p, want in zip(params, want_params) if want]
    grads = torch.autograd.grad(normed, inputs, grad_normed.to(normed.dtype))
    if grad_rows is not None:
        grad_rows.copy_(grads[0])
        grads = grads[1:]
    wanted = iter(grads)
    for want, total in zip(want_params, grad_params):
        if want:
            total.add_(next(wanted).float())  # type: ignore[union-attr]


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Optional[Tensor] = None,
                         chunk_tokens: int, ignore_index: int = -100,
                         num_items: Optional[Union[int, Tensor]] = None,
                         norm: Optional[torch.nn.Module] = None) -> Tensor:
    """``cross_entropy(F.linear(hidden, weight, bias).float(), labels)`` computed over chunks of
    ``chunk_tokens`` rows, never holding more than one chunk's logits (see the module notes for
    the numerics and the tolerances against the untiled computation). ``norm``: a token-wise
    module applied to each chunk first (``F.linear(norm(hidden), ...)``, the norm's float32
    working set never whole), differentiable in its parameters too.

    ``hidden``: (N, H); ``weight``: (V, H); ``labels``: (N,) int64, row n's target, on hidden's
    device (rows equal to ``ignore_index`` count for nothing). Returns a float32 scalar: the
    summed loss divided by ``num_items`` (an int or a 0-dim tensor, HF's ``num_items_in_batch``)
    or, if None, by the number of rows not ignored (nan when all are). Differentiable in
    ``hidden``, ``weight`` and ``bias``, once; only the gradients autograd asks for are computed.
    Raises ``ValueError`` for a bad ``chunk_tokens`` or mismatched shapes.
    """
    check_chunk_tokens(chunk_tokens, "offload.tiling.linear_cross_entropy")
    _check_inputs(hidden, weight, labels, bias)
    denom = _denominator(labels, ignore_index, num_items)
    params = tuple(norm.parameters()) if norm is not None else ()
    return _LinearCrossEntropy.apply(hidden, weight, bias, labels, denom, chunk_tokens, ignore_index, norm, *params)


def causal_lm_loss(hidden_states: Tensor, lm_head: torch.nn.Linear, labels: Optional[Tensor], *,
                   chunk_tokens: int, ignore_index: int = -100,
                   num_items_in_batch: Optional[Union[int, Tensor]] = None,
                   shift_labels: Optional[Tensor] = None, norm: Optional[torch.nn.Module] = None) -> Tensor:
    """HF's causal-LM loss (``ForCausalLMLoss``) of ``lm_head`` over ``hidden_states`` (B, T, H),
    tiled by :func:`linear_cross_entropy` (``norm``: the final norm, run inside the chunks on
    hidden states given before it).

    The targets are ``shift_labels`` as given (B, T), or ``labels`` (B, T) shifted as HF shifts
    them: padded on the right with ``ignore_index`` and moved one token left, so token t predicts
    token t + 1 and the last token of each row predicts nothing. ``num_items_in_batch``: as HF's
    (the loss is a sum divided by it); None: the mean over the targets not ignored.
    """
    if shift_labels is None:
        if labels is None:
            raise ValueError("offload.tiling.causal_lm_loss: give labels or shift_labels")
        padded = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = padded[..., 1:]
    targets = shift_labels.reshape(-1).to(hidden_states.device)
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    return linear_cross_entropy(
        hidden, lm_head.weight, targets, bias=lm_head.bias, chunk_tokens=chunk_tokens,
        ignore_index=ignore_index, num_items=num_items_in_batch, norm=norm,
    )
