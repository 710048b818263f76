"""``group_bytes`` on the GPU: shared groups under delayed streams stay bitwise, and a shared
group's memory leaves the GPU with its one D2H."""

from __future__ import annotations

import pytest
import torch

import offload
from offload.models import run_layers

from _util import Delayed, assert_bitwise, make_gpt_layers, sleepy, train_step

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("repeatable_attention")]


def gpt(n: int = 6) -> torch.nn.ModuleList:
    return make_gpt_layers(n, 256, 4, device="cuda", dtype=torch.bfloat16)


def tokens(seq: int = 256, batch: int = 2) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(1)
    return torch.randn(batch, seq, 256, device="cuda", dtype=torch.bfloat16, generator=g)


def context(num_layers: int, model_layers: int, **kw):
    return offload.get_cpu_offload_context(True, num_layers=num_layers, model_layers=model_layers,
                                          min_offload_bytes=0, **kw)


def one_layer_bytes(layers: torch.nn.ModuleList, x: torch.Tensor) -> int:
    ctx, sync = context(len(layers) - 1, len(layers), group_bytes=0)  # every layer a group
    out = run_layers(layers, x.detach().requires_grad_(True), ctx, sync)
    nbytes = max(g.saved_bytes for g in ctx.engine.step.groups.values())
    del out
    return nbytes


@pytest.mark.parametrize("layers_per_group", [2, 5])
@pytest.mark.parametrize("delay", ["copies", "compute", "both"])
def test_shared_groups_race_with_delayed_streams(layers_per_group: int, delay: str) -> None:
    layers, x = gpt(), tokens()
    expected = train_step(layers, x)
    assert_bitwise(expected, train_step(layers, x))
    group_bytes = int((layers_per_group - 0.5) * one_layer_bytes(layers, x))
    cycles = 20_000_000  # ~10 ms at H100 clocks, longer than any copy here
    stack = layers if delay == "copies" else torch.nn.ModuleList(Delayed(m, cycles) for m in layers)
    ctx, sync = context(5, 6, group_bytes=group_bytes)
    if delay != "compute":
        sleepy(ctx, cycles)
    for _ in range(2):
        assert_bitwise(expected, train_step(stack, x, ctx, sync))
        want = -(-5 // layers_per_group)
        assert ctx.stats["groups_offloaded"] == want == ctx.stats["reloads"]
        assert ctx.stats["reloads_on_demand"] == 0


@pytest.mark.parametrize("delay", ["copies", "compute", "both"])
def test_the_default_shares_small_layers_and_races_with_delayed_streams(delay: str) -> None:
    # No group_bytes given: layers of well under DEFAULT_GROUP_BYTES share one group, whose
    # inner layers carry no backward marker; the reload still comes ahead of use.
    layers, x = gpt(), tokens()
    expected = train_step(layers, x)
    assert_bitwise(expected, train_step(layers, x))
    assert 5 * one_layer_bytes(layers, x) < offload.engine.schedules.DEFAULT_GROUP_BYTES
    cycles = 20_000_000
    stack = layers if delay == "copies" else torch.nn.ModuleList(Delayed(m, cycles) for m in layers)
    ctx, sync = context(5, 6)
    if delay != "compute":
        sleepy(ctx, cycles)
    for _ in range(2):
        assert_bitwise(expected, train_step(stack, x, ctx, sync))
        assert ctx.stats["groups_offloaded"] == 1 == ctx.stats["reloads"]
        assert ctx.stats["reloads_on_demand"] == 0


def test_a_shared_group_frees_its_layers_memory_after_the_forward() -> None:
    layers, x = gpt(8), tokens(512)
    train_step(layers, x)  # warm up kernels and workspaces before measuring

    def forward_residue(ctx, sync) -> int:
        inp = x.detach().requires_grad_(True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = run_layers(layers, inp, ctx, sync)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        (out.float() ** 2).mean().backward()
        del out
        for p in layers.parameters():
            p.grad = None
        return held

    plain = forward_residue(None, None)
    ctx, sync = context(7, 8, group_bytes=1 << 40)  # all seven offloaded layers in one group
    forward_residue(ctx, sync)  # first step: pins the host block
    shared = forward_residue(ctx, sync)
    stats = ctx.stats
    assert stats["groups_offloaded"] == 1 and stats["reloads"] == 1
    assert plain - shared >= 0.95 * stats["released_bytes"] > 0, (plain, shared, stats["released_bytes"])
