"""The engine on a CUDA GPU: bitwise gradients, real memory drops, stream races, arena reuse, leaks.

Bitwise comparisons use the efficient/math SDPA backends: on our H100 the FLASH backward is not
repeatable run to run, the others are (each test first checks that the plain run repeats).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Optional

import pytest
import torch

import offload
from offload.models import run_layers

from _util import Delayed, assert_bitwise, make_gpt_layers, sleepy, train_step

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("repeatable_attention")]

HIDDEN, HEADS = 256, 4



def gpt(n: int = 6, hidden: int = HIDDEN, heads: int = HEADS) -> torch.nn.ModuleList:
    return make_gpt_layers(n, hidden, heads, device="cuda", dtype=torch.bfloat16)


def tokens(hidden: int = HIDDEN, seq: int = 512, batch: int = 2, seed: int = 1) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(batch, seq, hidden, device="cuda", dtype=torch.bfloat16, generator=g)


def context(num_layers: int, model_layers: int, **kw):
    return offload.get_cpu_offload_context(True, num_layers=num_layers, model_layers=model_layers, **kw)


def test_plain_run_repeats_itself() -> None:
    layers, x = gpt(), tokens()
    assert_bitwise(train_step(layers, x), train_step(layers, x))


@pytest.mark.parametrize("num_layers", [1, 3, 5])
def test_gpt_bitwise_v2(num_layers: int) -> None:
    layers, x = gpt(), tokens()
    expected = train_step(layers, x)
    ctx, sync = context(num_layers, 6, group_bytes=0)  # a group per layer, counted below
    for step in range(3):
        assert_bitwise(expected, train_step(layers, x, ctx, sync))
    s = ctx.stats
    assert s["groups_offloaded"] == num_layers and s["offloaded_bytes"] > 0
    assert s["d2h_gbps"] and s["h2d_gbps"]


@pytest.mark.parametrize("mode", ["v1", "v2"])
def test_gpt_bitwise_both_modes_auto_selection(mode: str) -> None:
    layers, x = gpt(), tokens()
    expected = train_step(layers, x)
    ctx, sync = context(4, 6, mode=mode, selection="auto")
    for _ in range(2):
        assert_bitwise(expected, train_step(layers, x, ctx, sync))
    assert ctx.stats["mode"] == mode and ctx.stats["offloaded_tensors"] > 0


def test_offload_activations_bitwise() -> None:
    layers, x = gpt(), tokens()
    expected = train_step(layers, x)
    oa = offload.OffloadActivations(layers, num_offload_layers=len(layers) - 1, group_bytes=0)
    for p in layers.parameters():
        p.grad = None
    xin = x.clone().requires_grad_(True)
    with oa:
        out = run_layers(layers, xin)
    (out.float() ** 2).mean().backward()
    assert_bitwise(expected, [p.grad for p in layers.parameters()] + [xin.grad])
    assert oa.stats["groups_offloaded"] == 5


def test_native_and_fallback_agree_on_gpu(monkeypatch) -> None:
    layers, x = gpt(), tokens()
    expected = train_step(layers, x)
    for setting in ("0", "1"):
        monkeypatch.setenv("OFFLOAD_NATIVE", setting)
        offload.host.native.reload_native_setting()
        ctx, sync = context(5, 6)
        assert_bitwise(expected, train_step(layers, x, ctx, sync))
        assert ctx.stats["native"] is (setting == "1" and offload.host.native.native_available())
    monkeypatch.delenv("OFFLOAD_NATIVE")
    offload.host.native.reload_native_setting()


def test_retain_graph_twice() -> None:
    layers, x = gpt(), tokens()
    expected = train_step(layers, x)
    ctx, sync = context(5, 6)
    xin = x.clone().requires_grad_(True)
    out = run_layers(layers, xin, ctx, sync)
    loss = (out.float() ** 2).mean()
    for p in layers.parameters():
        p.grad = None
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in layers.parameters()]
    for p in layers.parameters():
        p.grad = None
    loss.backward()
    assert_bitwise(first, [p.grad for p in layers.parameters()])
    assert_bitwise(expected[:-1], first)


def forward_memory(layers, x, ctx=None, sync=None) -> tuple[int, object]:
    xin = x.clone().requires_grad_(True)
    out = run_layers(layers, xin, ctx, sync)
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(), (out, xin)


def test_memory_drops_by_the_bytes_offloaded() -> None:
    layers, x = gpt(4, 1024, 8), tokens(1024, 1024)
    plain_mem, graph = forward_memory(layers, x)
    del graph
    gc.collect()
    ctx, sync = context(3, 4)
    mem, graph = forward_memory(layers, x, ctx, sync)
    offloaded = ctx.engine.step.counters.offloaded_bytes
    assert offloaded > 100 * 2**20
    drop = plain_mem - mem
    print(f"plain {plain_mem / 2**20:.1f} MiB, offload {mem / 2**20:.1f} MiB, drop {drop / 2**20:.1f} MiB, offloaded {offloaded / 2**20:.1f} MiB")
    assert drop >= 0.95 * offloaded
    out, xin = graph
    (out.float() ** 2).mean().backward()


@pytest.mark.parametrize("mode", ["v1", "v2"])
def test_memory_at_release_points(mode: str) -> None:
    """Each release frees (almost) all of the group's bytes at the point the schedule says."""
    layers, x = gpt(6, 1024, 8), tokens(1024, 1024)
    ctx, sync = context(4, 6, mode=mode, selection="auto")
    engine = ctx.engine
    drops = []
    release = engine.release

    def measured(group):
        before = torch.cuda.memory_allocated()
        release(group)
        drops.append((group.layer, engine.forward.layer, before - torch.cuda.memory_allocated(), group.copy_bytes))

    engine.release = measured
    train_step(layers, x, ctx, sync)
    expected_points = {"v2": [(0, 2), (1, 3), (2, 4), (3, 5)], "v1": [(0, 0), (1, 2), (2, 3), (3, 5)]}[mode]
    assert [(g, at) for g, at, _, _ in drops] == expected_points
    for group, at, freed, nbytes in drops:
        assert freed >= 0.95 * nbytes, (group, at, freed, nbytes)


