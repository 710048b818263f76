"""torchtune's form and keep_on_gpu on a GPU: exact gradients, real copies, prefetch from markers."""

from __future__ import annotations

import pytest
import torch

import offload
from tests._util import assert_bitwise
from tests.test_tune_cpu import Head, model_reference, model_step

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("keep_head", [False, True])
def test_no_layers_form_on_cuda_is_bitwise(keep_head: bool) -> None:
    torch.manual_seed(0)
    model = Head(n=8, width=1024).cuda()
    x = torch.randn(512, 1024, device="cuda")
    expected = model_reference(model, x)
    ctx = offload.OffloadActivations(group_bytes=4 << 20)
    misses = []
    schedule = ctx.engine.schedule
    original = schedule.on_unpack_miss
    schedule.on_unpack_miss = lambda engine, group: (misses.append(group.layer), original(engine, group))
    for _ in range(3):
        got = model_step(model, x, ctx, keep_head=keep_head)
        torch.cuda.synchronize()
        assert_bitwise(expected, got)
        s = ctx.stats
        assert s["groups_offloaded"] >= 2 and s["released_bytes"] == s["offloaded_bytes"] > 0
        assert s["reloads"] == s["groups_offloaded"]
        assert ("keep_on_gpu" in s["kept"]) == keep_head
    assert misses == [], "reloads should come from the boundary markers, ahead of use"
    assert ctx.engine.arena.counters.pinned_allocations <= s["groups_offloaded"] + 1


def test_no_layers_form_frees_gpu_memory() -> None:
    torch.manual_seed(0)
    model = Head(n=8, width=1024).cuda()
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    torch.cuda.synchronize()

    def held(ctx: object) -> int:
        before = torch.cuda.memory_allocated()
        with ctx:  # type: ignore[attr-defined]
            out = model(x * 1.0)
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated() - before
        out.sum().backward()
        return after

    import contextlib

    plain = held(contextlib.nullcontext())
    ctx = offload.OffloadActivations(group_bytes=8 << 20)
    held(ctx)  # first step allocates the arena
    offloaded = held(ctx)
    assert offloaded < plain / 2, f"activations held after forward: {offloaded} bytes, plain {plain}"
