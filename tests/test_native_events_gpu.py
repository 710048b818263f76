"""GPU tests of the extension's pooled events, one-call copy submission and pinned buffers, and of
the engine paths built on them (timing off and on, a fresh context's first step, exact bytes held)."""

from __future__ import annotations

import threading

import pytest
import torch

import offload
from offload.host import native

from _util import assert_bitwise, make_gpt_layers, plain_reference, slow_pinning, train_step

pytestmark = pytest.mark.cuda
EXT = native.extension()
needs_ext = pytest.mark.skipif(EXT is None, reason="offload._C is not built")
SLEEP = 20_000_000  # ~10 ms of torch.cuda._sleep on an H100: longer than any copy here


@needs_ext
def test_event_record_query_synchronize_elapsed() -> None:
    stream = torch.cuda.current_stream().cuda_stream
    start = EXT.record_event(stream, True)
    torch.cuda._sleep(SLEEP)
    end = EXT.record_event(stream, True)
    assert not end.query()  # the sleep is still running
    end.synchronize()
    assert end.query() and start.elapsed_time(end) > 1.0
    plain = EXT.record_event(stream)
    with pytest.raises(ValueError, match="timing"):
        start.elapsed_time(plain)


@needs_ext
def test_pooled_events_are_reused_safely() -> None:
    # A wait issued on an event keeps the state it had: re-recording the pooled event later must
    # not release the waiter early.
    side = torch.cuda.Stream()
    torch.cuda._sleep(SLEEP)
    handles = set()
    for _ in range(50):
        e = EXT.record_event(torch.cuda.current_stream().cuda_stream)
        handles.add(e.handle)
        del e
    assert len(handles) < 50  # given back and handed out again
    x = torch.zeros(1 << 20, device="cuda")
    x.fill_(1.0)  # queued behind the sleep on the compute stream
    EXT.stream_wait_stream(side.cuda_stream, torch.cuda.current_stream().cuda_stream)
    with torch.cuda.stream(side):
        y = x * 2  # must see the fill
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(x, 2.0))


def _locked_on_another_thread(n: int) -> object:
    # register_huge in its two halves: faulted in here, locked on a worker thread (its own context
    # current there), as benchmarks/first_step.py --pin-method staged does.
    buf = EXT.PinnedBuffer(n, "register_huge", lock_now=False)
    assert not buf.locked
    device = torch.cuda.current_device()
    worker = threading.Thread(target=lambda: (torch.cuda.set_device(device), buf.lock_pages()))
    worker.start()
    worker.join()
    assert buf.locked
    return buf


@needs_ext
@pytest.mark.parametrize("method", ["host_alloc", "register", "register_huge", "locked_later"])
def test_pinned_buffer_methods_round_trip_bitwise(method: str) -> None:
    n = (3 << 20) + 12345
    buf = _locked_on_another_thread(n) if method == "locked_later" else EXT.PinnedBuffer(n, method)
    host = torch.frombuffer(buf, dtype=torch.uint8)
    assert host.numel() == n and host.is_pinned() and buf.nbytes == n
    page = (2 << 20) if method in ("register_huge", "locked_later") else 4096
    assert buf.pinned_bytes % page == 0 and n <= buf.pinned_bytes < n + page
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    compute = torch.cuda.current_stream().cuda_stream
    side = torch.cuda.Stream()
    torch.cuda._sleep(SLEEP)
    src.add_(1)  # queued behind the sleep: the copy must wait for it (after_stream)
    _, done = EXT.submit_copies([host.data_ptr()], [src.data_ptr()], [n], side.cuda_stream, compute, None, False)
    done.synchronize()
    torch.cuda.synchronize()
    assert torch.equal(host, src.cpu())
    back = torch.empty_like(src)
    start, done = EXT.submit_copies([back.data_ptr()], [host.data_ptr()], [n], side.cuda_stream, compute, done, True)
    done.synchronize()
    assert torch.equal(back, src) and start.elapsed_time(done) > 0


@needs_ext
def test_pinned_buffer_refused_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="mmap|cuMemHostRegister|cuMemHostAlloc"):
        EXT.PinnedBuffer(1 << 62, "register")
    with pytest.raises(ValueError, match="pin method"):
        EXT.PinnedBuffer(1 << 20, "nope")