@pytest.mark.parametrize("mode", ["v1", "v2"])
@pytest.mark.parametrize("delay", ["copies", "compute", "both"])
def test_race_with_delayed_streams(mode: str, delay: str, entry_table: str) -> None:
    # Both entry tables (offload._entries and its Python reference) under the same races.
    layers, x = gpt(), tokens()
    expected = train_step(layers, x)
    cycles = 20_000_000  # ~10 ms at H100 clocks, longer than any copy here
    stack = layers if delay == "copies" else torch.nn.ModuleList(Delayed(m, cycles) for m in layers)
    ctx, sync = context(5, 6, mode=mode, selection="auto")
    if delay != "compute":
        sleepy(ctx, cycles)
    for _ in range(2):
        got = train_step(stack, x, ctx, sync)
        assert_bitwise(expected, got)


def delay_backward_readers(ctx, cycles: int) -> None:
    """After every unpack, sleep on the compute stream: the kernels of the node that asked for the
    tensor are queued behind the sleep, so anything that overwrites the tensor's memory without
    waiting for them lands first."""
    engine = ctx.engine
    unpack = engine.unpack

    def slow_unpack(packed):
        tensor = unpack(packed)
        torch.cuda._sleep(cycles)
        return tensor

    engine._hooks = torch.autograd.graph.saved_tensors_hooks(engine.pack, slow_unpack)


@pytest.mark.parametrize("model_layers, num_layers", [(8, 4), (9, 3)])
@pytest.mark.parametrize("delay", ["compute", "copies", "both"])
def test_v1_double_buffering_race_with_delayed_streams(model_layers: int, num_layers: int, delay: str) -> None:
    """A shared reload buffer is overwritten only after the node that read its group last ran."""
    layers, x = gpt(model_layers), tokens()
    expected = train_step(layers, x, scale_input=True)
    assert_bitwise(expected, train_step(layers, x, scale_input=True))
    cycles = 2_000_000  # ~1 ms per unpack (and per layer forward): longer than one group's H2D
    stack = layers if delay == "copies" else torch.nn.ModuleList(Delayed(m, cycles) for m in layers)
    ctx, sync = context(num_layers, model_layers, mode="v1", selection="auto", double_buffering=True)
    if delay != "copies":
        delay_backward_readers(ctx, cycles)
    if delay != "compute":
        sleepy(ctx, 10 * cycles)
    for _ in range(2):
        assert_bitwise(expected, train_step(stack, x, ctx, sync, scale_input=True))
    assert ctx.stats["reloads"] == num_layers
    assert all(b is not None for b in ctx.engine.schedule._buffers)


