"""Pinned host memory per process on a GPU (issue 32, defect 13), with and without the extension.

The report: several ``OffloadActivations`` contexts one after another on one model, each closed,
with ``OFFLOAD_NATIVE=0``, and the OOM killer ended the process. Without the extension the arena
pins through torch's caching host allocator, which kept every block the arena freed pinned in
its cache, and nothing added up what the contexts held together. Here, on both transports:

- all contexts of the process together stay within the process budget (the ledger,
  ``offload.host.ledger``; torch's own count of its pinned blocks; the process's RSS);
- ``close()`` (or dropping a context) gives the bytes back, to the ledger and to the OS;
- a context that finds no room keeps its groups on the GPU (``kept["budget"]``);
- gradients are bitwise those of the plain run.
"""

from __future__ import annotations

import gc
import warnings
from typing import Any, Callable, Iterator, Optional

import psutil
import pytest
import torch

import offload
from offload.host import native
from offload.host.ledger import HostLedger, process_ledger
from offload.models import run_layers
from offload.host.pinning import release_cached_pinned
from offload.planner import Action, LayerPlan, plan_for

from _util import assert_bitwise, make_gpt_layers, oa_step, plain_reference

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("repeatable_attention")]

MIB = 1 << 20
LAYERS, HIDDEN, HEADS, BATCH = 6, 512, 8, 2
# Different lengths give groups of different sizes, so torch's cache (which reuses a block only
# for a request of the same power of two) could not have recycled one context's blocks for the
# next: each would have added its own.
SEQS = (2048, 1024, 1536, 768, 2048)
PLAN_SEQ = 1024
# What the process's RSS and shared memory may move by without offload holding anything: far
# below what one leaked context leaves (hundreds of MiB at these sizes).
RSS_SLACK = 192 * MIB
# torch's own small pinned buffers outside offload (seen on the H200: one of 1 byte during a
# step): far below one offload block.
TORCH_PINNED_SLACK = 1 * MIB


