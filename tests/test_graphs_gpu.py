"""CUDA graphs with offloading, on a GPU: whole-step capture and graphed layers, bitwise to eager.

Every comparison is with the eager run without offloading, bit for bit, for several inputs; the
first test checks that a captured step without offloading already replays to the eager result
(so a difference elsewhere is offloading's). Attention uses the efficient/math SDPA backends (the
FLASH backward is not repeatable on our H100).
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import offload
from offload.engine import transport as transport_module
from offload.graphs import StepGraph, make_graphed_callables
from offload.models import run_layers

from _util import Delayed, assert_bitwise, make_gpt_layers, train_step

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("repeatable_attention")]

HIDDEN, HEADS, SEQ, BATCH = 256, 4, 512, 2
CYCLES = 20_000_000  # ~10 ms of torch.cuda._sleep on an H100: longer than any copy here



def gpt(n: int = 6) -> torch.nn.ModuleList:
    return make_gpt_layers(n, HIDDEN, HEADS, device="cuda", dtype=torch.bfloat16)


def tokens(seed: int, seq: int = SEQ) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(BATCH, seq, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)


def context(num_layers: int, model_layers: int, **kw):
    kw.setdefault("retain_pinned_cpu_buffers", True)
    return offload.get_cpu_offload_context(True, num_layers=num_layers, model_layers=model_layers, **kw)


def eager_side_stream(fn, *args):
    """Run ``fn`` on a side stream (warm-up before a capture, as torch recommends)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    return out


def capture_train_step(layers, x_static, ctx=None, sync=None):
    """One eager step (warms the arena), then the same step captured; returns (graph, grads)."""
    eager_side_stream(train_step, layers, x_static, ctx, sync)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = train_step(layers, x_static, ctx, sync)
    return graph, grads


def delay_copies(monkeypatch, cycles: int = CYCLES) -> None:
    """Sleep on the copy stream right before every D2H and H2D (inside the capture, after the
    copy stream has joined it, so that replays are delayed too)."""
    real_submit = transport_module.CudaTransport._submit

    def slow_submit(self, copy_stream, *args, **kwargs):
        side = self.d2h_stream if copy_stream is self._d2h or copy_stream == self._d2h else self.h2d_stream
        side.wait_stream(torch.cuda.current_stream())  # joins the capture, as the copy will
        with torch.cuda.stream(side):
            torch.cuda._sleep(cycles)
        return real_submit(self, copy_stream, *args, **kwargs)

    monkeypatch.setattr(transport_module.CudaTransport, "_submit", slow_submit)


# -- whole-step capture ------------------------------------------------------------------------------
def test_plain_capture_replays_to_eager() -> None:
    layers = gpt()
    inputs = [tokens(10 + i) for i in range(3)]
    expected = [train_step(layers, x) for x in inputs]
    assert_bitwise(expected[0], train_step(layers, inputs[0]))  # eager repeats itself
    x_static = inputs[0].clone()
    graph, grads = capture_train_step(layers, x_static)
    for x, want in zip(inputs, expected):
        x_static.copy_(x)
        graph.replay()
        assert_bitwise(want, grads)


@pytest.mark.parametrize("mode", ["v1", "v2"])
def test_whole_step_capture_bitwise_for_5_steps(mode: str) -> None:
    layers = gpt()
    inputs = [tokens(20 + i) for i in range(5)]
    expected = [train_step(layers, x) for x in inputs]
    ctx, sync = context(4, 6, mode=mode, selection="auto")
    x_static = inputs[0].clone()
    graph, grads = capture_train_step(layers, x_static, ctx, sync)
    stats = ctx.stats
    assert stats["captured"] and stats["finished"]
    assert stats["offloaded_bytes"] > 0 and stats["released_bytes"] == stats["offloaded_bytes"]
    arena = ctx.engine.arena
    assert arena.counters.graph_owned_blocks == stats["groups_offloaded"] > 0
    pinned_before = arena.counters.pinned_allocations
    torch.cuda.synchronize()
    allocated_before = torch.cuda.memory_allocated()
    for x, want in zip(inputs, expected):
        x_static.copy_(x)
        graph.replay()
        assert_bitwise(want, grads)
    torch.cuda.synchronize()
    # Replays allocate nothing: not on the GPU (reload buffers live in the graph's pool), not pinned.
    assert torch.cuda.memory_allocated() == allocated_before
    assert arena.counters.pinned_allocations == pinned_before


