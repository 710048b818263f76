"""Host memory is accounted per process, not per context (issue 32, defect 13).

A script ran several ``OffloadActivations`` contexts one after another (each closed) without the
native extension, and the kernel's OOM killer ended it: every context stayed within its own host
budget, but nothing added up what they held together, and torch's pinned allocator (the
fallback) kept every freed block pinned in its cache. These tests hold the process-wide ledger
(``offload.host.ledger``) to its promises on the ``cpu`` transport, which charges the same ledger
as the CUDA one: all contexts together stay within the process budget, ``close()`` (or dropping
a context) gives the bytes back, a context that finds no room keeps its groups where they are
(``kept["budget"]``) with gradients bit for bit, and the arena empties torch's pinned cache once
the blocks it freed are dead. Most run with ``OFFLOAD_NATIVE=0``, the transport of the report.
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
from typing import Iterator

import pytest
import torch

import offload
from offload.host import native
from offload.host.arena import BLOCK_GRANULE, HostArena
from offload.host.ledger import HostLedger, process_ledger
from offload.host.pinning import HUGE_PAGE_MIN_BYTES, expected_held_bytes

from _util import assert_bitwise, make_mlp_layers, oa_step, plain_reference

MIB = 1 << 20


@pytest.fixture
def python_copies(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The pure-Python transport (``OFFLOAD_NATIVE=0``), the extension's setting restored after."""
    monkeypatch.setenv("OFFLOAD_NATIVE", "0")
    native.reload_native_setting()
    yield
    monkeypatch.undo()
    native.reload_native_setting()


@pytest.fixture
def ledger() -> Iterator[HostLedger]:
    """The process's ledger, with the arenas of earlier tests collected; its default budget is
    restored after the test (tests fix it with ``set_budget``)."""
    gc.collect()
    ledger = process_ledger()
    yield ledger
    ledger.set_budget(None)


def _context(layers: torch.nn.ModuleList) -> offload.OffloadActivations:
    # All but the last layer offloaded, every saved tensor however small, on the cpu transport.
    return offload.OffloadActivations(layers, device="cpu", min_offload_bytes=0, group_bytes=0)


def _model(width: int = 256) -> tuple[torch.nn.ModuleList, torch.Tensor]:
    # Four layers; each offloaded layer saves 256 KiB at width 256.
    return make_mlp_layers(4, width=width), torch.randn(256, width)


def _arena(ledger: HostLedger, budget: int = 1 << 30) -> HostArena:
    # A pinned arena whose "pinned" blocks are plain host tensors (CPU CI), charging ``ledger``.
    return HostArena(
        pinned=True, budget_bytes=budget, retain=False, ledger=ledger,
        allocate=lambda n: (torch.empty(n, dtype=torch.uint8), n),
    )


def _held_by(arena: HostArena) -> int:
    return arena.counters.bytes_held + arena.counters.bytes_pending


# -- the ledger --------------------------------------------------------------------------------
def test_every_arena_of_the_process_charges_one_ledger_and_refunds_what_it_frees() -> None:
    ledger = HostLedger()
    ledger.set_budget(6 * BLOCK_GRANULE)
    first, second = _arena(ledger), _arena(ledger)
    a = first.acquire(4 * BLOCK_GRANULE, step=1)
    b = second.acquire(2 * BLOCK_GRANULE, step=1)
    assert a is not None and b is not None
    assert ledger.held_bytes == _held_by(first) + _held_by(second) == 6 * BLOCK_GRANULE
    with pytest.warns(UserWarning, match=r"over its host budget .*set_process_host_budget"):
        refused = second.acquire(BLOCK_GRANULE, step=1)
    assert refused is None, "a block beyond the process budget was handed out"
    assert second.counters.process_refusals == 1 and ledger.held_bytes == 6 * BLOCK_GRANULE
    first.release(a, None)
    assert first.free_idle() == 4 * BLOCK_GRANULE
    assert ledger.held_bytes == 2 * BLOCK_GRANULE, "a freed block was not refunded to the ledger"
    assert second.acquire(BLOCK_GRANULE, step=1) is not None  # room again
    assert ledger.peak_bytes <= 6 * BLOCK_GRANULE


