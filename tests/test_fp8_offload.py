"""FP8 through the engine: quantized storages' components offloaded into the group region and
restored as typed, aligned views; FP8 Linear stacks bitwise equal with and without offload."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import offload
from offload import fp8
from offload import quantized as q
from offload.models import MLPBlock, run_layers

from _util import assert_bitwise, train_step

CUDA_FP8 = torch.cuda.is_available() and fp8.scaled_mm_supported("cuda")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not CUDA_FP8, reason="needs an FP8 GPU")])]
QUANTIZERS = {
    "tensorwise": lambda x, bulk: q.quantize_tensorwise(x, rowwise=False, columnwise=True, bulk=bulk),
    "blockwise": lambda x, bulk: q.quantize_blockwise(x, rowwise=False, columnwise=True, bulk=bulk),
    "block128": lambda x, bulk: q.quantize_blockwise(x, block=(128, 128), rowwise=False, columnwise=True, bulk=bulk),
    "mxfp8": lambda x, bulk: q.quantize_mxfp8(x, rowwise=False, columnwise=True, bulk=bulk),
}


def context(device: str, num_layers: int, model_layers: int, **kw: Any):
    if device == "cpu":
        kw.setdefault("min_offload_bytes", 0)
    kw.setdefault("group_bytes", 0)  # each layer's storages in a group of its own, checked per layer
    return offload.get_cpu_offload_context(True, num_layers=num_layers, model_layers=model_layers, device=device, **kw)


class SaveStorage(torch.autograd.Function):
    """Quantizes its input, saves the storage through the protocol, and in backward records what
    came back (each component, and the storage's dequantized value)."""

    records: list = []

    @staticmethod
    def forward(ctx, x, kind: str, bulk: bool, keep: bool):
        storage = QUANTIZERS[kind](x.detach(), bulk)
        if keep:
            offload.mark_not_offload(storage)
        else:
            offload.mark_activation_offload(storage)
        ctx.originals = [
            (n, t.clone(), t.data_ptr(), t.dtype, t.shape, t.stride(), t.data_ptr() - t.untyped_storage().data_ptr())
            for n, t in storage.named_components()
        ]
        ctx.reference = storage.dequantize(torch.float32).clone()
        tensors, ctx.restorable = storage.prepare_for_saving()
        ctx.save_for_backward(*tensors)
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        storage = ctx.restorable
        storage.restore_from_saved(list(ctx.saved_tensors))
        SaveStorage.records.append((ctx.originals, storage.named_components(), ctx.reference, storage.dequantize(torch.float32)))
        return g * 2.0, None, None, None


class StorageLayer(torch.nn.Module):
    def __init__(self, kind: str, bulk: bool = False, keep: bool = False) -> None:
        super().__init__()
        self.kind, self.bulk, self.keep = kind, bulk, keep

    def forward(self, x):
        return SaveStorage.apply(x, self.kind, self.bulk, self.keep)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", sorted(QUANTIZERS))
@pytest.mark.parametrize("bulk", [False, True])
def test_storage_components_round_trip_as_typed_aligned_views(device: str, kind: str, bulk: bool) -> None:
    SaveStorage.records = []
    layers = torch.nn.ModuleList(StorageLayer(kind, bulk) for _ in range(3))
    ctx, sync = context(device, 2, 3)
    x = torch.randn(128, 256, device=device, requires_grad=True)
    out = run_layers(layers, x, ctx, sync)
    groups = dict(ctx.engine.step.groups)  # the step holds them weakly; backward frees them
    out.sum().backward()
    for layer in (0, 1):
        # Really offloaded: the originals were dropped and the data came back from the host copy.
        assert groups[layer].state.value == "offloaded" and not groups[layer].table.holds_originals
        # Bulk-allocated components live in one uint8 buffer: it is one slot, copied once.
        assert len(groups[layer].slot_sizes()) == (1 if bulk else len(groups[layer].table))
    assert len(SaveStorage.records) == 3
    offloaded = SaveStorage.records[1:]  # layers 1 and 0 were offloaded; layer 2 was not
    for originals, restored, reference, value in offloaded:
        buffers = set()
        for (name, saved, ptr, dtype, shape, stride, offset), (rname, r) in zip(originals, restored):
            assert rname == name
            assert r.dtype == dtype, f"{name}: {r.dtype} != {dtype}"  # float32 stays float32, uint8 stays uint8
            assert r.shape == shape and r.stride() == stride
            assert torch.equal(r.view(torch.uint8) if r.dtype != torch.uint8 else r, saved.view(torch.uint8) if saved.dtype != torch.uint8 else saved)
            # 16-byte aligned for _scaled_mm, and the same offset modulo 256 within its storage.
            assert r.data_ptr() % 16 == 0
            assert (r.data_ptr() - r.untyped_storage().data_ptr()) % 256 == offset % 256
            buffers.add(r.untyped_storage().data_ptr())
        assert len(buffers) == 1  # every component, scales included, is a view of the group's one buffer
        assert torch.equal(value, reference)


@pytest.mark.parametrize("device", DEVICES)
def test_mark_not_offload_keeps_every_storage_component(device: str) -> None:
    SaveStorage.records = []
    layers = torch.nn.ModuleList(StorageLayer("tensorwise", keep=True) for _ in range(2))
    ctx, sync = context(device, 1, 2)
    x = torch.randn(64, 128, device=device, requires_grad=True)
    run_layers(layers, x, ctx, sync).sum().backward()
    originals, restored, _, _ = SaveStorage.records[-1]  # layer 0, the offloaded layer
    assert [o[2] for o in originals] == [t.data_ptr() for _, t in restored]
    assert ctx.stats["kept"]["marked"] == len(originals) and ctx.stats["offloaded_tensors"] == 0


def fp8_mlp(device: str, scaling: str, n: int = 4, hidden: int = 128, seed: int = 0) -> torch.nn.ModuleList:
    torch.manual_seed(seed)
    dtype = torch.bfloat16

    def linear(i, o, **kw):
        return fp8.Linear(i, o, scaling=scaling, **kw)

    return torch.nn.ModuleList(MLPBlock(hidden, linear=linear, device=device, dtype=dtype) for _ in range(n))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("mode", ["v2", "v1"])
def test_fp8_linear_stack_bitwise_with_offload(device: str, scaling: str, mode: str) -> None:
    if scaling == "rowwise" and not fp8.rowwise_supported(device):
        pytest.skip(f"rowwise _scaled_mm unavailable on {device} in torch {torch.__version__}")
    layers = fp8_mlp(device, scaling)
    x = torch.randn(64, 128, device=device, dtype=torch.bfloat16)
    expected = train_step(layers, x)
    assert_bitwise(expected, train_step(layers, x))
    ctx, sync = context(device, 3, 4, mode=mode)  # v1: only the FP8 Linear's opted-in inputs
    for _ in range(2):
        assert_bitwise(expected, train_step(layers, x, ctx, sync))
    stats = ctx.stats
    assert stats["offloaded_tensors"] >= 3 * 2 * 2  # per layer: 2 Linears x (columnwise data + scale)
    if mode == "v1":
        assert stats["kept"].get("not_selected", 0) > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_layers, num_layers", [(8, 4), (12, 4)])
def test_fp8_linear_stack_bitwise_with_v1_double_buffering(device: str, model_layers: int, num_layers: int) -> None:
    # Each group (the opted-in FP8 inputs of one block) has the same size, so every reload goes
    # into one of the two shared buffers: a buffer reused before its last reader ran shows here.
    layers = fp8_mlp(device, "tensorwise", n=model_layers)
    x = torch.randn(64, 128, device=device, dtype=torch.bfloat16)
    expected = train_step(layers, x)
    assert_bitwise(expected, train_step(layers, x))
    ctx, sync = context(device, num_layers, model_layers, mode="v1", double_buffering=True)
    for _ in range(2):
        assert_bitwise(expected, train_step(layers, x, ctx, sync))
    assert ctx.stats["reloads"] == num_layers and all(b is not None for b in ctx.engine.schedule._buffers)


class ToyQuantized(torch.Tensor):
    """A tensor subclass with the storage protocol, like TransformerEngine's Float8Tensor: the
    pack hook receives it whole and must split it into components."""

    @staticmethod
    def wrap(data: torch.Tensor, scale: torch.Tensor) -> "ToyQuantized":
        t = torch.empty(0, device=data.device).as_subclass(ToyQuantized)
        t._data, t._scale = data, scale
        return t

    def prepare_for_saving(self):
        tensors = [self._data, self._scale]
        self._data = self._scale = None
        return tensors, self

    def restore_from_saved(self, tensors):
        self._data, self._scale = tensors[0], tensors[1]
        return tensors[2:]


class SaveSubclass(torch.autograd.Function):
    seen: list = []

    @staticmethod
    def forward(ctx, x):
        data = (x.detach() * 4).to(torch.uint8)
        toy = ToyQuantized.wrap(data, torch.tensor([0.5], device=x.device))
        ctx.expect = (data.clone(), data.data_ptr())
        ctx.save_for_backward(toy)
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        (toy,) = ctx.saved_tensors
        SaveSubclass.seen.append((type(toy), toy._data.dtype, toy._scale.dtype, torch.equal(toy._data, ctx.expect[0])))
        return g


class SubclassLayer(torch.nn.Module):
    def forward(self, x):
        return SaveSubclass.apply(x)


@pytest.mark.parametrize("device", DEVICES)
def test_quantized_tensor_subclass_is_split_and_rebuilt(device: str) -> None:
    SaveSubclass.seen = []
    layers = torch.nn.ModuleList(SubclassLayer() for _ in range(2))
    ctx, sync = context(device, 1, 2, min_offload_bytes=0)
    x = torch.rand(256, 256, device=device, requires_grad=True)
    run_layers(layers, x, ctx, sync).sum().backward()
    assert SaveSubclass.seen[-1] == (ToyQuantized, torch.uint8, torch.float32, True)
    assert ctx.stats["offloaded_tensors"] == 2 and ctx.stats["released_bytes"] > 0


class UseToy(torch.autograd.Function):
    """Multiplies by the dequantized toy (reading its data in forward) and saves the toy."""

    @staticmethod
    def forward(ctx, x, toy):
        ctx.save_for_backward(toy)
        return x * (toy._data.float() * toy._scale)

    @staticmethod
    def backward(ctx, g):
        (toy,) = ctx.saved_tensors
        return g * (toy._data.float() * toy._scale), None


class SharedToyLayer(torch.nn.Module):
    """Every layer uses (and saves) the one toy object the model holds, like a cached FP8 weight."""

    def __init__(self, toy: ToyQuantized) -> None:
        super().__init__()
        self.toy = toy

    def forward(self, x):
        return torch.tanh(UseToy.apply(x, self.toy))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("as_parameter", [False, True])
def test_saving_a_storage_subclass_leaves_the_callers_object_whole(device: str, as_parameter: bool) -> None:
    # The caller's object is used again by the next layers and saved again: packing it must not
    # empty it. A subclass parameter (an FP8 weight) is kept whole, before any splitting.
    data = torch.randint(1, 9, (64, 64), dtype=torch.uint8, device=device)
    scale = torch.tensor([0.25], device=device)
    toy = ToyQuantized.wrap(data, scale)
    if as_parameter:
        toy._is_param = True  # what nn.Parameter marks subclass parameters with
    layers = torch.nn.ModuleList(SharedToyLayer(toy) for _ in range(3))
    x = torch.randn(64, 64, device=device)
    expected = train_step(layers, x)
    assert_bitwise(expected, train_step(layers, x))
    ctx, sync = context(device, 2, 3, min_offload_bytes=0)
    for _ in range(2):
        assert_bitwise(expected, train_step(layers, x, ctx, sync))
        assert toy._data is data and toy._scale is scale
    stats = ctx.stats
    # Per offloaded layer: tanh's output, plus the toy's data and scale unless it is a parameter.
    if as_parameter:
        assert stats["kept"]["parameter"] == 2 and stats["offloaded_tensors"] == 2
    else:
        assert stats["offloaded_tensors"] == 2 * 3


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA_FP8, reason="needs an FP8 GPU")
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_mlp_size_bitwise_and_race(scaling: str) -> None:
    """FP8-MLP size (hidden 4096, 8192 tokens), with every copy stream delayed."""
    layers = fp8_mlp("cuda", scaling, n=4, hidden=4096)
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    expected = train_step(layers, x)
    assert_bitwise(expected, train_step(layers, x))
    ctx, sync = context("cuda", 3, 4)
    transport = ctx.engine.transport
    offload_copy, reload_copy = transport.offload, transport.reload

    def slow_offload(*a, **k):
        with torch.cuda.stream(transport.d2h_stream):
            torch.cuda._sleep(20_000_000)
        return offload_copy(*a, **k)

    def slow_reload(*a, **k):
        with torch.cuda.stream(transport.h2d_stream):
            torch.cuda._sleep(20_000_000)
        return reload_copy(*a, **k)

    transport.offload, transport.reload = slow_offload, slow_reload
    for _ in range(2):
        assert_bitwise(expected, train_step(layers, x, ctx, sync))
    assert ctx.stats["offloaded_bytes"] > 3 * 150 * 2**20
