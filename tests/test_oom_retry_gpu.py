"""Out-of-memory retry loops on the GPU, and a reload that a failed backward never reads.

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
from typing import Any, Callable

import pytest
import torch
from torch import nn

import offload
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
                except torch.cuda.OutOfMemoryError:
                    failed = True  # checked below, once the traceback (and its frames) are gone
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


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backward failed")


class _FailsInBackward(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Boom.apply(self.layer(x))


def test_a_prefetch_that_dies_unread_does_not_write_into_reused_memory() -> None:
    # Backward reaches the last layer, prefetches the two below it, then raises before reading
    # them. Their reload buffers go back to the allocator with the H2D copies still queued
    # behind a delay on the reload stream; memory allocated next on the compute stream gets
    # those blocks. The copies must not land in it.
    layers = _layers()
    layers[3] = _FailsInBackward(layers[3])
    oa = offload.OffloadActivations(layers, num_offload_layers=3)
    x = _input(SMALL_BATCH).requires_grad_(True)
    with oa:
        out = run_layers(layers, x)
    sizes = [g.nbytes for g in oa.engine.step.groups.values()]
    assert len(sizes) == 3
    transport = oa.engine.transport
    reload = transport.reload

    def delayed_reload(*args: Any, **kwargs: Any) -> Any:
        with torch.cuda.stream(transport.h2d_stream):
            torch.cuda._sleep(200_000_000)  # about 0.1 s at the H100's clock
        return reload(*args, **kwargs)

    transport.reload = delayed_reload
    with pytest.raises(RuntimeError, match="backward failed"):
        out.float().mean().backward()
    assert oa.engine.step.counters.reloads >= 1, "backward prefetched nothing: the test proves nothing"
    del out
    gc.collect()
    fresh = [torch.empty(n, dtype=torch.uint8, device="cuda").fill_(0xAB) for n in sizes for _ in range(2)]
    torch.cuda.synchronize()
    for t in fresh:
        assert bool((t == 0xAB).all()), "a reload copy wrote into memory the allocator had handed out again"