def test_capture_makes_no_pinned_allocation_and_no_host_sync(monkeypatch) -> None:
    layers, x = gpt(), tokens(3)
    ctx, sync = context(4, 6)
    eager_side_stream(train_step, layers, x, ctx, sync)
    calls: list[str] = []

    def counting(name, real):
        def wrapper(*args, **kwargs):
            if torch.cuda.is_current_stream_capturing():
                calls.append(name)
            return real(*args, **kwargs)
        return wrapper

    real_empty = torch.empty

    def counting_empty(*args, **kwargs):
        if kwargs.get("pin_memory"):
            calls.append("pinned torch.empty")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", counting_empty)
    monkeypatch.setattr(torch.cuda, "synchronize", counting("torch.cuda.synchronize", torch.cuda.synchronize))
    monkeypatch.setattr(torch.cuda.Event, "synchronize", counting("Event.synchronize", torch.cuda.Event.synchronize))
    monkeypatch.setattr(torch.cuda.Event, "query", counting("Event.query", torch.cuda.Event.query))
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", counting("Stream.synchronize", torch.cuda.Stream.synchronize))
    pinned_before = ctx.engine.arena.counters.pinned_allocations
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        train_step(layers, x, ctx, sync)
    assert calls == []
    assert ctx.engine.arena.counters.pinned_allocations == pinned_before
    graph.replay()
    torch.cuda.synchronize()


def test_captured_forward_memory_drops_by_the_bytes_released() -> None:
    layers, x = gpt(), tokens(4)

    def forward_then_backward(ctx, sync, seen):
        x_in = x.detach().requires_grad_(True)
        out = run_layers(layers, x_in, ctx, sync)
        seen.append(torch.cuda.memory_allocated())  # read inside the capture: the pool's use
        (out.float() ** 2).mean().backward()
        for p in layers.parameters():
            p.grad = None

    def captured_forward_memory(ctx=None, sync=None) -> int:
        seen: list[int] = []
        eager_side_stream(forward_then_backward, ctx, sync, [])
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward_then_backward(ctx, sync, seen)
        del graph
        return seen[0] - base

    plain = captured_forward_memory()
    ctx, sync = context(4, 6)
    with_offload = captured_forward_memory(ctx, sync)
    released = ctx.stats["released_bytes"]
    assert released > 0
    assert plain - with_offload >= 0.95 * released, (plain, with_offload, released)


def test_capture_with_a_cold_arena_is_refused_clearly() -> None:
    layers, x = gpt(), tokens(5)
    ctx, sync = offload.get_cpu_offload_context(True, num_layers=4, model_layers=6)  # no eager step first
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(Exception) as info:
        with torch.cuda.graph(graph):
            train_step(layers, x, ctx, sync)
    chain, err = [], info.value
    while err is not None:
        chain.append(err)
        err = err.__cause__ or err.__context__
    ours = [e for e in chain if isinstance(e, offload.CaptureError)]
    assert ours, chain
    assert "retain_pinned_cpu_buffers=True" in str(ours[0]) and "eager step" in str(ours[0])
    del graph
    torch.cuda.synchronize()
    # Nothing is left broken: the same context then runs eagerly, bitwise.
    assert_bitwise(train_step(layers, x), train_step(layers, x, ctx, sync))


