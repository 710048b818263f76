"""The selection policy, the layout function and the group (dedup, view->base, typed restore)."""

from __future__ import annotations

import random

import pytest
import torch

from offload import mark_activation_offload, mark_not_offload
from offload.engine.entry_table import storage_extent_bytes
from offload.engine.group import Group, GroupState
from offload.host.layout import align_up, plan_layout_py
from offload.engine.marks import TE_KEEP_ATTR
from offload.engine.policy import SelectionPolicy


def policy(selection: str = "auto", min_bytes: int = 16, budget: int = 1 << 30, device_index: int = -1) -> SelectionPolicy:
    spent = [0]

    def reserve(n: int) -> bool:
        if spent[0] + n > budget:
            return False
        spent[0] += n
        return True

    return SelectionPolicy(device_index=device_index, min_offload_bytes=min_bytes, selection=selection, reserve_host_bytes=reserve)


# -- policy ---------------------------------------------------------------------------------------
def test_plain_activation_is_offloaded() -> None:
    assert policy().decide(torch.randn(64) * 2) is None


def test_parameters_and_their_views_are_kept() -> None:
    p = torch.nn.Parameter(torch.randn(8, 8))
    assert policy().decide(p) == "parameter"
    assert policy().decide(p.t()) == "parameter"
    leaf_input = torch.randn(8, 8, requires_grad=True)
    assert policy().decide(leaf_input) == "parameter"


def test_frozen_parameters_and_their_views_are_kept() -> None:
    frozen = torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)
    assert policy().decide(frozen) == "parameter"
    assert policy().decide(frozen.t()) == "parameter"
    assert policy().decide(frozen[2:].t()) == "parameter"


def test_subclass_parameters_are_kept_before_anything_else() -> None:
    class Sub(torch.Tensor):
        pass

    weight = torch.randn(8, 8).as_subclass(Sub)
    weight._is_param = True  # what nn.Parameter marks subclass parameters with
    assert policy().decide(weight) == "parameter"
    leaf = torch.randn(8, 8).as_subclass(Sub).requires_grad_(True)
    assert policy().decide(leaf) == "parameter"


def test_registered_module_storages_are_kept() -> None:
    module = torch.nn.Linear(8, 8)
    module.register_buffer("table", torch.randn(16, 8))
    pol = policy()
    assert pol.decide(module.table[:4]) is None
    assert pol.decide(module.weight.data) is None  # an alias with no _base
    pol.set_module_storages([module])
    assert pol.decide(module.table[:4]) == "parameter"
    assert pol.decide(module.table) == "parameter"
    assert pol.decide(module.weight.data) == "parameter"
    assert pol.decide(torch.randn(64) * 2) is None
    pol.set_module_storages([])
    assert pol.decide(module.table[:4]) is None


@pytest.mark.filterwarnings("ignore:.*nested tensors.*:UserWarning")
def test_nested_tensors_are_kept_unsupported() -> None:
    parts = [torch.randn(3, 8), torch.randn(5, 8)]
    assert policy().decide(torch.nested.nested_tensor(parts, layout=torch.strided)) == "unsupported"
    assert policy().decide(torch.nested.nested_tensor(parts, layout=torch.jagged)) == "unsupported"


def test_marks_keep_and_win_over_opt_in() -> None:
    t = torch.randn(64) * 2
    mark_not_offload(t)
    assert policy().decide(t) == "marked"
    both = torch.randn(64) * 2
    mark_activation_offload(both)
    mark_not_offload(both)
    assert policy("marked").decide(both) == "marked"
    base = torch.randn(8, 8) * 2
    mark_not_offload(base)
    assert policy().decide(base[2:]) == "marked"
    te = torch.randn(64) * 2
    setattr(te, TE_KEEP_ATTR, True)
    assert policy().decide(te) == "marked"


def test_small_tensors_kept_unless_opted_in() -> None:
    small = torch.randn(2) * 2  # 8 bytes < 16
    assert policy().decide(small) == "small"
    mark_activation_offload(small)
    assert policy().decide(small) is None
    assert policy(min_bytes=0).decide(torch.empty(0)) == "small"


def test_opt_in_selection() -> None:
    t = torch.randn(64) * 2
    assert policy("marked").decide(t) == "not_selected"
    mark_activation_offload(t)
    assert policy("marked").decide(t) is None


def test_other_device_and_unsupported() -> None:
    assert policy(device_index=0).decide(torch.randn(64) * 2) == "other_device"
    assert policy().decide(torch.empty(64, device="meta")) == "unsupported"

    class Sub(torch.Tensor):
        pass

    assert policy().decide((torch.randn(64) * 2).as_subclass(Sub)) == "unsupported"


def test_budget_refuses_once_exhausted() -> None:
    pol = policy(budget=64 * 4 + 10)
    assert pol.decide(torch.randn(64) * 2) is None
    assert pol.decide(torch.randn(64) * 2) == "budget"


def test_unknown_selection_is_an_error() -> None:
    with pytest.raises(ValueError, match="selection"):
        policy("everything")


# -- layout ---------------------------------------------------------------------------------------
def test_layout_aligns_every_entry() -> None:
    offsets, total = plan_layout_py([1, 0, 300, 256, 5])
    assert offsets == [0, 256, 256, 768, 1024]
    assert total == 1280
    assert all(o % 256 == 0 for o in offsets)


