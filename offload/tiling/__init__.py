"""Tiling along the sequence: work whose memory grows as tokens x a wide dimension (the LM head's
``T x vocab`` logits, an MLP's ``T x intermediate``) runs chunk by chunk, and backward recomputes
each chunk, so the wide tensor never exists whole.

- :mod:`offload.tiling.loss`: the LM head and the cross-entropy over chunks of tokens.
- :mod:`offload.tiling.causal_lm`: the same for a HuggingFace ``*ForCausalLM`` (its ``lm_head``
  and loss, labels shifted as HF shifts them).
- :mod:`offload.tiling.tokenwise`: any module that works token by token (an MLP) over chunks.
- :mod:`offload.tiling.exact_loss`: HF's causal-LM loss over chunks of rows, not tiled but exact
  (its bits, loss and gradient), holding a chunk's float32 working set rather than all of it.

Tiling changes the order of sums (a weight gradient is summed chunk by chunk), so a tiled step
is not bitwise equal to an untiled one; it is bitwise repeatable, and bitwise equal with and
without offload. Plans tile only where no untiled plan fits (``offload.planner``).
"""

from .causal_lm import TiledHead, final_norm_support, head_support, tile_head
from .exact_loss import exact_causal_lm_loss
from .loss import causal_lm_loss, default_head_chunk, linear_cross_entropy
from .tokenwise import TiledTokenwise, tile_tokenwise, tiled_tokenwise, tokenwise_support

__all__ = [
    "TiledHead", "TiledTokenwise", "causal_lm_loss", "default_head_chunk", "exact_causal_lm_loss", "final_norm_support",
    "head_support",
    "linear_cross_entropy",
    "tile_head", "tile_tokenwise", "tiled_tokenwise", "tokenwise_support",
]
