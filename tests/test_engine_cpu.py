"""The engine above the transport, on CPU (``device="cpu"``): gradients, schedule, faults, stats."""

from __future__ import annotations

import gc
import warnings
import weakref
from typing import Optional

import pytest
import torch

import offload
from offload.engine.group import GroupState
from offload.models import GPT

from _util import assert_bitwise, cpu_context, hooks_installed, make_gpt_layers, make_mlp_layers, plain_reference, train_step


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
class Boom(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.armed = True

    def forward(self, x):
        y = x * 2.0
        if self.armed:
            raise RuntimeError("boom")
        return y


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


# -- failed and abandoned steps give everything back, without the cyclic GC -------------------------
class ExpLayer(torch.nn.Module):
    """``exp`` saves its own output, which autograd hands the pack hook with the saving node as its
    grad_fn. Weak references to the saved storages tell what outlives its step."""

    storages: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.exp(x * 0.5)
        ExpLayer.storages.append(weakref.ref(y.untyped_storage()))
        return y


@pytest.fixture
def no_gc():
    """Reference counting only: what is still alive is really held, not waiting for a GC pass."""
    gc.collect()
    gc.disable()
    ExpLayer.storages = []
    yield
    gc.enable()


def alive_storages() -> int:
    return sum(r() is not None for r in ExpLayer.storages)


KEEP_OPTIONS = {
    "offloaded": {},
    "kept_small": {"min_offload_bytes": 1 << 30},   # every tensor kept by the policy
    "kept_budget": {"host_budget_bytes": 0},         # every tensor kept for the host budget
}


@pytest.mark.parametrize("how", sorted(KEEP_OPTIONS))
@pytest.mark.parametrize("api", ["context", "offload_activations"])
def test_failed_steps_leave_no_activation_or_host_block_behind(no_gc, how: str, api: str) -> None:
    stack = torch.nn.ModuleList([ExpLayer(), ExpLayer(), ExpLayer(), Boom()])
    if api == "context":
        ctx, sync = cpu_context(3, 4, **KEEP_OPTIONS[how])
        engine = ctx.engine
    else:
        oa = offload.OffloadActivations(stack, device="cpu", **{"min_offload_bytes": 0, **KEEP_OPTIONS[how]})
        engine = oa.engine
    for _ in range(3):
        x = torch.randn(64, 64, requires_grad=True)
        try:
            if api == "context":
                offload.models.run_layers(stack, x, ctx, sync)
            else:
                with oa:
                    offload.models.run_layers(stack, x)
        except RuntimeError as exc:
            assert "boom" in str(exc)
    assert len(ExpLayer.storages) == 9
    assert alive_storages() == 0, f"{alive_storages()} of 9 saved activations outlived their failed step"
    assert engine.arena.counters.bytes_in_use == 0, "host regions of failed steps were not given back"


@pytest.mark.parametrize("how", sorted(KEEP_OPTIONS))
def test_step_without_backward_is_freed_when_the_next_step_starts(no_gc, how: str) -> None:
    # A skipped backward (NaN loss): the step's graph is dropped; the engine's hold on the step's
    # groups ends with the next step, and nothing else may keep them.
    layers = torch.nn.ModuleList(ExpLayer() for _ in range(4))
    ctx, sync = cpu_context(3, 4, **KEEP_OPTIONS[how])
    x = torch.randn(64, 64)
    train_step(layers, x, ctx, sync)
    loss = offload.models.run_layers(layers, x.requires_grad_(True) * 1.0, ctx, sync).sum()
    del loss
    skipped = list(ExpLayer.storages[4:])
    train_step(layers, x, ctx, sync)
    assert sum(r() is not None for r in skipped) == 0, "the skipped step's activations are still alive"
    stats = ctx.stats
    assert stats["pinned_allocations"] == 0
    if how == "offloaded":
        assert stats["groups_offloaded"] == 3 and "budget" not in stats["kept"]


def test_host_block_of_a_step_without_backward_is_reused(no_gc) -> None:
    # The budget holds one 64 KiB block: each step offloads one group into it. A step without
    # backward must give it back, or offloading stops for good.
    layers = torch.nn.ModuleList(ExpLayer() for _ in range(4))
    ctx, sync = cpu_context(3, 4, host_budget_bytes=64 * 1024)
    x = torch.randn(64, 64)
    offloaded = []
    for skip_backward in (False, True, False, False, True, False):
        if skip_backward:
            loss = offload.models.run_layers(layers, x.requires_grad_(True) * 1.0, ctx, sync).sum()
            del loss
        else:
            train_step(layers, x, ctx, sync)
            offloaded.append(ctx.stats["groups_offloaded"])
    assert offloaded == [1, 1, 1, 1]
    assert ctx.engine.arena.counters.pinned_allocations == 1


def test_manual_step_neither_released_nor_run_backward_is_freed(no_gc) -> None:
    layers = torch.nn.ModuleList(ExpLayer() for _ in range(3))
    ctx, sync, control = cpu_context(2, 3, manual_synchronization=True)
    for _ in range(3):
        h = torch.randn(64, 64, requires_grad=True)
        for i, layer in enumerate(layers):
            with ctx:
                h = layer(h)
            if i < 2:
                control.start_offload_layer(i)  # copied, never released
        del h
    # The step holds its groups weakly: with its graph dropped, even the last step's are gone.
    assert alive_storages() == 0
    train_step(layers, torch.randn(64, 64), ctx, sync)
    assert sum(r() is not None for r in ExpLayer.storages[:9]) == 0


# -- in-place changes to saved tensors -------------------------------------------------------------
class ChangeSaved(torch.nn.Module):
    """``exp`` saves its output; ``own`` changes it in place right after, ``input`` changes this
    layer's input (the previous layer's saved output) in place."""

    def __init__(self, change: Optional[str] = None) -> None:
        super().__init__()
        self.change = change
        self.last: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.change == "input":
            x.mul_(2.0)
        y = torch.exp(x * 0.5)
        if self.change == "own":
            y.mul_(2.0)
        self.last = y
        return y


INPLACE_CASES = {
    # name: (layer that changes, change, options); what is changed is layer 0's saved output
    "before_d2h": (0, "own", {}),
    "after_d2h_before_release": (1, "input", {}),
    "kept_small": (0, "own", {"min_offload_bytes": 1 << 30}),
    "kept_budget": (0, "own", {"host_budget_bytes": 0}),
}


@pytest.mark.parametrize("case", sorted(INPLACE_CASES))
def test_in_place_change_of_a_saved_tensor_raises_like_autograd(case: str) -> None:
    at, change, options = INPLACE_CASES[case]
    layers = torch.nn.ModuleList(ChangeSaved(change if i == at else None) for i in range(4))
    x = torch.randn(32, 16)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        train_step(layers, x)  # autograd's own check, without offload
    ctx, sync = cpu_context(3, 4, **options)
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: a tensor of shape \[32, 16\] and dtype torch.float32 saved for backward in offloaded layer 0 is at version 1; expected version 0"):
        train_step(layers, x, ctx, sync)


@pytest.mark.parametrize("when", ["released", "held"])
def test_in_place_change_after_forward_raises_like_autograd(when: str) -> None:
    # After the forward, through the caller's own reference: after release the group only has a
    # weak reference to it; a group that was never released still holds the original.
    layers = torch.nn.ModuleList(ChangeSaved() for _ in range(3))
    if when == "released":
        ctx, sync = cpu_context(2, 3)
    else:
        ctx, sync, control = cpu_context(2, 3, manual_synchronization=True)
    h = torch.randn(32, 16, requires_grad=True)
    for i, layer in enumerate(layers):
        with ctx:
            h = layer(h)
        h = sync(h)
    assert ctx.engine.step.groups[0].state is (GroupState.OFFLOADED if when == "released" else GroupState.RESIDENT)
    with torch.no_grad():
        layers[0].last.add_(1.0)
    with pytest.raises(RuntimeError, match=r"shape \[32, 16\] .* offloaded layer 0 is at version 1; expected version 0"):
        h.sum().backward()


def test_in_place_change_of_a_kept_parameter_raises_like_autograd() -> None:
    # An optimizer step between forward and backward: parameters are kept, and checked too.
    layers = make_mlp_layers(3)
    ctx, sync = cpu_context(2, 3)
    h = offload.models.run_layers(layers, torch.randn(8, 64, requires_grad=True), ctx, sync)
    with torch.no_grad():
        layers[0].fc.weight.mul_(1.0)
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: a tensor of shape \[64, 64\]"):
        h.sum().backward()


def test_unchanged_saved_tensors_pass_the_version_check() -> None:
    # A change made before the save does not count, exactly as in autograd.
    x = torch.randn(32, 16)

    class Bump(torch.nn.Module):
        def forward(self, t):
            t = t * 1.0
            t.add_(1.0)  # before anything saves it
            return torch.exp(t)

    stack = torch.nn.ModuleList([Bump(), ChangeSaved(), ChangeSaved(), ChangeSaved()])
    expected = train_step(stack, x)
    ctx, sync = cpu_context(3, 4)
    assert_bitwise(expected, train_step(stack, x, ctx, sync))


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


# -- argument validation ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_layers=4, model_layers=4), "at most model_layers - 1"),
        (dict(num_layers=-1, model_layers=4), "num_layers must be an integer >= 0"),
        (dict(num_layers=1, model_layers=0), "model_layers must be an integer >= 1"),
        (dict(num_layers=1, model_layers=4, offload_activations=False), "nothing to offload"),
        (dict(num_layers=1, model_layers=4, mode="v3"), "mode must be one of 'v1', 'v2' or None .*got 'v3'"),
        (dict(num_layers=1, model_layers=4, device="xla"), "CUDA device or 'cpu'"),
        (dict(num_layers=1, model_layers=4, selection="all"), "selection must be one of 'auto', 'marked'"),
        (dict(num_layers=1, model_layers=4, min_offload_bytes=-5), "min_offload_bytes must be an integer number of bytes >= 0, got -5"),
        (dict(num_layers=1, model_layers=4, host_budget_bytes=-1), "host_budget_bytes must be None or an integer number of bytes >= 0"),
    ],
)
def test_bad_arguments_are_refused_clearly(kwargs, message) -> None:
    kwargs.setdefault("device", "cpu")
    with pytest.raises(ValueError, match=message):
        offload.get_cpu_offload_context(True, **kwargs)


