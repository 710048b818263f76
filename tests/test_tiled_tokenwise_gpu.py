"""Tiled token-wise MLP on a CUDA GPU at long context: bitwise repeatable, within bf16 rounding of
the untiled MLP, and its peak memory well below the untiled intermediates it avoids."""

from __future__ import annotations

import gc
import pytest
import torch
import transformers
from torch import nn

from offload.tiling.tokenwise import tile_tokenwise

from _util import rel_err

pytestmark = pytest.mark.cuda

# A Llama-1B-like MLP at 32k tokens: one untiled intermediate is TOKENS x INTER bf16 (512 MiB).
TOKENS, HIDDEN, INTER, CHUNK = 32768, 2048, 8192, 4096

# Relative L2 error allowed against the untiled MLP: one bf16 rounding is 2^-8 relative at most;
# the tiled weight gradients are 8 chunk GEMMs each rounded to bf16 before the float32 sum, and a
# GEMM's kernel may differ with its row count, so some elements differ by an ulp or two.
TOLERANCE = 1e-2


def llama_mlp() -> nn.Module:
    config = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, hidden_act="silu")
    torch.manual_seed(0)
    return transformers.models.llama.modeling_llama.LlamaMLP(config).to("cuda", torch.bfloat16)


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(1)
    kw = {"device": "cuda", "dtype": torch.bfloat16, "generator": g}
    return torch.randn(1, TOKENS, HIDDEN, **kw), torch.randn(1, TOKENS, HIDDEN, **kw)


def step(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    """Output, x's gradient, then the parameters' gradients."""
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    y = module(x)
    y.backward(grad)
    return [y.detach(), x.grad] + [p.grad for p in module.parameters()]


def peak_above_start(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> int:
    """Peak bytes allocated during one forward+backward, above what was allocated before it."""
    step(module, x, grad)  # warm-up: cuBLAS workspaces and the allocator's first blocks
    module.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(module, x, grad)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


@pytest.fixture(autouse=True)
def free_memory():
    yield
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def test_long_context_mlp_repeats_bitwise_and_matches_untiled() -> None:
    module, (x, grad) = llama_mlp(), inputs()
    expected = step(module, x, grad)
    with tile_tokenwise(module, CHUNK):
        got = step(module, x, grad)
        assert type(module(x.requires_grad_(True)).grad_fn).__name__ == "_TiledTokenwiseBackward"
        again = step(module, x, grad)
    for i, (a, b) in enumerate(zip(got, again)):
        assert torch.equal(a, b), f"item {i} (shape {tuple(a.shape)}) differs between two tiled runs"
    for i, (a, b) in enumerate(zip(expected, got)):
        err = rel_err(b, a)
        assert err <= TOLERANCE, f"item {i} (shape {tuple(a.shape)}): relative error {err:.3g} against untiled"


def test_peak_memory_stays_below_three_untiled_intermediates() -> None:
    module, (x, grad) = llama_mlp(), inputs()
    untiled = peak_above_start(module, x, grad)
    with tile_tokenwise(module, CHUNK):
        tiled = peak_above_start(module, x, grad)
    one = TOKENS * INTER * 2
    mib = 1 << 20
    assert tiled < 3 * one, (
        f"tiled forward+backward peaked {tiled / mib:.0f} MiB above its start; three untiled "
        f"intermediates ({TOKENS} x {INTER} bf16) are {3 * one / mib:.0f} MiB; untiled peaked {untiled / mib:.0f} MiB"
    )