def test_layout_random_invariants() -> None:
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([0, 1, 7, 255, 256, 257, rng.randrange(1, 10_000)]) for _ in range(rng.randrange(0, 20))]
        offsets, total = plan_layout_py(sizes)
        ends = [o + s for o, s in zip(offsets, sizes)]
        assert all(o % 256 == 0 for o in offsets)
        assert all(e <= n for e, n in zip(ends, offsets[1:] + [total]))
        assert total == (align_up(ends[-1]) if sizes else 0)


def test_layout_errors() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        plan_layout_py([4, -1])
    with pytest.raises(ValueError, match="power of two"):
        plan_layout_py([4], alignment=48)


# -- group ----------------------------------------------------------------------------------------
def close(group: Group) -> None:
    group.close()


def reload_from_originals(group: Group) -> None:
    """Build the reload buffer the way the transport would: each slot's bytes at its offset."""
    buffer = torch.zeros(group.nbytes, dtype=torch.uint8)
    for view, off in zip(group.table.slot_byte_views(torch.device("cpu")), group.table.copy_lists(0)[0]):
        buffer[off : off + view.numel()].copy_(view)
    group.state = GroupState.OFFLOADED
    group.mark_reloaded(buffer, None)


def test_views_of_one_storage_share_a_slot_and_restore_exactly(entry_table: str) -> None:
    base = torch.randn(4, 96)
    q, k, v = base.split(32, dim=1)
    qt = q.t()
    group = Group(0, 1)
    tensors = [q, k, v, qt, base]
    for t in tensors:
        group.add(t)
    assert group.table.slot_count() == 1
    close(group)
    reload_from_originals(group)
    for i, t in enumerate(tensors):
        r = group.table.restore(i, group.gpu)
        assert r.dtype == t.dtype and r.shape == t.shape and r.stride() == t.stride()
        assert torch.equal(r, t)
        # The restored address keeps the original's offset modulo 256 within its storage.
        assert (r.data_ptr() - group.gpu.data_ptr()) % 256 == (t.data_ptr() - t.untyped_storage().data_ptr()) % 256


def test_typed_views_keep_their_dtype(entry_table: str) -> None:
    data = torch.randint(0, 255, (32, 48), dtype=torch.uint8)
    scale = torch.tensor([0.125], dtype=torch.float32)
    amax = torch.tensor([3.5], dtype=torch.float32)
    half = torch.randn(7, 5, dtype=torch.bfloat16)[:, 1:4]  # non-contiguous, odd sizes
    group = Group(0, 1)
    items = [data, scale, amax, half, data.t()]
    for t in items:
        group.add(t)
    close(group)
    assert all(o % 256 == 0 for o in group.table.copy_lists(0)[0])
    reload_from_originals(group)
    for i, t in enumerate(items):
        r = group.table.restore(i, group.gpu)
        assert r.dtype == t.dtype, (i, r.dtype, t.dtype)
        assert r.shape == t.shape and r.stride() == t.stride()
        assert torch.equal(r, t)


def test_lazy_conjugate_and_negative_views_restore_with_their_bits(entry_table: str) -> None:
    z = torch.randn(8, 8, dtype=torch.complex64)
    r = torch.randn(8, 8)
    items = [z, z.conj(), torch._neg_view(z), torch._neg_view(z.conj()), z.conj().imag, torch._neg_view(r), r]
    group = Group(0, 1)
    for t in items:
        group.add(t)
    assert group.table.slot_count() == 2  # the views share their base's bytes
    close(group)
    reload_from_originals(group)
    for i, t in enumerate(items):
        back = group.table.restore(i, group.gpu)
        assert (back.is_conj(), back.is_neg()) == (t.is_conj(), t.is_neg()), i
        assert torch.equal(back.resolve_conj().resolve_neg(), t.resolve_conj().resolve_neg()), i


def test_shared_uint8_buffer_components_offloaded_once(entry_table: str) -> None:
    bulk = torch.randint(0, 255, (4096,), dtype=torch.uint8)
    data = bulk[:1024].view(32, 32)
    scales = bulk[1024:1024 + 16].view(torch.float32)
    group = Group(0, 1)
    group.add(data)
    group.add(scales)
    assert group.table.slot_count() == 1
    close(group)
    reload_from_originals(group)
    assert torch.equal(group.table.restore(0, group.gpu), data)
    restored = group.table.restore(1, group.gpu)
    # Compared as bits: random bytes read as float32 can be NaN, which torch.equal never matches.
    assert restored.dtype == torch.float32 and torch.equal(restored.view(torch.int32), scales.view(torch.int32))


def test_storage_extent() -> None:
    t = torch.randn(10, 10)
    assert storage_extent_bytes(t) == 400
    assert storage_extent_bytes(t[:, 2:4]) == ((9 * 10 + 1 * 1) + 1) * 4
    assert storage_extent_bytes(t[:0]) == 0


def test_wrong_transition_is_reported() -> None:
    group = Group(3, 1)
    group.add(torch.randn(4))
    close(group)
    with pytest.raises(RuntimeError, match="layer 3 group cannot go from resident to offloaded"):
        group.mark_released()