def test_an_arena_dropped_without_close_refunds_everything_it_held() -> None:
    ledger = HostLedger()
    arena = _arena(ledger)
    region = arena.acquire(3 * BLOCK_GRANULE, step=1)
    arena.preallocate([2 * BLOCK_GRANULE])
    assert ledger.held_bytes == 5 * BLOCK_GRANULE
    del arena, region
    gc.collect()
    assert ledger.held_bytes == 0, "a dropped arena's blocks are still charged to the process"


def test_blocks_being_pinned_are_charged_and_close_cancels_and_refunds_them() -> None:
    ledger = HostLedger()
    gate = threading.Event()

    def slow(n: int) -> tuple[torch.Tensor, int]:
        gate.wait(10)
        return torch.empty(n, dtype=torch.uint8), n

    arena = HostArena(pinned=True, budget_bytes=1 << 30, retain=False, ledger=ledger, allocate=slow)
    arena.preallocate([BLOCK_GRANULE] * 3, background=True)
    assert ledger.held_bytes == _held_by(arena) == 3 * BLOCK_GRANULE  # charged while queued
    threading.Timer(0.2, gate.set).start()
    arena.free_idle()  # the block in progress finishes and is freed; the queued ones are cancelled
    assert arena.counters.bytes_pending == 0 and arena.counters.bytes_held == 0
    assert ledger.held_bytes == 0, "blocks queued on the pinner stayed charged after close"
    assert arena.counters.failures == 0  # a cancelled block is not a refused one