WRONG_TYPES = [
    (dict(min_offload_bytes=None), r"min_offload_bytes must be an integer number of bytes >= 0, got None \(NoneType\)"),
    (dict(min_offload_bytes="64k"), r"min_offload_bytes must be an integer number of bytes >= 0, got '64k' \(str\)"),
    (dict(min_offload_bytes=1.5), r"min_offload_bytes .* got 1.5 \(float\)"),
    (dict(host_budget_bytes="1GB"), r"host_budget_bytes must be None or an integer"),
    (dict(num_layers=True), r"num_layers must be an integer >= 0, got True \(bool\)"),
    (dict(model_layers="4"), r"model_layers must be an integer >= 1, got '4' \(str\)"),
    (dict(double_buffering="yes"), r"double_buffering must be True or False, got 'yes' \(str\)"),
    (dict(retain_pinned_cpu_buffers=1), r"retain_pinned_cpu_buffers must be True or False, got 1 \(int\)"),
    (dict(manual_synchronization=None), r"manual_synchronization must be True or False"),
    (dict(offload_activations="no"), r"offload_activations must be True or False"),
    (dict(offload_weights=0), r"offload_weights must be True or False"),
    (dict(mode=1), r"mode must be one of 'v1', 'v2' or None .* got 1 \(int\)"),
    (dict(selection=["auto"]), r"selection must be one of 'auto', 'marked'"),
    (dict(offload_stream="side"), r"offload_stream must be a torch.cuda.Stream or None"),
    (dict(device=["cpu"]), r"device must be None, a torch.device, a string or an index"),
    (dict(params_from=[torch.randn(3)]), r"params_from must be an nn.Module or an iterable of nn.Module"),
]


