"""The engine above the transport, on CPU (``device="cpu"``): gradients, schedule, faults, stats."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import offload
from offload.models import GPT

from _util import Boom, assert_bitwise, cpu_context, hooks_installed, make_gpt_layers, make_mlp_layers, plain_reference, train_step


@pytest.fixture
def gpt() -> tuple[torch.nn.ModuleList, torch.Tensor]:
    layers = make_gpt_layers(n=4)
    x = torch.randn(2, 16, 64)
    return layers, x


# -- exactness ------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_layers", [1, 2, 3])
def test_gpt_gradients_bitwise_v2(gpt, num_layers: int) -> None:
    layers, x = gpt
    expected = plain_reference(layers, x)
    ctx, sync = cpu_context(num_layers, 4)
    for _ in range(3):  # later steps reuse the arena
        assert_bitwise(expected, train_step(layers, x, ctx, sync))
    stats = ctx.stats
    assert stats["offloaded_tensors"] > 0
    assert stats["groups_offloaded"] == num_layers
    # H2D moves whole regions (slots plus alignment padding), D2H only the slot spans.
    assert 0 < stats["bytes_d2h"] == stats["offloaded_bytes"] <= stats["bytes_h2d"]


def test_mlp_gradients_bitwise() -> None:
    layers = make_mlp_layers(n=5)
    x = torch.randn(8, 64)
    expected = plain_reference(layers, x)
    ctx, sync = cpu_context(4, 5)
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    assert ctx.stats["offloaded_tensors"] >= 4


def test_full_gpt_with_offload_activations() -> None:
    torch.manual_seed(0)
    model = GPT(vocab=50, hidden=32, heads=2, layers=3, max_seq=16)
    idx = torch.randint(0, 50, (2, 16))

    def step(wrapper) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        if wrapper is None:
            loss = model(idx).float().logsumexp(-1).mean()
        else:
            with wrapper:
                loss = model(idx).float().logsumexp(-1).mean()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    expected = step(None)
    oa = offload.OffloadActivations(model.layers, device="cpu", min_offload_bytes=0, group_bytes=0)
    for _ in range(2):
        assert_bitwise(expected, step(oa))
    assert oa.stats["groups_offloaded"] == 2  # all but the last layer
    # Outside the `with` the hooks (registered once, not per step) do nothing ...
    step_before = oa.engine.step
    assert_bitwise(expected, step(None))
    assert oa.engine.step is step_before and not hooks_installed()
    # ... and close() removes them.
    oa.close()
    assert not model.layers[0]._forward_pre_hooks and not model.layers[0]._forward_hooks


class LazyBitLayer(torch.nn.Module):
    """Saves a lazy conjugate or negative view of its activation next to the activation itself."""

    def __init__(self, width: int, kind: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.kind = kind
        self.fc = torch.nn.Linear(width, width, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        other = {"conj": h.conj, "neg": lambda: torch._neg_view(h), "conj_neg": lambda: torch._neg_view(h.conj())}[self.kind]()
        return torch.tanh(h * other)


@pytest.mark.parametrize("kind, dtype", [("conj", torch.complex64), ("neg", torch.complex64), ("conj_neg", torch.complex64), ("neg", torch.float32)])
def test_lazy_conjugate_and_negative_views_bitwise(kind: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(LazyBitLayer(16, kind, dtype) for _ in range(3))
    x = torch.randn(8, 16, dtype=dtype)

    def step(ctx=None, sync=None) -> list[torch.Tensor]:
        for p in layers.parameters():
            p.grad = None
        xin = x.detach().requires_grad_(True)
        (offload.models.run_layers(layers, xin, ctx, sync).abs() ** 2).mean().backward()
        return [p.grad.clone() for p in layers.parameters()] + [xin.grad.clone()]

    expected = step()
    assert_bitwise(expected, step())
    ctx, sync = cpu_context(2, 3)
    assert_bitwise(expected, step(ctx, sync))
    assert ctx.stats["offloaded_tensors"] >= 2 * 2 and ctx.stats["released_bytes"] > 0


class NestedLayer(torch.nn.Module):
    """Runs its Linear on a nested tensor of two sequences (both nested layouts save one)."""

    def __init__(self, layout: torch.layout) -> None:
        super().__init__()
        self.layout = layout
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nt = torch.nested.as_nested_tensor([x[:3], x[3:]], layout=self.layout)
        y = torch.nn.functional.gelu(self.fc(nt))
        return torch.cat((y * y).unbind(), 0)


@pytest.mark.filterwarnings("ignore:.*nested tensors.*:UserWarning")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_nested_tensors_stay_on_the_gpu_and_gradients_stay_exact(layout: torch.layout) -> None:
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(NestedLayer(layout) for _ in range(3))
    x = torch.randn(7, 16)
    expected = plain_reference(layers, x)
    ctx, sync = cpu_context(2, 3)
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    assert ctx.stats["kept"]["unsupported"] > 0


def record_offloaded_storages(monkeypatch) -> list[int]:
    """Storage addresses of every tensor a group takes in, from now on (groups then use the
    Python entry table, whose ``add`` is recorded; what is offloaded is the policy's call)."""
    from offload.engine import group
    from offload.engine.entry_table import EntryTable

    seen: list[int] = []
    add = EntryTable.add

    def recording_add(self, t):
        seen.append(t.untyped_storage().data_ptr())
        return add(self, t)

    monkeypatch.setattr(EntryTable, "add", recording_add)
    monkeypatch.setattr(group, "new_entry_table", EntryTable)
    return seen


def module_storages(modules) -> set[int]:
    return {t.untyped_storage().data_ptr() for m in modules for t in [*m.parameters(), *m.buffers()]}


class LoRALinear(torch.nn.Module):
    """A frozen base weight (as in every LoRA/PEFT fine-tune) plus a trainable low-rank update."""

    def __init__(self, width: int, rank: int = 4) -> None:
        super().__init__()
        self.base = torch.nn.Linear(width, width, bias=False)
        self.base.requires_grad_(False)
        self.a = torch.nn.Parameter(torch.randn(width, rank) * 0.1)
        self.b = torch.nn.Parameter(torch.randn(rank, width) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.base(x) + (x @ self.a) @ self.b)


def test_frozen_weights_are_not_copied(monkeypatch) -> None:
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(LoRALinear(256) for _ in range(4))
    x = torch.randn(8, 256)
    expected = plain_reference(layers, x)
    seen = record_offloaded_storages(monkeypatch)
    ctx, sync = cpu_context(3, 4)
    for _ in range(2):
        assert_bitwise(expected, train_step(layers, x, ctx, sync))
    assert seen and not set(seen) & module_storages(layers), "a parameter's memory was offloaded"
    stats = ctx.stats
    weight_bytes = 256 * 256 * 4
    assert 0 < stats["offloaded_bytes"] < weight_bytes  # the activations only, no 256 KiB weight
    assert stats["kept"]["parameter"] >= 3 * 3  # base weight view, a, b in each offloaded layer


class BufferScaled(torch.nn.Module):
    """Uses views of a registered buffer (rotary tables, masks...) and of its weight's ``.data``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.register_buffer("table", torch.randn(4, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x) * self.table[1][None, :]
        return torch.tanh(h * self.fc.weight.data[0][None, :])


@pytest.mark.parametrize("api", ["context", "context_params_from", "offload_activations"])
def test_views_of_module_buffers_are_not_copied(monkeypatch, api: str) -> None:
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(BufferScaled(64) for _ in range(4))
    x = torch.randn(8, 64)
    expected = plain_reference(layers, x)
    seen = record_offloaded_storages(monkeypatch)
    if api == "offload_activations":
        oa = offload.OffloadActivations(layers, device="cpu", min_offload_bytes=0)
        for p in layers.parameters():
            p.grad = None
        xin = x.detach().requires_grad_(True)
        with oa:
            out = offload.models.run_layers(layers, xin)
        (out.float() ** 2).mean().backward()
        got = [p.grad for p in layers.parameters()] + [xin.grad]
    else:
        ctx, sync = cpu_context(3, 4, **({"params_from": layers} if api == "context_params_from" else {}))
        got = train_step(layers, x, ctx, sync)
    assert_bitwise(expected, got)
    shared = set(seen) & module_storages(layers)
    if api == "context":
        assert shared  # without params_from the engine cannot know: the buffer views are copied
    else:
        assert seen and not shared, "a buffer's or weight's memory was offloaded"


def test_native_and_python_copy_paths_agree(gpt, monkeypatch) -> None:
    layers, x = gpt
    expected = train_step(layers, x)
    results = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("OFFLOAD_NATIVE", setting)
        offload.host.native.reload_native_setting()
        ctx, sync = cpu_context(3, 4)
        results[setting] = (train_step(layers, x, ctx, sync), ctx.stats["native"])
    monkeypatch.delenv("OFFLOAD_NATIVE")
    offload.host.native.reload_native_setting()
    assert results["0"][1] is False
    assert_bitwise(expected, results["0"][0])
    assert_bitwise(results["0"][0], results["1"][0])


def test_retain_graph_twice_gives_same_gradients(gpt) -> None:
    layers, x = gpt
    ctx, sync = cpu_context(3, 4)
    for p in layers.parameters():
        p.grad = None
    xin = x.clone().requires_grad_(True)
    out = offload.models.run_layers(layers, xin, ctx, sync)
    loss = (out ** 2).mean()
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in layers.parameters()]
    for p in layers.parameters():
        p.grad = None
    loss.backward()
    second = [p.grad.clone() for p in layers.parameters()]
    assert_bitwise(first, second)
    assert_bitwise(train_step(layers, x)[:-1], first)


# -- memory is really released ----------------------------------------------------------------------
class SaveBig(torch.autograd.Function):
    """Saves a fresh intermediate for backward; the test holds only a weak reference to it."""

    refs: list = []

    @staticmethod
    def forward(ctx, x):
        inter = x * 3.0
        SaveBig.refs.append(weakref.ref(inter))
        ctx.save_for_backward(inter)
        return x + 1.0

    @staticmethod
    def backward(ctx, g):
        (inter,) = ctx.saved_tensors
        return g * inter


class SaveBigLayer(torch.nn.Module):
    def forward(self, x):
        return SaveBig.apply(x)


def test_originals_are_released_and_restored() -> None:
    SaveBig.refs = []
    layers = torch.nn.ModuleList(SaveBigLayer() for _ in range(3))
    ctx, sync = cpu_context(2, 3)
    x = torch.randn(1024, requires_grad=True)
    out = offload.models.run_layers(layers, x, ctx, sync)
    gc.collect()
    alive = [r() is not None for r in SaveBig.refs]
    assert alive == [False, False, True]  # offloaded layers freed their originals; the last did not
    out.sum().backward()
    x_plain = x.detach().clone().requires_grad_(True)
    offload.models.run_layers(layers, x_plain).sum().backward()
    assert torch.equal(x.grad, x_plain.grad)


# -- faults -----------------------------------------------------------------------------------------
def test_exception_inside_context_leaves_nothing_behind(gpt) -> None:
    layers, x = gpt
    expected = train_step(layers, x)
    ctx, sync = cpu_context(3, 4)
    boom = Boom()
    with pytest.raises(RuntimeError, match="boom"):
        with ctx:
            boom(x.requires_grad_(True))
    assert not hooks_installed()
    assert ctx.engine.step is None and ctx.engine.forward.open_group is None and not ctx.engine.forward.in_layer
    assert_bitwise(expected, train_step(layers, x, ctx, sync))


def test_exception_inside_offload_activations_removes_hooks(gpt) -> None:
    layers, x = gpt
    expected = train_step(layers, x)
    boom = Boom()
    stack = torch.nn.ModuleList([layers[0], boom, layers[2], layers[3]])
    oa = offload.OffloadActivations(stack, device="cpu", min_offload_bytes=0)
    with pytest.raises(RuntimeError, match="boom"):
        with oa:
            offload.models.run_layers(stack, x.requires_grad_(True))
    assert not hooks_installed()
    assert oa.engine.step is None and not oa.active  # the aborted step is forgotten
    oa.close()
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in stack)
    oa2 = offload.OffloadActivations(layers, device="cpu", min_offload_bytes=0)
    for p in layers.parameters():
        p.grad = None
    xin = x.detach().requires_grad_(True)
    with oa2:
        out = offload.models.run_layers(layers, xin)
    (out.float() ** 2).mean().backward()
    assert_bitwise(expected, [p.grad for p in layers.parameters()] + [xin.grad])


class HookProbe(torch.nn.Module):
    """Records, for each call, whether saved-tensor hooks were installed while the layer ran."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(hooks_installed())
        return self.layer(x)


def test_eval_forward_between_steps_installs_nothing_and_keeps_the_arena(gpt) -> None:
    # Under no_grad nothing is saved: the engine installs no hooks, opens no groups, and the
    # arena's idle blocks wait for the next training step instead of being freed (on a GPU,
    # freeing them means pinning them again).
    layers, x = gpt
    probes = torch.nn.ModuleList(HookProbe(m) for m in layers)
    ctx, sync = cpu_context(3, 4)
    train_step(probes, x, ctx, sync)
    assert [p.seen for p in probes] == [[True], [True], [True], [False]]  # the probe sees hooks
    arena = ctx.engine.arena.counters
    blocks, held = arena.pinned_allocations, arena.bytes_held
    assert blocks == 3
    for _ in range(5):
        for p in probes:
            p.seen.clear()
        step_before = ctx.engine.step
        with torch.no_grad():
            offload.models.run_layers(probes, x, ctx, sync)
        assert [p.seen for p in probes] == [[False]] * 4
        # The eval pass is no step at all: the layers were passive (see test_layers_cpu.py).
        assert ctx.engine.step is step_before and ctx.engine.forward.open_group is None
        assert arena.bytes_held == held
        train_step(probes, x, ctx, sync)
        assert ctx.stats["pinned_allocations"] == 0 and ctx.stats["groups_offloaded"] == 3
    assert (arena.pinned_allocations, arena.bytes_held) == (blocks, held)
    assert not hooks_installed()


def test_arena_trims_only_after_a_step_that_asked_for_regions() -> None:
    from offload.host.arena import HostArena

    arena = HostArena(pinned=False, budget_bytes=1 << 30, retain=False)
    regions = [arena.acquire(n, step=1) for n in (100_000, 300_000)]
    for region in regions:
        arena.release(region, None)
    arena.end_step(1)
    arena.end_step(2)  # asked for nothing: says nothing about the blocks needed
    assert arena.counters.bytes_held == 64 * 1024 * 2 + 320 * 1024
    arena.release(arena.acquire(100_000, step=3), None)
    arena.end_step(3)  # used one block: the other is trimmed
    assert arena.counters.bytes_held == 128 * 1024 and arena.counters.freed_blocks == 1


def test_exhausted_budget_keeps_tensors_and_loses_nothing(gpt) -> None:
    layers, x = gpt
    expected = train_step(layers, x)
    ctx, sync = cpu_context(3, 4, host_budget_bytes=200_000)
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    stats = ctx.stats
    assert stats["kept"].get("budget", 0) > 0
    assert stats["offloaded_tensors"] > 0
    assert stats["pinned_bytes_held"] <= 200_000
    ctx0, sync0 = cpu_context(3, 4, host_budget_bytes=0)
    assert_bitwise(expected, train_step(layers, x, ctx0, sync0))
    assert ctx0.stats["offloaded_tensors"] == 0 and ctx0.stats["kept"]["budget"] > 0


# -- stats and arena reuse --------------------------------------------------------------------------
def test_stats_and_arena_reuse(gpt) -> None:
    layers, x = gpt
    ctx, sync = cpu_context(3, 4)
    train_step(layers, x, ctx, sync)
    first = ctx.stats
    assert first["finished"] and first["pinned_allocations"] == 3
    for _ in range(3):
        train_step(layers, x, ctx, sync)
        s = ctx.stats
        assert s["pinned_allocations"] == 0
        assert s["pinned_bytes_held"] == first["pinned_bytes_held"]
    assert s["mode"] == "v2" and s["transport"] == "cpu"
    assert s["kept"].get("parameter", 0) > 0
    assert s["offloaded_bytes"] == s["bytes_d2h"]
    text = ctx.report()
    for label in ("tensors offloaded", "bytes offloaded", "tensors kept", "host copy out", "host copy back", "compute waited", "host arena held"):
        assert label in text


class SavePointer(torch.autograd.Function):
    """Saves an intermediate and records in backward whether it came back in its own storage
    (a weak reference: an address could be reused by a reload buffer)."""

    seen: list = []

    @staticmethod
    def forward(ctx, x):
        inter = x * 3.0
        ctx.storage = weakref.ref(inter.untyped_storage())
        ctx.save_for_backward(inter)
        return x + 1.0

    @staticmethod
    def backward(ctx, g):
        (inter,) = ctx.saved_tensors
        SavePointer.seen.append(inter.untyped_storage() is ctx.storage())
        return g * inter


class SavePointerLayer(torch.nn.Module):
    def forward(self, x):
        return SavePointer.apply(x)


@pytest.mark.parametrize("enabled", [False, True])
def test_disabled_context_installs_nothing_and_moves_nothing(enabled: bool) -> None:
    # The enabled run shows that the probes see hooks and moved tensors when there are some.
    layers = torch.nn.ModuleList(HookProbe(SavePointerLayer()) for _ in range(3))
    SavePointer.seen = []
    if enabled:
        ctx, sync, control = cpu_context(2, 3, manual_synchronization=True)
    else:
        ctx, sync, control = offload.get_cpu_offload_context(False, num_layers=2, model_layers=3, manual_synchronization=True)
        assert isinstance(control, offload.api.DisabledController)  # its calls do nothing
    x = torch.randn(4096, requires_grad=True)
    h = x
    for i, layer in enumerate(layers):
        with ctx:
            h = layer(h)
        h2 = sync(h)
        assert h2 is h
        if enabled and i < 2:
            control.start_offload_layer(i)
            control.release_activation_forward_gpu_memory(i)
    h.sum().backward()
    # Manual synchronization collects every layer's tensors (TransformerEngine's manual mode does
    # not use num_layers either); the user moved layers 0 and 1 only.
    assert [p.seen for p in layers] == ([[True]] * 3 if enabled else [[False]] * 3)
    # Backward runs the last layer first.
    assert SavePointer.seen == ([True, False, False] if enabled else [True, True, True])
    assert not hooks_installed()