@pytest.mark.parametrize("group_bytes", [0, None])
def test_no_pinned_allocation_after_first_step(group_bytes: Optional[int]) -> None:
    # None: the default, where these layers share groups and the forecast counts groups.
    layers, x = gpt(), tokens()
    ctx, sync = context(5, 6, group_bytes=group_bytes)
    arena = ctx.engine.arena
    real_allocate = arena.allocate
    pinned_calls = []

    def counting_allocate(nbytes):
        pinned_calls.append(nbytes)
        return real_allocate(nbytes)

    arena.allocate = counting_allocate
    per_step = []
    for _ in range(5):
        before = len(pinned_calls)
        train_step(layers, x, ctx, sync)
        per_step.append(len(pinned_calls) - before)
        assert ctx.stats["pinned_allocations"] == per_step[-1]
    # Step 1: the first group's block now, the others forecast (with headroom, so the slightly
    # larger groups after the first fit them): all used, none pinned in vain.
    groups = ctx.stats["groups_offloaded"]
    assert groups == 5 if group_bytes == 0 else 1 <= groups < 5
    assert per_step == [groups, 0, 0, 0, 0]
    assert arena.counters.freed_blocks == 0


def test_gpu_memory_returns_to_baseline() -> None:
    layers, x = gpt(), tokens()
    train_step(layers, x)
    gc.collect()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    ctx, sync = context(5, 6)
    seen = []
    for _ in range(5):
        train_step(layers, x, ctx, sync)
        gc.collect()
        torch.cuda.synchronize()
        seen.append(torch.cuda.memory_allocated())
    assert seen == [baseline] * 5, (baseline, seen)


class Boom(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


@pytest.mark.parametrize("fault", ["exception", "no_backward"])
@pytest.mark.parametrize("keep", ["offloaded", "kept_budget", "shared"])
def test_failed_and_abandoned_steps_give_back_gpu_and_host_memory(fault: str, keep: str) -> None:
    """With the cyclic GC off: steps that raised in a layer, or whose backward was skipped, give
    back every GPU byte and host block by the end of the next step. ``shared``: the default
    group_bytes, where layers share groups (the failure falls in the open shared group)."""
    layers, x = gpt(), tokens()
    options = {"offloaded": {"group_bytes": 0}, "kept_budget": {"host_budget_bytes": 0, "group_bytes": 0}, "shared": {}}
    ctx, sync = context(5, 6, **options[keep])
    train_step(layers, x, ctx, sync)
    groups = ctx.stats["groups_offloaded"]
    assert groups == {"offloaded": 5, "kept_budget": 0}[keep] if keep != "shared" else 1 <= groups < 5
    gc.collect()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    held = ctx.engine.arena.counters.bytes_held
    stack = torch.nn.ModuleList([*layers[:4], Boom(), layers[5]]) if fault == "exception" else layers
    gc.disable()
    try:
        for _ in range(3):
            xin = x.clone().requires_grad_(True)
            try:
                loss = (run_layers(stack, xin, ctx, sync).float() ** 2).mean()
                del loss
            except RuntimeError as exc:
                assert "boom" in str(exc)
            del xin
        if fault == "exception":
            assert ctx.engine.arena.counters.bytes_in_use == 0
        train_step(layers, x, ctx, sync)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == baseline, (baseline, torch.cuda.memory_allocated())
        assert ctx.engine.arena.counters.bytes_held == held
        if keep != "kept_budget":
            assert ctx.stats["groups_offloaded"] == groups and ctx.stats["pinned_allocations"] == 0
    finally:
        gc.enable()
