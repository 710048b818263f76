"""The entry table: offload._entries (C++, torch's API) against its Python reference.

Both must give the same slots, entries, layout offsets and restored views for any mix of saved
tensors, keep the version counters through release, and hold no memory they should not. CI sets
``OFFLOAD_REQUIRE_NATIVE=1``, so a missing ``offload._entries`` build fails there.
"""

from __future__ import annotations

import os
import random
from typing import Any, Callable

import pytest
import torch

from offload.engine.entry_table import EntryTable
from offload.host import native
from offload.host.layout import ALIGNMENT

REQUIRE_NATIVE = os.environ.get("OFFLOAD_REQUIRE_NATIVE", "") == "1"


def native_table(retain: bool = True) -> Any:
    ext = native.entries_extension()
    if ext is None:
        if REQUIRE_NATIVE:
            pytest.fail(f"OFFLOAD_REQUIRE_NATIVE=1 but offload._entries is not live: {native.entries_reason()}")
        pytest.skip(f"offload._entries not live: {native.entries_reason()}")
    return ext.EntryTable(retain, ALIGNMENT)


def python_table(retain: bool = True) -> EntryTable:
    return EntryTable(retain, ALIGNMENT)


KINDS: dict[str, Callable[..., Any]] = {"native": native_table, "python": python_table}


def saved_tensors(seed: int) -> list[torch.Tensor]:
    """A mix like a layer's saved tensors: views of shared storages, odd strides and offsets,
    several dtypes, conjugate and negative bits, a zero-size view, an expanded (stride 0) one."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    base = torch.randn(64, 96)
    raw = torch.randint(0, 255, (5000,), dtype=torch.uint8)
    z = torch.randn(16, 8, dtype=torch.complex64)
    pool = [
        base, base[3:17], base.t(), base[:, 5:40:3], base.split(32, dim=1)[2],
        torch.randn(7, 5, dtype=torch.bfloat16)[:, 1:4],
        raw[1000:2024].view(32, 32), raw[4000:4016].view(torch.float32),
        z, z.conj(), torch._neg_view(z), torch._neg_view(z.conj()), z.conj().imag,
        torch.randn(3, 1).expand(3, 6), base[5:5], torch.arange(10, dtype=torch.int64)[::2],
    ]
    rng.shuffle(pool)
    return pool[: rng.randint(4, len(pool))]


def filled_buffer(table: Any, offsets: list[int], total: int) -> torch.Tensor:
    """The reload buffer the transport would build: each slot's span at its offset."""
    buffer = torch.zeros(total, dtype=torch.uint8)
    for view, off in zip(table.slot_byte_views(torch.device("cpu")), offsets):
        buffer[off : off + view.numel()].copy_(view)
    return buffer


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        and (a.is_conj(), a.is_neg()) == (b.is_conj(), b.is_neg())
        and torch.equal(a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg())
    )


@pytest.mark.parametrize("seed", range(12))
def test_native_and_reference_agree_and_restore_exactly(seed: int) -> None:
    tensors = saved_tensors(seed)
    tables = [native_table(), python_table()]
    for table in tables:
        assert [table.add(t) for t in tensors] == list(range(len(tensors)))
    ours, ref = tables
    assert len(ours) == len(ref) == len(tensors)
    assert ours.slot_count() == ref.slot_count()
    assert ours.slot_sizes() == ref.slot_sizes()
    assert (ours.slot_lo, ours.slot_hi) == (ref.slot_lo, ref.slot_hi)
    assert [ours.entry(i) for i in range(len(tensors))] == [ref.entry(i) for i in range(len(tensors))]
    offsets, total = native.plan_layout(ref.slot_sizes())
    for table in tables:
        table.close(offsets)
    assert ours.element_offsets == ref.element_offsets
    buffer = filled_buffer(ref, offsets, total)
    for i, t in enumerate(tensors):
        mine, theirs = ours.restore(i, buffer), ref.restore(i, buffer)
        assert same_view(mine, t) and same_view(theirs, t), i
        assert mine.data_ptr() == theirs.data_ptr()
        # Same address modulo the alignment as the original in its storage: FP8 GEMMs stay fed.
        assert t.numel() == 0 or (mine.data_ptr() - buffer.data_ptr()) % ALIGNMENT == (t.data_ptr() - t.untyped_storage().data_ptr()) % ALIGNMENT
        assert ours.original(i) is not None and torch.equal(ours.original(i).resolve_conj().resolve_neg(), t.resolve_conj().resolve_neg())


def test_many_storages_and_their_views_find_their_slots() -> None:
    # A MOE layer's group: hundreds of storages, each saved once or more (a view of one saved
    # after others came), empty storages among them. The native table's address index grows as
    # storages come (its first size is 64); every view must still find its storage's slot.
    torch.manual_seed(0)
    storages = [torch.randn(8 + i % 5) for i in range(300)] + [torch.empty(0) for _ in range(3)]
    rng = random.Random(0)
    tensors = list(storages)
    tensors += [s[1:] if s.numel() else s for s in rng.sample(storages, 150)]
    rng.shuffle(tensors)
    ours, ref = native_table(), python_table()
    for table in (ours, ref):
        for t in tensors:
            table.add(t)
    assert ours.slot_count() == ref.slot_count() == 301  # the three empty storages share one slot
    assert [ours.slot_of(i) for i in range(len(tensors))] == [ref.slot_of(i) for i in range(len(tensors))]
    assert (ours.slot_lo, ours.slot_hi) == (ref.slot_lo, ref.slot_hi)


