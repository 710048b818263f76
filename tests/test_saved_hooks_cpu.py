"""The native saved-tensor hooks (``offload.engine.saved_hooks``, ``csrc/torch/saved_hooks.cpp``),
pushed by default where ``offload._entries`` is built (``OFFLOAD_NATIVE_HOOKS=0`` keeps the
Python pair).

The Python ``pack`` and ``unpack`` are the definition; the native pair must give the same
gradients and the same stats on every kind of saved tensor (parameters, leaf inputs, views of
both, marked, small, budget-refused, over a module's memory), hand anything else to Python, and
not keep the engine alive.
"""

from __future__ import annotations

import gc
import types
import weakref
from typing import Any

import pytest
import torch

import offload
from offload.engine.packing import PackingMixin
from offload.engine import saved_hooks
from offload.engine.saved_hooks import engine_hooks, native_hooks_requested, python_hook
from offload.host import native

from _util import assert_bitwise, cpu_context, make_gpt_layers, make_mlp_layers, plain_reference, train_step

needs_entries = pytest.mark.skipif(native.entries_extension() is None, reason=f"offload._entries: {native.entries_reason()}")


class Mixed(torch.nn.Module):
    """A layer saving one of each kind: activations, parameters, views of both, a marked and a
    small tensor."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        half = h.shape[1] // 2
        a = self.lin(h)                       # h (or the leaf input), the weight
        b = a * self.scale                    # a, the scale
        c = b[:, :half].sin()                 # a view of an activation
        d = c * self.scale[:half]             # c, a view of a parameter
        marked = b[:, half:].tanh()
        offload.mark_not_offload(marked)
        e = marked * marked                   # a marked tensor, twice
        tiny = b[:1, :1].exp()                # small: kept under a size floor
        return torch.cat([d, e], dim=1) + tiny


def mixed_model(n: int = 4, width: int = 64) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(Mixed(width) for _ in range(n))


def context(native_hooks: bool, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> tuple[Any, Any]:
    monkeypatch.setenv("OFFLOAD_NATIVE_HOOKS", "1" if native_hooks else "0")
    made = cpu_context(3, 4, **kw)
    monkeypatch.delenv("OFFLOAD_NATIVE_HOOKS")
    return made


STAT_KEYS = ("offloaded_tensors", "offloaded_bytes", "kept", "groups_offloaded", "bytes_d2h", "bytes_h2d", "reloads")


@needs_entries
def test_the_native_hooks_are_the_default_and_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OFFLOAD_NATIVE_HOOKS", raising=False)
    assert native_hooks_requested()
    ctx, _ = cpu_context(3, 4)
    # The engine pushes what engine_hooks gave it when it was made.
    assert isinstance(ctx.engine._hooks.pack_hook, types.BuiltinFunctionType)
    assert isinstance(ctx.engine._hooks.unpack_hook, types.BuiltinFunctionType)
    for value in ("1", "on", "TRUE", "", "maybe"):
        monkeypatch.setenv("OFFLOAD_NATIVE_HOOKS", value)
        pack, unpack = engine_hooks(ctx.engine)
        assert isinstance(pack, types.BuiltinFunctionType) and isinstance(unpack, types.BuiltinFunctionType), value
    for value in ("0", "off", " False ", "no"):
        monkeypatch.setenv("OFFLOAD_NATIVE_HOOKS", value)
        assert not native_hooks_requested(), value
        pack, unpack = engine_hooks(ctx.engine)
        assert pack.__func__ is PackingMixin.pack and unpack.__func__ is PackingMixin.unpack, value
        ctx_off, _ = cpu_context(3, 4)
        assert ctx_off.engine._hooks.pack_hook.__func__ is PackingMixin.pack, value


def test_without_the_extension_the_python_hooks_are_pushed(monkeypatch: pytest.MonkeyPatch) -> None:
    # OFFLOAD_NATIVE=0 (or a build without offload._entries): the hooks are the Python pair,
    # whatever OFFLOAD_NATIVE_HOOKS says.
    monkeypatch.delenv("OFFLOAD_NATIVE_HOOKS", raising=False)
    monkeypatch.setattr(native, "entries_extension", lambda: None)
    ctx, _ = cpu_context(3, 4)
    assert ctx.engine._hooks.pack_hook.__func__ is PackingMixin.pack
    assert ctx.engine._hooks.unpack_hook.__func__ is PackingMixin.unpack


@needs_entries
def test_an_opt_in_policy_keeps_the_python_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    # selection="marked": every unmarked activation would be checked natively, then again in
    # Python, so the native pair is not pushed even when asked for.
    ctx, _ = context(True, monkeypatch, selection="marked")
    assert ctx.engine._hooks.pack_hook.__func__ is PackingMixin.pack


@needs_entries
@pytest.mark.parametrize(
    "options",
    [
        {},                                  # everything offloaded
        {"min_offload_bytes": 1024},         # small tensors kept
        {"host_budget_bytes": 40 * 1024},    # the budget refuses part of a step
        {"host_budget_bytes": 0},            # every offloadable tensor refused
        {"group_bytes": None},               # the engine's default: layers share groups
    ],
    ids=["all", "floor", "budget_part", "budget_none", "shared"],
)
@pytest.mark.parametrize("model", ["mixed", "gpt", "mlp"])
def test_native_and_python_hooks_give_the_same_gradients_and_stats(model: str, options: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    layers = {"mixed": mixed_model, "gpt": make_gpt_layers, "mlp": make_mlp_layers}[model]()
    torch.manual_seed(1)
    x = torch.randn(2, 8, 64) if model == "gpt" else torch.randn(8, 64)
    expected = plain_reference(layers, x)
    stats = {}
    for native_hooks in (False, True):
        ctx, sync = context(native_hooks, monkeypatch, **options)
        for _ in range(2):  # the second step reuses the arena's blocks
            assert_bitwise(expected, train_step(layers, x, ctx, sync))
        stats[native_hooks] = {k: ctx.stats[k] for k in STAT_KEYS}
    assert stats[True] == stats[False]
    if options == {}:
        assert stats[True]["offloaded_tensors"] > 0 and stats[True]["kept"].get("parameter", 0) > 0
    if model == "mixed":
        kept = stats[True]["kept"]
        assert kept.get("marked", 0) >= 4  # marked on its own and as e's inputs, every offloaded layer


@needs_entries
def test_module_memory_is_kept_by_both_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    # A tensor over a registered module's parameter memory (not a view of it, so only the
    # module-storage rule keeps it) goes through Python with the native hooks too.
    layers = make_mlp_layers()
    x = torch.randn(8, 64)

    def weight_alias_step(ctx: Any, sync: Any) -> list[torch.Tensor]:
        for p in layers.parameters():
            p.grad = None
        h = x.detach().requires_grad_(True)
        for i, layer in enumerate(layers):
            with ctx:
                alias = layer.fc.weight.detach()  # same storage, no node, not a view
                h = layer(h) + (h @ alias).sum() * 0.0
            h = sync(h)
        h.float().pow(2).mean().backward()
        return [p.grad.clone() for p in layers.parameters()]

    stats = {}
    grads = {}
    for native_hooks in (False, True):
        ctx, sync = context(native_hooks, monkeypatch)
        ctx.engine.register_module_storages(*layers)
        grads[native_hooks] = weight_alias_step(ctx, sync)
        stats[native_hooks] = ctx.stats["kept"]
    assert_bitwise(grads[False], grads[True])
    assert stats[True] == stats[False] and stats[True]["parameter"] > 0


@needs_entries
def test_native_hooks_take_the_common_cases_without_python(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"pack": 0, "unpack": 0}
    pack, unpack = PackingMixin.pack, PackingMixin.unpack

    def counted_pack(self: Any, t: torch.Tensor, group: Any = None) -> Any:
        calls["pack"] += 1
        return pack(self, t, group)

    def counted_unpack(self: Any, packed: Any) -> Any:
        calls["unpack"] += 1
        return unpack(self, packed)

    monkeypatch.setattr(PackingMixin, "pack", counted_pack)
    monkeypatch.setattr(PackingMixin, "unpack", counted_unpack)
    layers = make_mlp_layers()
    x = torch.randn(8, 64)
    expected = plain_reference(layers, x)
    ctx, sync = context(True, monkeypatch, group_bytes=None)  # one shared group
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    stats = ctx.stats
    assert stats["groups_offloaded"] == 1 and stats["offloaded_tensors"] >= 4
    # Packs: parameters and activations, all natively (the last layer, not offloaded, pushes no
    # hooks). Unpacks through Python: only the reload's first entry (it waits for the copy) and
    # its last (it drops the buffer); the other entries and the kept parameters natively.
    assert calls["pack"] == 0, calls
    assert calls["unpack"] == 2, calls


@needs_entries
def test_small_tensors_are_kept_natively_and_diagnosed_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    # Under the size floor the native pack keeps the tensor itself ("small"), with no Python
    # pack, and tallies the largest one as the policy does: the "nothing offloaded" warning names
    # the same size whichever hooks ran.
    calls = {"pack": 0}
    pack = PackingMixin.pack

    def counted_pack(self: Any, t: torch.Tensor, group: Any = None) -> Any:
        calls["pack"] += 1
        return pack(self, t, group)

    monkeypatch.setattr(PackingMixin, "pack", counted_pack)
    layers = mixed_model()
    x = torch.randn(8, 64)
    expected = plain_reference(layers, x)
    messages, kept = {}, {}
    for native_hooks in (False, True):
        calls["pack"] = 0
        ctx, sync = context(native_hooks, monkeypatch, min_offload_bytes=1 << 30)
        with pytest.warns(UserWarning, match="smaller than min_offload_bytes") as caught:
            assert_bitwise(expected, train_step(layers, x, ctx, sync))
        messages[native_hooks] = [str(w.message) for w in caught]
        kept[native_hooks] = ctx.stats["kept"]
        if native_hooks:
            marked_packs = calls["pack"]
    assert messages[True] == messages[False]
    assert "the largest of them had 2048 bytes" in messages[True][0]  # a (8, 64) float32 activation
    assert kept[True] == kept[False] and kept[True]["small"] > 0
    # Only the marked tensors (and views of them) still go through the Python pack.
    assert 0 < marked_packs <= kept[True]["marked"]


@needs_entries
def test_in_place_change_is_refused_with_native_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    layers = make_mlp_layers()
    x = torch.randn(8, 64, requires_grad=True)
    ctx, sync = context(True, monkeypatch, group_bytes=None)
    h = x * 1.0
    saved = []
    for layer in layers:
        with ctx:
            h = layer(h)
        saved.append(h)
        h = sync(h)
    saved[1].mul_(2)  # saved by layer 2's Linear, in the shared group
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        h.sum().backward()


@needs_entries
def test_an_engine_with_native_hooks_is_collected(monkeypatch: pytest.MonkeyPatch) -> None:
    # The state tuple is GC-tracked, so engine -> hooks -> state -> engine.pack -> engine is a
    # cycle the collector breaks.
    layers = make_mlp_layers()
    x = torch.randn(8, 64)
    ctx, sync = context(True, monkeypatch)
    train_step(layers, x, ctx, sync)
    engine = weakref.ref(ctx.engine)
    del ctx, sync
    gc.collect()
    assert engine() is None


@needs_entries
def test_make_saved_hooks_refuses_a_malformed_state() -> None:
    ext = native.entries_extension()
    with pytest.raises(ValueError, match="state tuple"):
        ext.make_saved_hooks((1, 2, 3))
    with pytest.raises(TypeError, match="malformed"):
        ext.make_saved_hooks(tuple(range(ext.SAVED_HOOKS_STATE_SIZE)))


@needs_entries
def test_the_engine_behind_native_hooks_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    # offload.scope reads the innermost hooks' engine: through a native hook, its Python one.
    ext = native.entries_extension()
    ctx, sync = context(True, monkeypatch)
    pack, unpack = ctx.engine._hooks.pack_hook, ctx.engine._hooks.unpack_hook
    assert python_hook(pack).__self__ is ctx.engine and python_hook(pack).__func__ is PackingMixin.pack
    assert python_hook(unpack).__func__ is PackingMixin.unpack
    assert python_hook(PackingMixin.pack) is PackingMixin.pack
    assert ext.SAVED_HOOKS_STATE_SIZE == saved_hooks._STATE_SIZE == len(saved_hooks._state(ctx.engine, pack, unpack))
    layers = make_mlp_layers()
    seen = []
    h = torch.randn(8, 64, requires_grad=True)
    for layer in layers:
        with ctx:
            seen.append(offload.is_cpu_offload_enabled())
            with offload.keep_on_gpu():
                h = layer(h)
        h = sync(h)
    h.sum().backward()
    assert seen == [True, True, True, False]  # the last layer is not offloaded
    assert ctx.stats["kept"]["keep_on_gpu"] > 0


class ManySmall(torch.nn.Module):
    """A layer saving many small activations, as a MoE layer's experts do (one per branch)."""

    def __init__(self, width: int, branches: int) -> None:
        super().__init__()
        self.scales = torch.nn.Parameter(torch.linspace(0.5, 1.5, branches * width).view(branches, width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return sum((h * s).sin() for s in self.scales) / len(self.scales)  # sin saves each product


def many_small_model(n: int = 4, width: int = 16, branches: int = 32) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(ManySmall(width, branches) for _ in range(n))


@needs_entries
def test_native_pack_claims_host_memory_once_for_many_small_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    # Asking the arena (a Python call) for every small tensor was a fifth of the native pack's
    # time on MOE: the group claims a credit ahead and its next tensors spend it.
    layers = many_small_model()
    x = torch.randn(8, 16)
    expected = plain_reference(layers, x)
    ctx, sync = context(True, monkeypatch)
    policy = ctx.engine.policy
    calls = {"claim": 0, "claim_ahead": 0}
    reserve, claim_ahead = policy.reserve_host_bytes, policy.claim_ahead

    def counted_reserve(nbytes: int) -> bool:
        calls["claim"] += 1
        return reserve(nbytes)

    def counted_claim_ahead(nbytes: int, ahead: int) -> int:
        calls["claim_ahead"] += 1
        return claim_ahead(nbytes, ahead)

    policy.reserve_host_bytes = counted_reserve
    if claim_ahead is not None:
        policy.claim_ahead = counted_claim_ahead
    steps = 2
    for _ in range(steps):
        assert_bitwise(expected, train_step(layers, x, ctx, sync))
    offloaded, groups = ctx.stats["offloaded_tensors"], ctx.stats["groups_offloaded"]
    assert offloaded >= 3 * 32 and groups == 3
    assert calls == {"claim": 0, "claim_ahead": steps * groups}, (calls, offloaded)


@needs_entries
@pytest.mark.parametrize("native_hooks", [False, True], ids=["python", "native"])
@pytest.mark.parametrize("budget", [None, 84 * 1024], ids=["default", "refusing_part"])
def test_host_claims_are_given_back_each_step_and_after_a_failed_forward(
    native_hooks: bool, budget: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What pack claimed (the credit claimed ahead included) goes back when the group is laid out
    # or the forward fails: a claim kept would shrink every later step's host budget.
    layers = many_small_model()
    x = torch.randn(8, 16)
    expected = plain_reference(layers, x)
    ctx, sync = context(native_hooks, monkeypatch, host_budget_bytes=budget)
    arena = ctx.engine.arena
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    assert arena.claimed == 0
    with pytest.raises(RuntimeError, match="boom"):
        h = x.detach().requires_grad_(True)
        for i, layer in enumerate(layers):
            with ctx:
                h = layer(h)
                if i == 2:
                    raise RuntimeError("boom")
            h = sync(h)
    del h  # the failed forward's graph, and the groups it holds
    assert arena.claimed == 0
    first = ctx.stats["offloaded_tensors"]
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    assert arena.claimed == 0 and ctx.stats["offloaded_tensors"] == first
    if budget is not None:  # part of each step refused, part offloaded
        assert ctx.stats["kept"].get("budget", 0) > 0 and first > 0


@needs_entries
def test_native_hooks_follow_a_group_attribute_redefined_after_use(monkeypatch: pytest.MonkeyPatch) -> None:
    # The native hooks read and write Group's slots at their offsets, cached per type; a class
    # changed after the cache was filled (here a slot wrapped in a property, as a debugging
    # wrapper would) must be seen through, not bypassed.
    from offload.engine.group import Group

    layers = make_mlp_layers()
    x = torch.randn(8, 64)
    expected = plain_reference(layers, x)
    ctx, sync = context(True, monkeypatch, group_bytes=None)  # one shared group
    assert_bitwise(expected, train_step(layers, x, ctx, sync))  # fills the cache
    slot = Group.__dict__["unpacks"]
    writes = []

    def put(group: Any, value: int) -> None:
        writes.append(value)
        slot.__set__(group, value)

    monkeypatch.setattr(Group, "unpacks", property(lambda group: slot.__get__(group, Group), put))
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    offloaded = ctx.stats["offloaded_tensors"]
    assert offloaded >= 4 and writes == [0, *range(1, offloaded + 1)], (writes, offloaded)  # 0: __init__


@needs_entries
def test_native_handles_are_not_tracked_by_the_garbage_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only autograd (C++) holds a handle, so the collector treats it as a root either way; left
    # tracked, every young collection of a step would traverse thousands of them.
    ctx, sync = context(True, monkeypatch)
    pack = ctx.engine._hooks.pack_hook
    weight = torch.nn.Parameter(torch.randn(64, 64))
    with ctx:
        offloaded = pack(torch.randn(64, 64))
        kept = pack(weight)
    assert type(offloaded) is tuple and len(offloaded) == 2 and not gc.is_tracked(offloaded)
    assert type(kept) is tuple and len(kept) == 3 and kept[0] is weight and not gc.is_tracked(kept)
    assert gc.is_tracked(offloaded[0])  # what a handle holds stays tracked