def test_the_charge_follows_the_bytes_really_held() -> None:
    ledger = HostLedger()
    arena = HostArena(
        pinned=True, budget_bytes=1 << 30, retain=False, ledger=ledger,
        allocate=lambda n: (torch.empty(n, dtype=torch.uint8), -(-n // (2 * MIB)) * 2 * MIB),
    )
    region = arena.acquire(3 * BLOCK_GRANULE, step=1)
    assert region is not None and ledger.held_bytes == arena.counters.bytes_held == 2 * MIB
    arena.release(region, None)
    arena.free_idle()
    assert ledger.held_bytes == 0


def test_expected_held_bytes_are_each_allocators_rounding() -> None:
    n = 3 * BLOCK_GRANULE + 1
    assert expected_held_bytes(n, pinned=False, native_live=True) == n  # plain host memory
    assert expected_held_bytes(n, pinned=True, native_live=False) == 256 * 1024  # torch: power of 2
    assert expected_held_bytes(n, pinned=True, native_live=True) == -(-n // 4096) * 4096
    big = HUGE_PAGE_MIN_BYTES + 1
    assert expected_held_bytes(big, pinned=True, native_live=True) == HUGE_PAGE_MIN_BYTES + 2 * MIB


def test_a_bad_process_budget_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="set_process_host_budget"):
        HostLedger().set_budget(-1)


# -- torch's pinned cache ------------------------------------------------------------------------
def test_the_pinned_cache_is_emptied_once_the_freed_blocks_are_dead(
    python_copies: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the extension, a freed block stays pinned in torch's cache until it is emptied:
    the arena must empty it after every trim and close, when the block is already gone."""
    ledger = HostLedger()
    arena = _arena(ledger)
    blocks: list[weakref.ref] = []
    dead_at_release: list[list[bool]] = []  # per call: which blocks were already freed
    monkeypatch.setattr(
        "offload.host.arena.release_cached_pinned", lambda: dead_at_release.append([r() is None for r in blocks])
    )
    for step, size in ((1, 8 * BLOCK_GRANULE), (2, 3 * BLOCK_GRANULE)):  # too small to reuse step 1's
        region = arena.acquire(size, step=step)
        assert region is not None
        blocks.append(weakref.ref(region.block))
        arena.release(region, None)
        del region
    arena.end_step(2)  # trims step 1's block
    assert dead_at_release == [[True, False]], "the trim did not empty torch's pinned cache once its block was freed"
    arena.free_idle()
    assert dead_at_release[1:] == [[True, True]], "close did not empty torch's pinned cache once its blocks were freed"
    assert ledger.held_bytes == 0


def test_with_the_extension_the_users_pinned_cache_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The extension's blocks unpin themselves: torch's cache (which also holds the user's own
    pinned blocks) is not emptied when the arena frees blocks."""
    if native.extension() is None:
        pytest.skip(f"native extension not live: {native.native_reason()}")
    emptied: list[int] = []
    monkeypatch.setattr("offload.host.arena.release_cached_pinned", lambda: emptied.append(1))
    arena = _arena(HostLedger())
    region = arena.acquire(8 * BLOCK_GRANULE, step=1)
    assert region is not None
    arena.release(region, None)
    del region
    assert arena.free_idle() > 0 and not emptied


# -- contexts, on the pure-Python transport ------------------------------------------------------
def test_close_gives_the_contexts_bytes_back_to_the_process(python_copies: None, ledger: HostLedger) -> None:
    layers, x = _model()
    before = ledger.held_bytes
    oa = _context(layers)
    oa_step(layers, x, oa)
    held = oa.engine.arena.counters.bytes_held
    assert held > 0 and ledger.held_bytes - before == held
    oa.close()
    assert ledger.held_bytes == before, "close() left host bytes charged to the process"
    oa_step(layers, x, oa)  # usable again after close: it pins again
    assert ledger.held_bytes - before == oa.engine.arena.counters.bytes_held > 0
    del oa
    gc.collect()
    assert ledger.held_bytes == before, "a context dropped without close() left its bytes charged"


def test_contexts_in_sequence_never_hold_more_than_the_process_budget(python_copies: None, ledger: HostLedger) -> None:
    """The report's script: several contexts one after another on one model (different batch
    sizes, so different block sizes), each closed before the next."""
    layers, _ = _model()
    probe = _context(layers)
    oa_step(layers, torch.randn(512, 256), probe)
    largest = probe.engine.arena.counters.bytes_held
    probe.close()
    base = ledger.held_bytes
    ledger.set_budget(base + largest)
    ledger.reset_peak()
    for rows in (512, 384, 256, 448, 512):
        x = torch.randn(rows, 256)
        expected = plain_reference(layers, x)
        oa = _context(layers)
        assert_bitwise(expected, oa_step(layers, x, oa))
        assert oa.stats["groups_offloaded"] == 3, f"batch {rows} did not fit after the contexts before it"
        oa.close()
        assert ledger.held_bytes == base, f"the context of batch {rows} left bytes charged after close()"
    # Counted (the largest batch held all it needed), and never more than the budget.
    assert ledger.peak_bytes == base + largest


@pytest.mark.parametrize("setting", ["0", "1"])
def test_two_live_contexts_share_the_budget_and_the_second_keeps_what_does_not_fit(
    setting: str, ledger: HostLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OFFLOAD_NATIVE", setting)
    try:
        if native.reload_native_setting() is not (setting == "1"):
            pytest.skip(f"native extension not live: {native.native_reason()}")
        layers, x = _model()
        expected = plain_reference(layers, x)
        first = _context(layers)
        assert_bitwise(expected, oa_step(layers, x, first))
        need = first.engine.arena.counters.bytes_held
        base = ledger.held_bytes - need
        budget = base + need + need // 2  # room for the first context and half of a second
        ledger.set_budget(budget)
        ledger.reset_peak()
        second = _context(layers)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert_bitwise(expected, oa_step(layers, x, second))
        stats = second.stats
        assert ledger.peak_bytes <= budget, (
            f"two contexts held {ledger.peak_bytes - base} bytes together, over the "
            f"{budget - base} the process budget allows"
        )
        assert stats["kept"].get("budget", 0) > 0, f"the second context kept nothing for the budget: {stats['kept']}"
        assert 0 < stats["offloaded_tensors"], "the half that fits was not offloaded"
        assert any("shared by every offload context" in str(w.message) for w in seen), "no warning said why"
        assert stats["native"] is (setting == "1")
        first.close()
        assert_bitwise(expected, oa_step(layers, x, second))
        assert second.stats["groups_offloaded"] == 3 and "budget" not in second.stats["kept"]
        assert ledger.peak_bytes <= budget
        second.close()
        assert ledger.held_bytes == base
    finally:
        monkeypatch.undo()
        native.reload_native_setting()


def test_reserve_beyond_the_process_budget_names_it(python_copies: None, ledger: HostLedger) -> None:
    layers, _ = _model()
    oa = _context(layers)
    ledger.set_budget(ledger.held_bytes + 4 * BLOCK_GRANULE)
    with pytest.raises(ValueError, match=r"process .*set_process_host_budget"):
        oa.reserve(8 * BLOCK_GRANULE)
    assert oa.engine.arena.counters.bytes_held == 0