@pytest.mark.parametrize("kind", KINDS)
def test_copy_lists_point_at_each_slot_span(kind: str) -> None:
    base = torch.randn(1000)
    other = torch.randn(10, 10)
    table = KINDS[kind]()
    table.add(base[300:700])
    table.add(base[100:200])
    table.add(other.t())
    offsets, _ = native.plan_layout(table.slot_sizes())
    table.close(offsets)
    dsts, srcs, sizes = table.copy_lists(1 << 20)
    assert dsts == [(1 << 20) + off for off in offsets]
    assert sizes == table.slot_sizes() == [700 * 4 - (100 * 4 // ALIGNMENT) * ALIGNMENT, 400]
    assert srcs == [base.data_ptr() + (100 * 4 // ALIGNMENT) * ALIGNMENT, other.data_ptr()]


@pytest.mark.parametrize("kind", KINDS)
def test_in_place_change_is_seen_before_and_after_release(kind: str) -> None:
    a, b = torch.randn(8, 8), torch.randn(4)
    table = KINDS[kind]()
    table.add(a)
    table.add(b)
    offsets, total = native.plan_layout(table.slot_sizes())
    table.close(offsets)
    buffer = filled_buffer(table, offsets, total)
    a.mul_(2)  # while held
    assert table.original(0) is None and table.original(1) is not None
    assert table.describe(0) == ([8, 8], torch.float32, 1, 0)
    versions = (a._version, b._version)
    table.release()
    assert (a._version, b._version) == versions, "release moved a version counter"
    assert not table.holds_originals
    assert table.restore(1, buffer) is not None
    b.view(-1).add_(1)  # after release, through another alias of the same counter
    assert table.restore(1, buffer) is None
    assert table.describe(1) == ([4], torch.float32, 1, 0)
    with pytest.raises(RuntimeError, match="released"):
        table.original(1)


@pytest.mark.parametrize("kind", KINDS)
def test_release_and_measuring_tables_hold_no_memory(kind: str) -> None:
    # Released: the table's aliases are emptied, so the caller's last reference frees the bytes.
    t = torch.randn(256, 256)
    ref = t.untyped_storage()._weak_ref()
    table = KINDS[kind]()
    table.add(t[1:9])
    table.close(native.plan_layout(table.slot_sizes())[0])
    table.release()
    del t
    assert torch.UntypedStorage._expired(ref), "a released table still holds the original's storage"
    # retain=False (the planner's probe): nothing is ever held.
    u = torch.randn(64, 64)
    uref = u.untyped_storage()._weak_ref()
    measuring = KINDS[kind](retain=False)
    measuring.add(u)
    assert measuring.slot_sizes() == [64 * 64 * 4]
    del u
    assert torch.UntypedStorage._expired(uref), "a measuring table held the tensor's storage"


@pytest.mark.parametrize("kind", KINDS)
def test_bad_use_is_refused_with_a_message(kind: str) -> None:
    table = KINDS[kind]()
    table.add(torch.randn(4))
    with pytest.raises((IndexError, ValueError), match="out of range|index"):
        table.entry(5)
    with pytest.raises(ValueError, match="one offset per slot"):
        table.close([0, 256])
    with pytest.raises(RuntimeError, match="closed table"):
        table.copy_lists(0)
    table.close([0])
    with pytest.raises(RuntimeError, match="closed entry table"):
        table.add(torch.randn(4))


def test_a_build_for_another_torch_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    native_table()  # skips (or fails under OFFLOAD_REQUIRE_NATIVE) without the build
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    try:
        native.reload_native_setting()
        assert native.entries_extension() is None
        assert "built for torch" in native.entries_reason() and "0.0.0-other" in native.entries_reason()
    finally:
        monkeypatch.undo()
        native.reload_native_setting()
    assert native.entries_reason() == "live"


def test_off_switch_and_a_missing_build_fall_back_to_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    from offload.engine import entry_table

    real_import = native.importlib.import_module
    try:
        monkeypatch.setenv("OFFLOAD_NATIVE", "0")
        native.reload_native_setting()
        assert native.entries_extension() is None and "OFFLOAD_NATIVE" in native.entries_reason()
        assert type(entry_table.new_entry_table(True, ALIGNMENT)) is EntryTable
        monkeypatch.setenv("OFFLOAD_NATIVE", "1")

        def no_entries(name: str) -> Any:
            if name == "offload._entries":
                raise ImportError("No module named 'offload._entries'")
            return real_import(name)

        monkeypatch.setattr(native.importlib, "import_module", no_entries)
        native.reload_native_setting()
        assert native.entries_extension() is None
        assert "--no-build-isolation" in native.entries_reason()
        assert type(entry_table.new_entry_table(True, ALIGNMENT)) is EntryTable
    finally:
        monkeypatch.undo()
        native.reload_native_setting()
