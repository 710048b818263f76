"""Small reference models used by the demo, the tests and the benchmarks.

A pre-LN GPT block (LayerNorm, QKV Linear, causal SDPA, projection, LayerNorm, 4h MLP with GELU)
and a plain MLP stack. ``linear`` lets the FP8 Linear stand in for ``nn.Linear``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

LinearFactory = Callable[..., nn.Module]


class GPTBlock(nn.Module):
    """Pre-LN transformer block with causal self-attention and a 4x GELU MLP."""

    def __init__(self, hidden: int, heads: int, *, linear: LinearFactory = nn.Linear, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads})")
        kw = {"device": device, "dtype": dtype}
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden, **kw)
        self.qkv = linear(hidden, 3 * hidden, **kw)
        self.proj = linear(hidden, hidden, **kw)
        self.ln2 = nn.LayerNorm(hidden, **kw)
        self.fc1 = linear(hidden, 4 * hidden, **kw)
        self.fc2 = linear(4 * hidden, hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (z.view(b, t, self.heads, h // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class MLPBlock(nn.Module):
    """The GPT block's MLP half (LayerNorm, 4x GELU MLP, residual)."""

    def __init__(self, hidden: int, *, linear: LinearFactory = nn.Linear, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.ln = nn.LayerNorm(hidden, **kw)
        self.fc1 = linear(hidden, 4 * hidden, **kw)
        self.fc2 = linear(4 * hidden, hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class LinearGELU(nn.Module):
    """Linear followed by GELU: one layer of the SMALL workload."""

    def __init__(self, width: int, *, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x))


class GPT(nn.Module):
    """Token embedding, a stack of blocks, final LayerNorm and LM head."""

    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, max_seq: int, *, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.embed = nn.Embedding(vocab, hidden, **kw)
        self.pos = nn.Embedding(max_seq, hidden, **kw)
        self.layers = nn.ModuleList(GPTBlock(hidden, heads, **kw) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden, **kw)
        self.head = nn.Linear(hidden, vocab, bias=False, **kw)

    def embed_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """Token plus position embeddings: the input of the first block."""
        return self.embed(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final LayerNorm and LM head."""
        return self.head(self.ln_f(x))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        return self.logits(x)


def run_layers(layers: Any, x: torch.Tensor, context: Any = None, sync: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """Run ``layers`` in order in TransformerEngine's call shape (``with context`` + ``sync``)."""
    for layer in layers:
        if context is None:
            x = layer(x)
        else:
            with context:
                x = layer(x)
            if sync is not None:
                x = sync(x)
    return x