@pytest.mark.parametrize("timing", [False, True, None])
def test_timing_option_bitwise_and_reported(timing, repeatable_attention) -> None:
    layers = make_gpt_layers(6, hidden=256, heads=4, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 256, 256, device="cuda", dtype=torch.bfloat16)
    expected = plain_reference(layers, x)
    ctx, sync = offload.get_cpu_offload_context(True, num_layers=5, model_layers=6, timing=timing, min_offload_bytes=0)
    for _ in range(3):
        assert_bitwise(expected, train_step(layers, x, ctx, sync))
    s = ctx.stats
    assert s["offloaded_tensors"] > 0 and s["released_bytes"] > 0
    if timing is False:
        assert s["timed_bytes_d2h"] == 0 and s["d2h_gbps"] is None
    elif timing is True:
        assert s["timed_bytes_d2h"] == s["bytes_d2h"] and s["d2h_gbps"] > 1.0
    else:  # automatic: only copies of 4 MiB and more
        assert s["timed_bytes_d2h"] <= s["bytes_d2h"]


def test_fresh_context_first_step_exact_and_bytes_held_are_real(repeatable_attention) -> None:
    layers = make_gpt_layers(6, hidden=512, heads=8, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8, 512, 512, device="cuda", dtype=torch.bfloat16)
    expected = plain_reference(layers, x)
    ctx, sync = offload.get_cpu_offload_context(True, num_layers=5, model_layers=6)
    assert_bitwise(expected, train_step(layers, x, ctx, sync))  # step 1: pins (forecast ahead)
    arena = ctx.engine.arena
    held = sum(r.pinned_bytes for r in arena._free) + arena.counters.bytes_in_use
    assert arena.counters.bytes_held >= held > 0
    first = arena.counters.pinned_allocations
    for _ in range(2):
        assert_bitwise(expected, train_step(layers, x, ctx, sync))
    assert arena.counters.pinned_allocations == first and ctx.stats["pinned_allocations"] == 0
    assert ctx.stats["pinned_bytes_held"] == arena.counters.bytes_held


def test_reserve_before_the_first_step(repeatable_attention) -> None:
    layers = make_gpt_layers(6, hidden=512, heads=8, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8, 512, 512, device="cuda", dtype=torch.bfloat16)
    expected = plain_reference(layers, x)
    probe, probe_sync = offload.get_cpu_offload_context(True, num_layers=5, model_layers=6)
    train_step(layers, x, probe, probe_sync)
    need = probe.stats["bytes_h2d"]
    ctx, sync = offload.get_cpu_offload_context(True, num_layers=5, model_layers=6)
    ctx.reserve(need)
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    assert ctx.stats["pinned_allocations"] == 0


def test_no_wait_first_step_keeps_groups_while_they_pin_then_offloads_exactly(repeatable_attention) -> None:
    layers = make_gpt_layers(6, hidden=512, heads=8, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8, 512, 512, device="cuda", dtype=torch.bfloat16)
    expected = plain_reference(layers, x)
    waits, waits_sync = offload.get_cpu_offload_context(True, num_layers=5, model_layers=6)
    assert_bitwise(expected, train_step(layers, x, waits, waits_sync))
    assert waits.stats["groups_offloaded"] == 5 and "pinning" not in waits.stats["kept"]
    ctx, sync = offload.get_cpu_offload_context(True, num_layers=5, model_layers=6, wait_for_pinning=False)
    slow_pinning(ctx.engine.arena, 0.2)  # the groups' blocks pin later than the step needs them
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    assert_bitwise(expected, train_step(layers, x, ctx, sync))  # step 1: nothing waits for pinning
    kept_peak = torch.cuda.max_memory_allocated() - base
    first = ctx.stats
    assert first["kept"].get("pinning", 0) > 0 and first["groups_kept"] > 0
    ctx.engine.arena.settle(wait=True)  # the blocks finish pinning in the background
    torch.cuda.reset_peak_memory_stats()
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    offloaded_peak = torch.cuda.max_memory_allocated() - base
    second = ctx.stats
    assert "pinning" not in second["kept"] and second["groups_offloaded"] == 5
    # The kept groups really stayed on the GPU in step 1, and step 2 freed them.
    assert kept_peak >= offloaded_peak + second["released_bytes"] // 2
