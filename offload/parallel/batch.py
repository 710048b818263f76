"""A causal-LM batch made ready for context parallelism, before any rank shards it: labels
shifted across the whole sequence, global positions, the global count of label tokens, and
the checks ring attention needs. Pure tensor work, no process group.

Why shift first. HF's loss shifts ``labels`` inside the model (token t predicts t + 1). On a
shard that shift would pair each rank's last token with its own first one, and the load
balancer gives rank r two chunks that are not even adjacent; shifted over the whole batch first
(``shift_labels``, the last token -> ``ignore_index``), each token carries its own target and any
layout of the sequence is right.

Why positions. RoPE reads ``position_ids``; a model given none counts 0.. over its shard. The
global ``arange`` is sharded with the tokens, so each token keeps its position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["PreparedBatch", "SEQUENCE_KEYS", "local_attention_mask", "padded_length", "prepare_batch"]

# The HF batch keys whose dim 1 is the sequence, sharded with the tokens. Any other key is passed
# on as it is (an all-ones attention_mask is rebuilt at the local length: see context.py).
SEQUENCE_KEYS = ("input_ids", "inputs_embeds", "labels", "shift_labels", "position_ids", "token_type_ids")

WHERE = "offload.parallel.context_parallel"


def padded_length(length: int, cp_size: int) -> int:
    """The smallest multiple of ``2 * cp_size`` at least ``length``: the lengths torch's
    head-tail load balancer can shard (each rank takes one chunk from the head, one from the
    tail)."""
    step = 2 * cp_size
    return -(-length // step) * step


@dataclass
class PreparedBatch:
    """What :func:`prepare_batch` gives: ``tensors`` to shard on their dim 1 (fresh tensors,
    never the caller's: torch shards buffers in place), ``passed`` to hand to the model as they
    are, and the batch's global figures."""

    tensors: dict[str, Tensor]
    passed: dict[str, Any]
    num_items_in_batch: Tensor  # label tokens not ignored, over the whole (unsharded) batch
    batch_size: int
    length: int  # the global sequence length


def _sequence_of(batch: Mapping[str, Any]) -> Tensor:
    for key in ("input_ids", "inputs_embeds"):
        if isinstance(batch.get(key), Tensor):
            return batch[key]
    raise ValueError(f"{WHERE}: the batch has neither input_ids nor inputs_embeds (keys: {sorted(batch)})")


def _check_attention_mask(mask: Any, batch_size: int, length: int) -> None:
    if not isinstance(mask, Tensor) or mask.dim() != 2 or tuple(mask.shape) != (batch_size, length):
        shape = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(
            f"{WHERE}: attention_mask must be a 2-D padding mask of shape ({batch_size}, {length}), got {shape}; "
            "ring attention is causal with no mask, so leave attention_mask out"
        )
    if not bool(mask.bool().all()):
        raise ValueError(
            f"{WHERE}: the attention_mask has padding (zeros), and ring attention supports only a causal mask with "
            "no padding; pack or trim the batch so that every token is real, or mask padded tokens out of the loss "
            "with labels = -100 and drop the attention_mask"
        )


def _check_positions(positions: Tensor, batch_size: int, length: int) -> None:
    expected = torch.arange(length, device=positions.device)
    if positions.shape[-1] != length or not bool((positions.reshape(-1, length) == expected).all()):
        raise ValueError(
            f"{WHERE}: position_ids must be 0..{length - 1} on every row (one sequence per row): ring attention is "
            "causal over the whole row, so packed sequences (positions that restart) would attend across documents; "
            "leave position_ids out, they are made here"
        )


def prepare_batch(batch: Mapping[str, Any], cp_size: int, ignore_index: int = -100) -> PreparedBatch:
    """The tensors of an HF causal-LM ``batch`` (``input_ids`` or ``inputs_embeds``, ``labels``;
    optional ``position_ids``, ``attention_mask``, ``shift_labels``) to shard over ``cp_size``
    ranks, with ``shift_labels`` made from ``labels`` over the whole sequence (as HF shifts
    them), ``position_ids`` the global ``arange`` and ``num_items_in_batch`` the global count.

    Raises ``ValueError`` for a length that is not a multiple of ``2 * cp_size`` (naming the
    length to pad to), a padding ``attention_mask``, ``position_ids`` that are not 0..T-1 on
    every row, or neither labels nor shift_labels.
    """
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"{WHERE}: the context-parallel size must be an int >= 1, got {cp_size!r}")
    sequence = _sequence_of(batch)
    batch_size, length = int(sequence.shape[0]), int(sequence.shape[1])
    if length % (2 * cp_size):
        raise ValueError(
            f"{WHERE}: the sequence length {length} is not a multiple of 2 x {cp_size} (the context-parallel size): "
            f"torch's load balancer gives each rank one chunk from the head and one from the tail; pad the batch "
            f"to {padded_length(length, cp_size)} tokens (labels -100 on the padding)"
        )
    if batch.get("attention_mask") is not None:
        _check_attention_mask(batch["attention_mask"], batch_size, length)
    labels, shift = batch.get("labels"), batch.get("shift_labels")
    if shift is None:
        if labels is None:
            raise ValueError(f"{WHERE}: the batch has no labels (nor shift_labels): context parallelism here is for training")
        # HF's shift (ForCausalLMLoss): pad right with ignore_index, drop the first column.
        shift = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    positions = batch.get("position_ids")
    if positions is not None:
        _check_positions(positions, batch_size, length)
    positions = torch.arange(length, device=sequence.device).expand(batch_size, length)
    tensors: dict[str, Tensor] = {}
    for key in SEQUENCE_KEYS:
        value = batch.get(key)
        if isinstance(value, Tensor):
            tensors[key] = value
    tensors["shift_labels"], tensors["position_ids"] = shift, positions
    # Fresh contiguous tensors: torch's context_parallel resizes its buffers in place, and the
    # caller's batch must come out of the `with` as it went in.
    tensors = {key: value.clone(memory_format=torch.contiguous_format) for key, value in tensors.items()}
    passed = {key: value for key, value in batch.items() if key not in tensors and key != "attention_mask"}
    num_items = (tensors["shift_labels"] != ignore_index).sum()
    return PreparedBatch(tensors, passed, num_items, batch_size, length)


def local_attention_mask(prepared: PreparedBatch, cp_size: int) -> Tensor:
    """An all-ones padding mask at the local length (see context.py for why one is passed)."""
    device = prepared.tensors["position_ids"].device
    return torch.ones(prepared.batch_size, prepared.length // cp_size, dtype=torch.long, device=device)
