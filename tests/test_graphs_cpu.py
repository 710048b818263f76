"""CUDA-graph support without a GPU: argument checks, the arena's capture rules, and the engine's
capture logic driven through the host transport with capture simulated (``transport.capturing``).
"""

from __future__ import annotations

import pytest
import torch

import offload
from offload.host.arena import CaptureError, HostArena
from offload.graphs import GraphedLayer, InputSignature, StepGraph, make_graphed_callables

from _util import assert_bitwise, cpu_context, make_mlp_layers, train_step

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where CUDA is absent")


def layers_and_samples(n: int = 2):
    layers = make_mlp_layers(n, 16)
    return layers, tuple((torch.randn(4, 16, requires_grad=True),) for _ in range(n))


# -- make_graphed_callables / StepGraph argument checks ----------------------------------------------
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"pre_warmup_hook": 3}, TypeError, "pre_warmup_hook must be callable"),
        ({"post_warmup_hook": "x"}, TypeError, "post_warmup_hook must be callable"),
        ({"num_warmup_iters": -1}, ValueError, "num_warmup_iters must be an integer >= 0"),
        ({"offload": object()}, TypeError, "offload= must be the context"),
    ],
)
def test_make_graphed_callables_rejects_bad_options(kwargs, error, match) -> None:
    layers, samples = layers_and_samples()
    with pytest.raises(error, match=match):
        make_graphed_callables(tuple(layers), samples, **kwargs)


def test_make_graphed_callables_rejects_a_cpu_offload_context() -> None:
    layers, samples = layers_and_samples()
    ctx, _ = cpu_context(1, 2)
    with pytest.raises(ValueError, match="device='cpu'"):
        make_graphed_callables(tuple(layers), samples, offload=ctx)


def test_make_graphed_callables_rejects_mismatched_samples() -> None:
    layers, samples = layers_and_samples(2)
    with pytest.raises(ValueError, match="2 callables but 1 sets of sample_args"):
        make_graphed_callables(tuple(layers), samples[:1])
    with pytest.raises(TypeError, match=r"sample_args\[0\]\[0\] is a int"):
        make_graphed_callables(tuple(layers), ((3,), samples[1]))
    with pytest.raises(TypeError, match="sample_args must be a tuple"):
        make_graphed_callables(layers[0], samples[0][0])
    with pytest.raises(TypeError, match="callable 1 is a int"):
        make_graphed_callables((layers[0], 5), samples)
    with pytest.raises(ValueError, match="at least one callable"):
        make_graphed_callables((), ())


def test_make_graphed_callables_rejects_modules_with_hooks() -> None:
    layers, samples = layers_and_samples()
    layers[1].register_forward_pre_hook(lambda m, a: None)
    with pytest.raises(ValueError, match="module 1 has hooks registered"):
        make_graphed_callables(tuple(layers), samples)


@needs_no_cuda
def test_graphs_need_cuda() -> None:
    layers, samples = layers_and_samples()
    with pytest.raises(RuntimeError, match="needs CUDA"):
        make_graphed_callables(tuple(layers), samples)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        StepGraph(lambda x: x, [torch.zeros(2)])


def test_step_graph_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match="step_fn must be callable"):
        StepGraph(3, [torch.zeros(2)])
    with pytest.raises(TypeError, match="sample_args must be tensors"):
        StepGraph(lambda x: x, [3])
    with pytest.raises(ValueError, match="warmup_steps must be an integer >= 1"):
        StepGraph(lambda x: x, [torch.zeros(2)], warmup_steps=0)


def test_graphed_layer_call_checks() -> None:
    layer = GraphedLayer(make_mlp_layers(1, 16)[0], 0, None)
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="cuda_graph_event was given without cuda_graph_stream"):
        layer(x, cuda_graph_event=object())
    with pytest.raises(TypeError, match="cuda_graph_stream must be a torch.cuda.Stream"):
        layer(x, cuda_graph_stream="side")
    # Not captured yet: it runs the layer eagerly, unchanged.
    assert torch.equal(layer(x), layer.module(x))


def test_input_signature_refuses_every_difference() -> None:
    sig = InputSignature([torch.zeros(2, 3, requires_grad=True), torch.zeros(4, dtype=torch.int64)])
    ok = [torch.ones(2, 3, requires_grad=True), torch.ones(4, dtype=torch.int64)]
    sig.check(ok, "layer")
    bad = {
        "3 tensor inputs|2 tensor inputs": None,
        r"shape \[2, 3\].*got shape \[3, 3\]": [torch.ones(3, 3, requires_grad=True), ok[1]],
        "torch.int64.*got shape \\[4\\], torch.int32": [ok[0], torch.ones(4, dtype=torch.int32)],
        "requires_grad=True.*requires_grad=False": [torch.ones(2, 3), ok[1]],
        "must be a tensor": [ok[0], 4],
    }
    for match, args in bad.items():
        with pytest.raises(ValueError, match=match):
            sig.check(ok + ok[:1] if args is None else args, "layer")


