"""The FP8 MLP block (fp8.LayerNormLinear, fp8.GELU, fp8.Linear) through the offload engine:
gradients bitwise equal with and without offload, and the bytes it offloads against the bf16
block's (target T6: at most 0.55x)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import offload
from offload import fp8
from offload.models import FP8MLPBlock, MLPBlock

from _util import assert_bitwise, plain_reference, sleepy, train_step

CUDA_FP8 = torch.cuda.is_available() and fp8.scaled_mm_supported("cuda")
CUDA_ONLY = [pytest.mark.cuda, pytest.mark.skipif(not CUDA_FP8, reason="needs an FP8 GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_ONLY)]
# Per token, bf16 MLP block: LN input 2h + fc1 input 2h + GELU input 8h + fc2 input 8h = 20h.
# FP8 block: LN input 2h + FP8 GELU input 4h + FP8 fc2 input 4h = 10h (plus tiny scales).
T6_RATIO = 0.55


def context(device: str, num_layers: int, model_layers: int, **kw: Any):
    if device == "cpu":
        kw.setdefault("min_offload_bytes", 0)
    return offload.get_cpu_offload_context(True, num_layers=num_layers, model_layers=model_layers, device=device, **kw)


def stack(kind: str, device: str, n: int = 4, hidden: int = 128, scaling: str = "tensorwise", seed: int = 0) -> torch.nn.ModuleList:
    """``n`` MLP blocks: ``"fp8"`` the FP8-saving block, ``"fp8-linear"`` MLPBlock with
    fp8.Linear, ``"bf16"`` MLPBlock with nn.Linear."""
    torch.manual_seed(seed)
    kw = {"device": device, "dtype": torch.bfloat16}
    if kind == "fp8":
        return torch.nn.ModuleList(FP8MLPBlock(hidden, scaling=scaling, **kw) for _ in range(n))
    linear = (lambda i, o, **k: fp8.Linear(i, o, scaling=scaling, **k)) if kind == "fp8-linear" else torch.nn.Linear
    return torch.nn.ModuleList(MLPBlock(hidden, linear=linear, **kw) for _ in range(n))


@pytest.fixture(autouse=True)
def _skip_rowwise_where_unsupported(request):
    name = request.node.name
    if "rowwise" in name and "cpu" in name and not fp8.rowwise_supported("cpu"):
        pytest.skip(f"rowwise _scaled_mm is not available on CPU in torch {torch.__version__}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("mode", ["v2", "v1"])
def test_fp8_mlp_block_stack_bitwise_with_offload(device: str, scaling: str, mode: str) -> None:
    layers = stack("fp8", device, scaling=scaling)
    x = torch.randn(64, 128, device=device, dtype=torch.bfloat16)
    expected = plain_reference(layers, x, scale_input=True)
    ctx, sync = context(device, 3, 4, mode=mode)  # v1: only opted-in tensors move
    for _ in range(2):  # the second step reuses the arena
        assert_bitwise(expected, train_step(layers, x, ctx, sync, scale_input=True))
    # Per offloaded block: the LN input, the GELU's FP8 data + scale, fc2's FP8 data + scale,
    # all tagged, so v1 moves exactly these (v2 may move LayerNorm's mean/rstd too).
    moved = ctx.stats["offloaded_tensors"]
    assert moved == 3 * 5 if mode == "v1" else moved >= 3 * 5, f"{moved} tensors offloaded"
    assert ctx.stats["released_bytes"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_mlp_block_retain_graph_through_offload(device: str) -> None:
    layers = stack("fp8", device, n=3)
    x = torch.randn(64, 128, device=device, dtype=torch.bfloat16)
    expected = plain_reference(layers, x, scale_input=True)
    ctx, sync = context(device, 2, 3)
    assert_bitwise(expected, train_step(layers, x, ctx, sync, scale_input=True, retain_graph=True))


def offloaded_bytes_per_step(kind: str, device: str) -> int:
    layers = stack(kind, device)
    x = torch.randn(64, 128, device=device, dtype=torch.bfloat16)
    # Every saved tensor counts at this toy size (the GPU default keeps tensors under 64 KiB).
    ctx, sync = context(device, 3, 4, min_offload_bytes=0)
    train_step(layers, x, ctx, sync, scale_input=True)
    return ctx.stats["offloaded_bytes"]


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_mlp_offloads_at_most_055_of_the_bf16_bytes(device: str) -> None:
    bf16 = offloaded_bytes_per_step("bf16", device)
    fp8_block = offloaded_bytes_per_step("fp8", device)
    linear_only = offloaded_bytes_per_step("fp8-linear", device)
    assert fp8_block / bf16 <= T6_RATIO, (
        f"the FP8 MLP block offloads {fp8_block / bf16:.3f}x the bf16 block's bytes ({fp8_block} vs {bf16}); "
        f"target T6 is <= {T6_RATIO}"
    )
    # The measure tells the blocks apart: with only its Linears FP8 the block misses T6 (0.75x).
    assert linear_only / bf16 > 0.7


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA_FP8, reason="needs an FP8 GPU")
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_mlp_block_size_bitwise_and_race(scaling: str) -> None:
    """FP8-MLP size (hidden 4096, 8192 tokens), with every copy stream delayed."""
    layers = stack("fp8", "cuda", n=4, hidden=4096, scaling=scaling)
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    expected = plain_reference(layers, x, scale_input=True)
    ctx, sync = context("cuda", 3, 4)
    sleepy(ctx, 20_000_000)
    for _ in range(2):
        assert_bitwise(expected, train_step(layers, x, ctx, sync, scale_input=True))
    # 3 blocks x (bf16 LN input 64 MiB + FP8 GELU input 128 MiB + FP8 fc2 input 128 MiB).
    assert ctx.stats["offloaded_bytes"] >= 3 * 320 * 2**20