@pytest.mark.parametrize("kwargs, message", WRONG_TYPES)
def test_wrong_option_types_name_the_public_call(kwargs, message) -> None:
    options = {"num_layers": 1, "model_layers": 4, "device": "cpu", **kwargs}
    with pytest.raises(TypeError, match=r"^offload: get_cpu_offload_context: " + message):
        offload.get_cpu_offload_context(True, **options)
    if "num_layers" in kwargs or "model_layers" in kwargs:
        return  # OffloadActivations derives them from its layers
    del options["num_layers"], options["model_layers"]
    with pytest.raises(TypeError, match=r"^offload: OffloadActivations: " + message):
        offload.OffloadActivations(make_mlp_layers(4), **options)


def test_enabled_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match=r"get_cpu_offload_context: enabled must be True or False, got 'yes'"):
        offload.get_cpu_offload_context("yes")


def test_unknown_keywords_list_the_accepted_ones() -> None:
    with pytest.raises(TypeError, match=r"^offload: get_cpu_offload_context\(\) got unexpected keyword argument 'num_layer' \(did you mean 'num_layers'\?\); it accepts: enabled, num_layers, model_layers, .*min_offload_bytes"):
        offload.get_cpu_offload_context(True, num_layer=1, model_layers=2, device="cpu")
    # Even when disabled: a misspelt option would otherwise go unnoticed until it is enabled.
    with pytest.raises(TypeError, match=r"get_cpu_offload_context\(\) got unexpected keyword argument 'min_offload_byte' \(did you mean 'min_offload_bytes'\?\)"):
        offload.get_cpu_offload_context(False, min_offload_byte=0)
    with pytest.raises(TypeError, match=r"^offload: OffloadActivations\(\) got unexpected keyword arguments 'prefetch', 'num_offload_layer' \(did you mean 'num_offload_layers'\?\); it accepts: layers, num_offload_layers, enabled, plan, memory_budget_bytes, measure_peak, .*num_layers"):
        offload.OffloadActivations(make_mlp_layers(3), device="cpu", prefetch=2, num_offload_layer=1)