# -- the arena under capture -------------------------------------------------------------------------
def test_arena_capture_takes_only_idle_blocks_and_keeps_them_for_the_graph() -> None:
    arena = HostArena(pinned=False, budget_bytes=1 << 30, retain=False)
    with pytest.raises(CaptureError, match="retain_pinned_cpu_buffers=True"):
        arena.acquire(1000, 1, captured=True)
    eager = arena.acquire(1000, 1)
    arena.release(eager, None)
    held = arena.counters.bytes_held
    # Any idle block that fits will do under capture, even one far larger than asked for.
    big = arena.acquire(100_000, 1)
    arena.release(big, None)
    captured = arena.acquire(10, 2, captured=True)
    assert captured.graph_owned and captured.block.numel() == 64 * 1024
    arena.release(captured, None)
    assert arena.counters.graph_owned_blocks == 1
    again = arena.acquire(10, 3)  # the graph's block is never lent again: the big one is, or a new one
    assert again is not captured
    arena.end_step(3)
    assert arena.counters.bytes_held >= held  # graph-owned blocks are not trimmed either


# -- the engine under (simulated) capture ------------------------------------------------------------
def simulate_capture(ctx, monkeypatch, capturing: list[bool]) -> list[tuple[bool, bool]]:
    """Make the host transport report ``capturing[0]`` and record its joins."""
    transport = ctx.engine.transport
    joins: list[tuple[bool, bool]] = []
    monkeypatch.setattr(transport, "capturing", lambda: capturing[0])
    monkeypatch.setattr(transport, "join", lambda *, d2h, h2d: joins.append((d2h, h2d)))
    return joins


def warm_simulated(monkeypatch):
    """A 4-layer model and a host context (3 offloaded, buffers retained) after one eager step,
    with capture simulated; ``capturing[0]`` switches it."""
    layers, x = make_mlp_layers(4, 32), torch.randn(8, 32)
    ctx, sync = cpu_context(3, 4, retain_pinned_cpu_buffers=True)
    capturing = [False]
    simulate_capture(ctx, monkeypatch, capturing)
    train_step(layers, x, ctx, sync)
    return layers, x, ctx, sync, capturing


def test_captured_step_needs_a_warm_arena(monkeypatch) -> None:
    layers, x = make_mlp_layers(4, 32), torch.randn(8, 32)
    ctx, sync = cpu_context(3, 4)
    simulate_capture(ctx, monkeypatch, [True])
    with pytest.raises(CaptureError, match="no pinned host buffers are ready.*retain_pinned_cpu_buffers=True"):
        train_step(layers, x, ctx, sync)


def test_captured_step_runs_the_schedule_joins_and_keeps_its_regions(monkeypatch) -> None:
    layers, x = make_mlp_layers(4, 32), torch.randn(8, 32)
    expected = train_step(layers, x)
    ctx, sync = cpu_context(3, 4, retain_pinned_cpu_buffers=True)
    capturing = [False]
    joins = simulate_capture(ctx, monkeypatch, capturing)
    assert_bitwise(expected, train_step(layers, x, ctx, sync))  # eager: warms the arena
    allocations = ctx.engine.arena.counters.pinned_allocations
    capturing[0] = True
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    s = ctx.stats
    assert s["captured"] and s["finished"] and s["groups_offloaded"] == 3
    assert joins == [(True, True)]  # once, at the end of the captured step, both streams
    assert ctx.engine.arena.counters.pinned_allocations == allocations  # nothing allocated
    assert ctx.engine.arena.counters.graph_owned_blocks == 3
    assert "captured in a CUDA graph" in ctx.report()
    capturing[0] = False
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    # The graph keeps its regions, so the next eager step needs blocks of its own.
    assert ctx.engine.arena.counters.pinned_allocations == allocations + 3
    assert not ctx.stats["captured"]


def test_step_half_captured_is_refused(monkeypatch) -> None:
    layers, x, ctx, sync, capturing = warm_simulated(monkeypatch)

    class FlipsCapture(torch.nn.Module):
        def forward(self, t):
            capturing[0] = True
            return t * 1.0

    stack = torch.nn.ModuleList([layers[0], FlipsCapture(), layers[2], layers[3]])
    with pytest.raises(CaptureError, match="same CUDA-graph capture"):
        train_step(stack, x, ctx, sync)


def test_forward_captured_backward_eager_is_refused(monkeypatch) -> None:
    from offload.models import run_layers

    layers, x, ctx, sync, capturing = warm_simulated(monkeypatch)
    capturing[0] = True
    out = run_layers(layers, x.requires_grad_(True), ctx, sync)
    capturing[0] = False
    with pytest.raises(CaptureError, match="captured together"):
        out.sum().backward()


def test_graphed_layer_offloads_its_own_group_eagerly_bitwise() -> None:
    """The local group path (offload, release at the layer's end, reload on first use), eagerly."""
    layers, x = make_mlp_layers(3, 32), torch.randn(8, 32)
    expected = train_step(layers, x)
    ctx, _ = cpu_context(1, 2)
    stack = torch.nn.ModuleList(GraphedLayer(m, i, ctx.engine) for i, m in enumerate(layers))
    for _ in range(2):
        assert_bitwise(expected, train_step(stack, x))
        for layer in stack:
            s = layer.stats()
            assert s["offloaded_tensors"] > 0 and s["released_bytes"] == s["offloaded_bytes"]
    arena = ctx.engine.arena.counters
    assert arena.bytes_in_use == 0 and arena.graph_owned_blocks == 0


def test_graphs_module_is_exported() -> None:
    assert offload.graphs.make_graphed_callables is make_graphed_callables
    assert offload.CaptureError is CaptureError