def test_forward_captured_without_its_backward_is_refused_clearly() -> None:
    layers, x = gpt(), tokens(6)
    ctx, sync = context(4, 6)
    eager_side_stream(train_step, layers, x, ctx, sync)
    x_in = x.detach().requires_grad_(True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_layers(layers, x_in, ctx, sync)
    with pytest.raises(RuntimeError, match="captured together"):
        (out.float() ** 2).mean().backward()
    del graph, out
    torch.cuda.synchronize()


@pytest.mark.parametrize("delay", ["copies", "compute", "both"])
def test_race_with_delayed_streams_under_replay(monkeypatch, delay: str) -> None:
    layers = gpt()
    inputs = [tokens(30 + i) for i in range(2)]
    expected = [train_step(layers, x) for x in inputs]
    stack = layers if delay == "copies" else torch.nn.ModuleList(Delayed(m, CYCLES) for m in layers)
    if delay != "compute":
        delay_copies(monkeypatch)
    ctx, sync = context(5, 6)
    x_static = inputs[0].clone()
    graph, grads = capture_train_step(stack, x_static, ctx, sync)
    for x, want in zip(inputs, expected):
        x_static.copy_(x)
        graph.replay()
        assert_bitwise(want, grads)


def test_step_graph_replays_bitwise_and_refuses_other_shapes() -> None:
    layers = gpt()
    inputs = [tokens(40 + i) for i in range(3)]
    expected = [train_step(layers, x) for x in inputs]
    ctx, sync = context(3, 6)
    step = StepGraph(lambda x: train_step(layers, x, ctx, sync), [inputs[0]])
    for x, want in zip(inputs, expected):
        assert_bitwise(want, step(x))
    with pytest.raises(ValueError, match=r"captured with shape \[2, 512, 256\].*got shape \[2, 256, 256\]"):
        step(tokens(1, seq=256))
    with pytest.raises(ValueError, match="float32"):
        step(inputs[0].float())
    assert_bitwise(expected[0], step(inputs[0]))  # still fine after the refusals


# -- graphed layers ----------------------------------------------------------------------------------
def sample_for(n: int) -> tuple[tuple[torch.Tensor, ...], ...]:
    return tuple((tokens(99).requires_grad_(True),) for _ in range(n))


def graphed_step(stack, x, how: str):
    """Forward through ``stack`` (graphed and eager layers), backward; grads as in train_step."""
    for p in stack.parameters():
        p.grad = None
    x = x.detach().requires_grad_(True)
    stream = torch.cuda.Stream() if how != "current" else None
    out = x
    for i, layer in enumerate(stack):
        if isinstance(layer, offload.graphs.GraphedLayer):
            kwargs = {}
            if how == "stream":
                kwargs = {"cuda_graph_stream": stream}
            elif how == "stream+event":
                kwargs = {"cuda_graph_stream": stream, "cuda_graph_event": layer.compute_done_event}
            elif how == "alternate" and i % 2 == 0:
                kwargs = {"cuda_graph_stream": stream, "cuda_graph_event": layer.compute_done_event}
            out = layer(out, **kwargs)
        else:
            out = layer(out)
    (out.float() ** 2).mean().backward()
    return [p.grad.clone() for p in stack.parameters()] + [x.grad.clone()]


@pytest.mark.parametrize("how", ["current", "stream", "stream+event"])
def test_graphed_layers_with_offload_bitwise(how: str) -> None:
    layers = gpt(4)
    inputs = [tokens(50 + i) for i in range(3)]
    expected = [train_step(layers, x) for x in inputs]
    ctx, _ = context(3, 4)
    graphed = make_graphed_callables(tuple(layers), sample_for(4), offload=ctx)
    stack = torch.nn.ModuleList(graphed)
    for x, want in zip(inputs, expected):
        assert_bitwise(want, graphed_step(stack, x, how))
    for layer in graphed:
        s = layer.stats()
        assert s["captured"] and s["offloaded_bytes"] > 0 and s["released_bytes"] == s["offloaded_bytes"]
    assert ctx.engine.arena.counters.graph_owned_blocks == 4


def graph_pool_peaks(table: str) -> dict[str, object]:
    """Peak GPU bytes of graphing 4 layers, plain and with 3 offloaded, and each layer's released
    bytes, measured warm (the first graphing of a process also allocates cuBLAS's workspace)."""
    if table == "python":
        from offload.engine import group
        from offload.engine.entry_table import EntryTable

        group.new_entry_table = EntryTable

    def peak_of_graphing(offload_ctx) -> tuple[int, list[int]]:
        layers = gpt(4)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        graphed = make_graphed_callables(tuple(layers), sample_for(4), offload=offload_ctx)
        peak = torch.cuda.max_memory_allocated() - base
        released = [g.stats()["released_bytes"] for g in graphed]
        del graphed
        return peak, released

    peak_of_graphing(None)
    plain, _ = peak_of_graphing(None)
    with_offload, released = peak_of_graphing(context(3, 4)[0])
    return {"plain": plain, "with_offload": with_offload, "released": released}


def test_graphed_layers_offload_shrinks_the_graph_pool(entry_table: str) -> None:
    # In a fresh process: the allocator's state after the tests before moved these peaks by
    # megabytes in the full suite.
    code = (
        "import json, sys; sys.path.insert(0, 'tests'); import test_graphs_gpu as t; "
        f"print(json.dumps(t.graph_pool_peaks({entry_table!r})))"
    )
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    peaks = json.loads(done.stdout.strip().splitlines()[-1])
    plain, with_offload, released = peaks["plain"], peaks["with_offload"], peaks["released"]
    # Each offloaded layer releases its saved tensors at the end of its forward graph. The pool's
    # peak falls in the backward captures (reload buffers and gradients), where about 1.4 layers'
    # bytes are saved on our H100 (11.1 MB, 7.9 MB a layer); one layer's is the floor.
    assert min(released) > 0
    assert plain - with_offload >= max(released), peaks


def test_mixed_graphed_and_eager_layers_with_offload_across_them() -> None:
    layers = gpt(6)
    inputs = [tokens(60 + i) for i in range(3)]
    expected = [train_step(layers, x) for x in inputs]
    ctx, sync = context(4, 6, group_bytes=0)  # layers 0 and 2 in groups of their own, counted below
    g1, g3 = make_graphed_callables((layers[1], layers[3]), sample_for(2), offload=ctx)
    stack = torch.nn.ModuleList([layers[0], g1, layers[2], g3, layers[4], layers[5]])
    for x, want in zip(inputs, expected):
        assert_bitwise(want, train_step(stack, x, ctx, sync))  # TE call shape: layers 0, 2 eager-offloaded
        s = ctx.stats
        assert s["groups_offloaded"] == 2 and s["offloaded_bytes"] > 0
        assert_bitwise(want, graphed_step(stack, x, "stream+event"))
    oa = offload.OffloadActivations(stack, num_offload_layers=4, retain_pinned_cpu_buffers=True, group_bytes=0)
    for x, want in zip(inputs, expected):
        for p in stack.parameters():
            p.grad = None
        x_in = x.detach().requires_grad_(True)
        with oa:
            out = run_layers(stack, x_in)
        (out.float() ** 2).mean().backward()
        assert_bitwise(want, [p.grad for p in stack.parameters()] + [x_in.grad])
        assert oa.stats["groups_offloaded"] == 2


@pytest.mark.parametrize("how", ["stream+event", "alternate"])
def test_graphed_race_with_delayed_streams(monkeypatch, how: str) -> None:
    layers = gpt(4)
    inputs = [tokens(70 + i) for i in range(2)]
    expected = [train_step(layers, x) for x in inputs]
    delay_copies(monkeypatch)
    ctx, _ = context(3, 4)
    delayed = tuple(Delayed(m, CYCLES // 4) for m in layers)
    graphed = make_graphed_callables(delayed, sample_for(4), num_warmup_iters=1, offload=ctx)
    stack = torch.nn.ModuleList(graphed)
    for x, want in zip(inputs, expected):
        assert_bitwise(want, graphed_step(stack, x, how))


def test_graphed_layer_refuses_event_without_stream_and_other_shapes() -> None:
    layers = gpt(2)
    ctx, _ = context(1, 2)
    g0, g1 = make_graphed_callables(tuple(layers), sample_for(2), num_warmup_iters=1, offload=ctx)
    x = tokens(80).requires_grad_(True)
    with pytest.raises(ValueError, match="cuda_graph_event was given without cuda_graph_stream"):
        g0(x, cuda_graph_event=g0.compute_done_event)
    with pytest.raises(ValueError, match=r"captured with shape \[2, 512, 256\]"):
        g0(tokens(80, seq=128).requires_grad_(True))
    with pytest.raises(ValueError, match="requires_grad=True"):
        g0(tokens(80))
    expected = train_step(layers, x)
    assert_bitwise(expected, graphed_step(torch.nn.ModuleList([g0, g1]), x, "stream+event"))


def test_graphed_layers_without_warm_up_are_refused_clearly() -> None:
    layers = gpt(2)
    ctx, _ = offload.get_cpu_offload_context(True, num_layers=1, model_layers=2)
    with pytest.raises(Exception) as info:
        make_graphed_callables(tuple(layers), sample_for(2), num_warmup_iters=0, offload=ctx)
    chain, err = [], info.value
    while err is not None:
        chain.append(err)
        err = err.__cause__ or err.__context__
    assert any(isinstance(e, offload.CaptureError) and "graphed layer 0" in str(e) for e in chain), chain
    torch.cuda.synchronize()


def test_graphed_layer_in_the_other_training_mode_runs_eagerly() -> None:
    layers = gpt(2)
    ctx, _ = context(1, 2)
    g0, _ = make_graphed_callables(tuple(layers), sample_for(2), num_warmup_iters=1, offload=ctx)
    g0.eval()  # captured in training mode: eval calls run the layer eagerly, any shape
    x = tokens(81, seq=128)
    with torch.no_grad():
        assert torch.equal(g0(x), layers[0](x))


def test_warmup_hooks_run_once_around_all_warmup_iterations() -> None:
    events: list[str] = []

    class Recording(torch.nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            if not torch.cuda.is_current_stream_capturing():
                events.append("forward")
            return self.layer(x)

    layers = gpt(3)
    ctx, _ = context(2, 3)
    make_graphed_callables(
        tuple(Recording(m) for m in layers), sample_for(3), num_warmup_iters=2, offload=ctx,
        pre_warmup_hook=lambda: events.append("pre"), post_warmup_hook=lambda: events.append("post"),
    )
    assert events == ["pre"] + ["forward"] * 6 + ["post"]