def test_offload_weights_warns() -> None:
    with pytest.warns(UserWarning, match="weights are not offloaded"):
        offload.get_cpu_offload_context(True, num_layers=1, model_layers=2, offload_weights=True, device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_device_without_cuda_is_refused() -> None:
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        offload.get_cpu_offload_context(True, num_layers=1, model_layers=2, device="cuda")
    # device=None is the CPU there (tests/test_entry_points_cpu.py); only an explicit CUDA device is refused.


def test_sync_function_needs_a_tensor() -> None:
    ctx, sync = cpu_context(1, 2)
    with pytest.raises(ValueError, match="sync_function got list; pass the layer's output tensor"):
        sync([torch.randn(3)])
    with torch.no_grad():
        t = torch.randn(3)
        assert sync(t) is t


def test_sync_function_passes_a_frozen_layer_output_through() -> None:
    # A frozen first layer: its output does not require grad; TransformerEngine returns it as is.
    layers = make_mlp_layers(4)
    layers[0].requires_grad_(False)
    x = torch.randn(8, 64)

    def step(ctx=None, sync=None) -> list[torch.Tensor]:
        for p in layers.parameters():
            p.grad = None
        h = x
        for layer in layers:
            if ctx is None:
                h = layer(h)
                continue
            with ctx:
                h = layer(h)
            if not h.requires_grad:
                assert sync(h) is h and not h._backward_hooks
            h = sync(h)
        (h ** 2).mean().backward()
        return [p.grad for p in layers.parameters() if p.requires_grad]

    expected = step()
    assert_bitwise(expected, step())
    ctx, sync = cpu_context(3, 4)
    assert_bitwise(expected, step(ctx, sync))


def test_offload_activations_arguments() -> None:
    with pytest.raises(ValueError, match="non-empty list"):
        offload.OffloadActivations([], device="cpu")
    layers = make_mlp_layers(3)
    oa = offload.OffloadActivations(layers, device="cpu")
    assert oa.engine.schedule.num_layers == 2
    with pytest.raises(ValueError, match="num_offload_layers=3 is more than 2: of the 3 layers given"):
        offload.OffloadActivations(layers, num_offload_layers=3, device="cpu")
