"""Out-of-memory retry loops on the GPU, and a reload whose graph dies before it is read.

A batch-size finder runs a step, catches the out-of-memory error and tries again at half the
batch. With offloading on, every failed attempt must give all of its GPU memory back (within
1 MiB of the level before it), and the batch that fits must give the plain run's gradients bit
for bit. The out-of-memory errors here are real: the caching allocator is capped with
``torch.cuda.set_per_process_memory_fraction`` so that the largest batches cannot fit.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
import weakref
from typing import Any, Callable

import pytest
import torch
from torch import nn

import offload
from offload.planner import BudgetError
from offload.planner.make import allocator_settings_setter
from offload.models import GPTBlock, MLPBlock, run_layers

pytestmark = pytest.mark.cuda

MIB = 1 << 20
SMALL_BATCH = 2
HIDDEN = 512


def _layers() -> nn.ModuleList:
    """Four layers of attention then an MLP (``layer[1]``, the part selective recompute wraps)."""
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.Sequential(GPTBlock(HIDDEN, 8, device="cuda"), MLPBlock(HIDDEN, device="cuda")) for _ in range(4)
    )


def _step(layers: nn.ModuleList, x: torch.Tensor, wrapper: Any) -> list[torch.Tensor]:
    layers.zero_grad(set_to_none=True)
    xin = x.detach().requires_grad_(True)
    with wrapper if wrapper is not None else contextlib.nullcontext():
        out = run_layers(layers, xin)
    (out.float() ** 2).mean().backward()
    return [p.grad.clone() for p in layers.parameters()] + [xin.grad.clone()]


def _input(batch: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(batch)
    return torch.randn(batch, 1024, HIDDEN, device="cuda", generator=g)


def _fixed_k(layers: nn.ModuleList) -> Any:
    return offload.OffloadActivations(layers, num_offload_layers=3)


def _planned(layers: nn.ModuleList) -> Any:
    made = offload.plan(layers, lambda: _step(layers, _input(SMALL_BATCH), None), "lowest")
    return offload.OffloadActivations(layers, plan=made)


def _selective(layers: nn.ModuleList) -> Any:
    return offload.OffloadActivations(layers, num_offload_layers=2)


FORMS: dict[str, Callable[[nn.ModuleList], Any]] = {"fixed_k": _fixed_k, "plan": _planned, "selective": _selective}


@pytest.mark.parametrize("form", list(FORMS))
def test_an_out_of_memory_retry_loop_goes_on_and_the_fitting_batch_is_exact(form: str, repeatable_attention: None) -> None:
    layers = _layers()
    regions = offload.selective_recompute([layer[1] for layer in layers]) if form == "selective" else contextlib.nullcontext()
    batches = [SMALL_BATCH * 2**i for i in range(4)]
    with regions, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a plan made for another batch size warns
        expected = {}
        for batch in batches:  # the plain gradients of every batch the loop may settle on
            expected[batch] = _step(layers, _input(batch), None)
            again = _step(layers, _input(batch), None)
            assert all(torch.equal(a, b) for a, b in zip(expected[batch], again)), "plain does not repeat"
        wrapper = FORMS[form](layers)
        x = _input(SMALL_BATCH)
        _step(layers, x, wrapper)  # warm: host blocks pinned, plan in force
        layers.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _step(layers, x, wrapper)
        need = torch.cuda.max_memory_allocated() - base
        layers.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        # Room for the small batch with a third to spare: the 8x and 4x batches cannot fit. (The
        # cap is on reserved memory, which holds the weights already.)
        cap = torch.cuda.memory_reserved() + int(1.3 * need)
        torch.cuda.set_per_process_memory_fraction(cap / total)
        try:
            batch, left = batches[-1], []
            while True:
                layers.zero_grad(set_to_none=True)
                gc.collect()
                before = torch.cuda.memory_allocated()
                failed = False
                try:
                    got = _step(layers, _input(batch), wrapper)
                except (torch.cuda.OutOfMemoryError, BudgetError):
                    # checked below, once the traceback (and its frames) are gone; a plan made
                    # for the small batch refuses a batch no plan fits before its first layer
                    failed = True
                if not failed:
                    break
                layers.zero_grad(set_to_none=True)
                gc.collect()
                torch.cuda.synchronize()
                left.append(torch.cuda.memory_allocated() - before)
                assert batch > SMALL_BATCH, "the small batch ran out of memory: the cap is too tight"
                batch //= 2
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        assert len(left) >= 2, f"expected at least the 8x and 4x batches to run out of memory; {len(left)} did"
        assert all(abs(n) < MIB for n in left), f"{form}: bytes left allocated after each failed step: {left}"
        assert all(torch.equal(a, b) for a, b in zip(expected[batch], got)), f"{form}: the fitting batch's gradients differ"
        if isinstance(wrapper, offload.OffloadActivations):
            wrapper.close()


def test_a_reload_that_dies_unread_does_not_write_into_reused_memory() -> None:
    # A layer is reloaded ahead of a backward that never comes (its graph is dropped: a failed
    # step, a skipped backward). Its reload buffer goes back to the allocator with the H2D still
    # queued behind a delay on the reload stream, and memory allocated next on the compute stream
    # gets that block. The copy must not land in it. The compute stream is a side stream: work on
    # the legacy default stream waits for the other streams by itself, which would hide the race.
    # The default allocator's segments (a "device" plan earlier in this process may have turned
    # expandable segments on, which need not hand the same block back at once).
    allocator_settings_setter()("expandable_segments:False")
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        layers = _layers()
        ctx, sync, controller = offload.get_cpu_offload_context(True, 3, 4, manual_synchronization=True)
        x = _input(SMALL_BATCH).requires_grad_(True)
        out = run_layers(layers, x, ctx, sync)
        controller.start_offload_layer(0)
        controller.release_activation_forward_gpu_memory(0)
        transport = ctx.engine.transport
        with torch.cuda.stream(transport.h2d_stream):
            torch.cuda._sleep(1_500_000_000)  # about a second at the H100's clock
        controller.start_reload_layer(0)
        group = ctx.engine.step.groups.get(0)
        buffer, nbytes = group.gpu.data_ptr(), group.nbytes
        dead = weakref.ref(group)
        del group, out  # no gc.collect(): it can take longer than the delay in a large test process
        assert dead() is None, "the group outlived its graph"
        assert not transport.h2d_stream.query(), "the reload finished already: the test proves nothing"
        fresh = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        assert fresh.data_ptr() == buffer, "the allocator did not hand the reload buffer out again"
        fresh.fill_(0xAB)
        torch.cuda.synchronize()
        assert bool((fresh == 0xAB).all()), "a reload copy wrote into memory the allocator had handed out again"