@pytest.fixture(params=["0", "1"], ids=["python", "native"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``OFFLOAD_NATIVE`` for the test (the report's ``0``, and the extension), restored after."""
    monkeypatch.setenv("OFFLOAD_NATIVE", request.param)
    live = native.reload_native_setting()
    try:
        if request.param == "1" and not live:
            pytest.skip(f"native extension not live: {native.native_reason()}")
        yield request.param
    finally:
        monkeypatch.undo()
        native.reload_native_setting()


@pytest.fixture
def ledger() -> Iterator[HostLedger]:
    """The process's ledger, its default budget restored after the test."""
    ledger = process_ledger()
    yield ledger
    ledger.set_budget(None)


def gpt() -> torch.nn.ModuleList:
    return make_gpt_layers(LAYERS, HIDDEN, HEADS, device="cuda", dtype=torch.bfloat16)


def tokens(seq: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seq)
    return torch.randn(BATCH, seq, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)


def quiesce() -> None:
    """Collect dead contexts, finish the GPU's work and empty torch's pinned cache: a baseline."""
    gc.collect()
    torch.cuda.synchronize()
    release_cached_pinned()
    torch.cuda.empty_cache()


def torch_pinned_bytes() -> Optional[int]:
    """Bytes of the blocks torch's pinned allocator owns (in use and cached), or None where this
    torch does not report them."""
    stats = torch.cuda.host_memory_stats()
    for key in ("allocated_bytes.current", "allocated_bytes.all.current", "reserved_bytes.current"):
        if key in stats:
            return int(stats[key])
    return None


class HostFigures:
    """The process's host memory against a baseline: the ledger, torch's pinned blocks, RSS."""

    def __init__(self, ledger: HostLedger) -> None:
        quiesce()
        self.ledger = ledger
        self.ledger_base = ledger.held_bytes
        self.torch_base = torch_pinned_bytes()
        self.memory_base = psutil.Process().memory_info()

    def check_within(self, budget: int, what: str) -> None:
        """Nothing above the baseline beyond ``budget`` bytes (the process budget's room)."""
        held = self.ledger.held_bytes - self.ledger_base
        assert held <= budget, f"{what}: offload holds {held} bytes of host memory, over the budget's {budget}"
        torch_now = torch_pinned_bytes()
        if torch_now is not None and self.torch_base is not None:
            extra = torch_now - self.torch_base
            assert extra <= budget + TORCH_PINNED_SLACK, f"{what}: torch's pinned allocator holds {extra} bytes more, over {budget}"
        rss = psutil.Process().memory_info().rss - self.memory_base.rss
        assert rss <= budget + RSS_SLACK, f"{what}: the process's RSS grew by {rss} bytes, over {budget}"

    def check_given_back(self, what: str) -> None:
        """Everything offload held is back: the ledger, torch's cache and the OS."""
        assert self.ledger.held_bytes == self.ledger_base, (
            f"{what}: {self.ledger.held_bytes - self.ledger_base} bytes still charged to the process"
        )
        torch_now = torch_pinned_bytes()
        if torch_now is not None and self.torch_base is not None:
            assert torch_now <= self.torch_base + TORCH_PINNED_SLACK, (
                f"{what}: torch's pinned allocator still holds {torch_now - self.torch_base} bytes "
                "more than before (blocks freed by the arena but kept pinned in its cache)"
            )
        now = psutil.Process().memory_info()
        rss = now.rss - self.memory_base.rss
        assert rss <= RSS_SLACK, f"{what}: the process's RSS is still {rss} bytes above its baseline"
        shared = getattr(now, "shared", 0) - getattr(self.memory_base, "shared", 0)
        assert shared <= RSS_SLACK, f"{what}: the process's shared memory is still {shared} bytes above its baseline"


def _planned(layers: torch.nn.ModuleList, x: torch.Tensor) -> Callable[[], Any]:
    """A plan for the model at ``x``'s shape (offload, recompute, offload, ..., keep), and a
    maker of contexts that follow it (made later: following a plan pins its blocks ahead)."""

    def step() -> None:
        layers.zero_grad(set_to_none=True)
        xin = x.detach().requires_grad_(True)
        (run_layers(layers, xin).float() ** 2).mean().backward()

    profile = offload.planner.profile_step(layers, step, selective=False)
    layers.zero_grad(set_to_none=True)
    actions = [Action.OFFLOAD, Action.RECOMPUTE] + [Action.OFFLOAD] * (LAYERS - 3) + [Action.KEEP]
    made = plan_for(profile, [LayerPlan(a) for a in actions])
    return lambda: offload.OffloadActivations(layers, plan=made)


def test_contexts_in_sequence_stay_within_the_process_budget_and_give_it_back(transport: str, ledger: HostLedger) -> None:
    layers = gpt()
    inputs = {seq: tokens(seq) for seq in set(SEQS) | {PLAN_SEQ}}
    expected = {seq: plain_reference(layers, x) for seq, x in inputs.items()}
    probe = offload.OffloadActivations(layers, num_offload_layers=LAYERS - 1)  # all but the last layer
    oa_step(layers, inputs[max(SEQS)], probe)
    need = probe.engine.arena.counters.bytes_held
    probe.close()
    del probe
    make_planned = _planned(layers, inputs[PLAN_SEQ])
    figures = HostFigures(ledger)
    room = need + need // 4
    ledger.set_budget(figures.ledger_base + room)
    ledger.reset_peak()
    fixed = lambda: offload.OffloadActivations(layers, num_offload_layers=LAYERS - 1)  # noqa: E731
    makers = [(seq, fixed) for seq in SEQS] + [(PLAN_SEQ, make_planned)]
    for i, (seq, make) in enumerate(makers):
        what = f"context {i} (length {seq}, {'planned' if make is make_planned else 'all but the last layer'})"
        oa = make()
        for _ in range(2):
            assert_bitwise(expected[seq], oa_step(layers, inputs[seq], oa))
            figures.check_within(room, what)
        stats = oa.stats
        assert stats["native"] is (transport == "1")
        assert stats["groups_offloaded"] > 0 and "budget" not in stats["kept"], (
            f"{what} was refused host memory after the contexts before it closed: {stats['kept']}"
        )
        oa.close()
        figures.check_given_back(f"{what}, closed")
        del oa
    assert ledger.peak_bytes - figures.ledger_base <= room


def test_a_second_live_context_keeps_on_the_gpu_what_the_process_budget_cannot_hold(transport: str, ledger: HostLedger) -> None:
    layers, x = gpt(), tokens(2048)
    expected = plain_reference(layers, x)
    figures = HostFigures(ledger)
    first = offload.OffloadActivations(layers, num_offload_layers=LAYERS - 1)
    assert_bitwise(expected, oa_step(layers, x, first))
    need = first.engine.arena.counters.bytes_held
    room = need + need // 2  # the first context, and half of the second
    ledger.set_budget(figures.ledger_base + room)
    ledger.reset_peak()
    second = offload.OffloadActivations(layers, num_offload_layers=LAYERS - 1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert_bitwise(expected, oa_step(layers, x, second))
    figures.check_within(room, "two live contexts")
    stats = second.stats
    assert stats["kept"].get("budget", 0) > 0, f"the second context kept nothing for the budget: {stats['kept']}"
    assert stats["groups_offloaded"] > 0, "the part that fits the process budget was not offloaded"
    assert any("shared by every offload context" in str(w.message) for w in seen), "no warning said why"
    first.close()
    assert_bitwise(expected, oa_step(layers, x, second))
    assert second.stats["groups_offloaded"] == LAYERS - 1 and "budget" not in second.stats["kept"]
    figures.check_within(room, "the second context alone")
    second.close()
    figures.check_given_back("both contexts closed")
    assert ledger.peak_bytes - figures.ledger_base <= room


def test_a_context_dropped_without_close_gives_its_pinned_memory_back(transport: str, ledger: HostLedger) -> None:
    layers = gpt()
    big, small = tokens(2048), tokens(768)
    expected = plain_reference(layers, small)
    figures = HostFigures(ledger)
    dropped = offload.OffloadActivations(layers, num_offload_layers=LAYERS - 1)
    oa_step(layers, big, dropped)
    del dropped
    gc.collect()
    torch.cuda.synchronize()  # its last copies done: torch frees only blocks whose events ran
    assert ledger.held_bytes == figures.ledger_base, "a dropped context's bytes are still charged"
    # Its blocks died with it: unmapped (extension), or back in torch's cache (fallback), which
    # the next pin empties first.
    later = offload.OffloadActivations(layers, num_offload_layers=LAYERS - 1)
    assert_bitwise(expected, oa_step(layers, small, later))
    counters = later.engine.arena.counters
    torch_now, held = torch_pinned_bytes(), counters.bytes_held + counters.bytes_pending
    if torch_now is not None and figures.torch_base is not None:
        in_torch = held if transport == "0" else 0
        assert torch_now - figures.torch_base <= in_torch + TORCH_PINNED_SLACK, (
            "torch's pinned cache still holds the dropped context's blocks after a new pin"
        )
    later.close()
    figures.check_given_back("the dropped context and a later one closed")
