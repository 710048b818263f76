"""Small reference models used by the demo, the tests and the benchmarks.

A pre-LN GPT block (LayerNorm, QKV Linear, causal SDPA, projection, LayerNorm, 4h MLP with GELU)
and a plain MLP stack. ``linear`` lets the FP8 Linear stand in for ``nn.Linear``;
:class:`FP8MLPBlock` is the MLP block made of the FP8-saving layers of ``offload.fp8``.
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


class FP8MLPBlock(nn.Module):
    """:class:`MLPBlock` built from the FP8 layers that save FP8 wherever they can:
    ``fp8.LayerNormLinear`` (saves only the LayerNorm input), ``fp8.GELU`` (saves its input in
    FP8) and ``fp8.Linear`` (saves its columnwise FP8 input). Per token it saves ``2h`` bytes
    (bf16 LN input) + ``4h`` (FP8 GELU input) + ``4h`` (FP8 fc2 input), plus LayerNorm's per-row
    mean and rstd, against the bf16 block's ``20h``. ``scaling`` and ``fp8_dtype`` go to both FP8
    GEMM layers."""

    def __init__(
        self, hidden: int, *, scaling: str = "tensorwise", fp8_dtype: torch.dtype = torch.float8_e4m3fn,
        approximate: str = "none", device: Any = None, dtype: Any = None,
    ) -> None:
        # Imported here: offload.fp8 is only needed by FP8 models, and models.py is imported by
        # every test and benchmark.
        from . import fp8  # noqa: PLC0415

        super().__init__()
        kw: dict[str, Any] = {"scaling": scaling, "fp8_dtype": fp8_dtype, "device": device, "dtype": dtype}
        self.ln_fc1 = fp8.LayerNormLinear(hidden, 4 * hidden, **kw)
        self.act = fp8.GELU(approximate=approximate)
        self.fc2 = fp8.Linear(4 * hidden, hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.ln_fc1(x)))


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
