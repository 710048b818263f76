"""offload.fp8.convert / unconvert: nn.Linear modules become fp8.Linear in place (the same module
and Parameter objects, hooks, training flag and state_dict keys), results bitwise those of a
hand-built fp8.Linear, a filter, skipped shapes counted with their reasons, idempotence, the
inverse, clear errors and warnings; a converted HF Llama offloaded bit for bit. Runs on CPU
(torch's CPU ``_scaled_mm``); the ``cuda`` variants skip cleanly without an FP8 GPU."""

from __future__ import annotations

import copy
import importlib.util
import warnings

import pytest
import torch
from torch import nn

import offload
from offload import fp8
from offload.fp8 import conversion

from _util import assert_bitwise, llama_grads, tiny_llama

CUDA_FP8 = torch.cuda.is_available() and fp8.scaled_mm_supported("cuda")
CUDA_ONLY = [pytest.mark.cuda, pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 (sm_89+)")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_ONLY)]
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


class Block(nn.Module):
    """Two Linears (one without bias) and a nested one: names ``up``, ``down``, ``inner.proj``."""

    def __init__(self, width: int = 64, device: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.up = nn.Linear(width, 2 * width, **kw)
        self.down = nn.Linear(2 * width, width, bias=False, **kw)
        self.inner = nn.Sequential()
        self.inner.add_module("proj", nn.Linear(width, width, **kw))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.down(torch.relu(self.up(x))))


def make_model(device: str = "cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(Block(device=device, dtype=dtype), Block(device=device, dtype=dtype))


def quiet_convert(module: nn.Module, **kw) -> fp8.ConvertSummary:
    """convert without the CPU slowness warning (tested once, below)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return fp8.convert(module, **kw)


def hand_swapped(model: nn.Module, **kw) -> nn.Module:
    """A copy of ``model`` whose nn.Linear children are new fp8.Linear modules with the weights
    copied in by hand: what users did before convert."""
    ref = copy.deepcopy(model)
    for parent in list(ref.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                new = fp8.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                 device=child.weight.device, dtype=child.weight.dtype, **kw)
                new.load_state_dict(child.state_dict())
                setattr(parent, name, new)
    return ref


def step(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Output, input gradient and every parameter's gradient of one forward and backward."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = model(x)
    y.float().square().mean().backward()
    return [y.detach(), x.grad] + [p.grad for p in model.parameters()]


def test_convert_keeps_modules_parameters_hooks_flags_and_state_dict_keys() -> None:
    model = make_model()
    model[1].eval()  # a per-module training flag must survive
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    calls = []
    handle = model[0].up.register_forward_hook(lambda m, args, out: calls.append(type(m).__name__))
    model[0].up.custom_flag = "kept"  # e.g. HF's _is_hf_initialized

    summary = quiet_convert(model)

    assert set(summary.converted) == {"0.up", "0.down", "0.inner.proj", "1.up", "1.down", "1.inner.proj"}
    for name, m in model.named_modules():
        assert m is modules[name], f"{name}: convert replaced the module object"
    for name, p in model.named_parameters():
        assert p is params[name], f"{name}: convert replaced the Parameter"
        assert p.dtype == torch.bfloat16 and p.device.type == "cpu"
    assert list(model.state_dict()) == keys, "state_dict keys moved"
    assert isinstance(model[0].up, fp8.Linear) and model[0].down.bias is None
    assert model.training and model[0].training and not model[1].training and not model[1].up.training
    assert model[0].up.custom_flag == "kept"
    model(torch.randn(16, 64, dtype=torch.bfloat16))
    assert calls == ["Linear"] and model[0].up.weight_cache.nbytes > 0, "the forward hook or the FP8 path did not run"
    handle.remove()
    model(torch.randn(16, 64, dtype=torch.bfloat16))
    assert calls == ["Linear"], "the hook handle no longer removes the hook"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling,weight_layouts", [("tensorwise", "one"), ("tensorwise", "both"), ("rowwise", "one")])
def test_converted_model_is_bitwise_a_hand_built_fp8_model(device: str, scaling: str, weight_layouts: str) -> None:
    if scaling == "rowwise" and not fp8.rowwise_supported(device):
        pytest.skip(f"rowwise _scaled_mm is not available on {device} in torch {torch.__version__}")
    model = make_model(device)
    ref = hand_swapped(model, scaling=scaling, weight_layouts=weight_layouts)
    quiet_convert(model, scaling=scaling, weight_layouts=weight_layouts)
    x = torch.randn(32, 64, device=device, dtype=torch.bfloat16)
    expected = step(ref, x)
    assert_bitwise(expected, step(ref, x))  # the reference repeats itself
    assert_bitwise(expected, step(model, x))


def test_optimizer_built_before_convert_steps_the_converted_model() -> None:
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    model = make_model()
    before = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built on the nn.Linear model
    quiet_convert(model)
    ref = hand_swapped(before)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            step(m, x)
            o.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"{name} differs from the hand-built model's after three optimizer steps"
    assert not torch.equal(model[0].up.weight, before[0].up.weight), "the optimizer did not update the converted model"
    # The FP8 copy follows the optimizer's updates (version counter), so the next step is right too.
    assert_bitwise(step(ref, x), step(model, x))


def test_module_filter_fn_chooses_modules_by_name() -> None:
    model = make_model()
    seen = []

    def only_first_block(module: nn.Module, name: str) -> bool:
        seen.append((type(module), name))
        return name.startswith("0.")

    summary = quiet_convert(model, module_filter_fn=only_first_block)
    assert set(summary.converted) == {"0.up", "0.down", "0.inner.proj"}
    assert set(summary.filtered) == {"1.up", "1.down", "1.inner.proj"}
    assert all(t is nn.Linear for t, _ in seen) and len(seen) == 6
    assert type(model[1].up) is nn.Linear and isinstance(model[0].up, fp8.Linear)


def test_shapes_dtypes_and_subclasses_fp8_cannot_take_are_skipped_and_counted() -> None:
    class LoRALinear(nn.Linear):
        pass

    model = nn.ModuleDict({
        "ok": nn.Linear(32, 32),
        "odd_out": nn.Linear(32, 10),
        "odd_in": nn.Linear(24, 32),
        "f64": nn.Linear(32, 32, dtype=torch.float64),
        "lora": LoRALinear(32, 32),
        "mha": nn.MultiheadAttention(32, 2),  # out_proj: a Linear subclass the attention reads directly
    })
    summary = quiet_convert(model)
    assert summary.converted == ("ok",)
    assert set(summary.skipped) == {"odd_out", "odd_in", "f64", "lora", "mha.out_proj"}
    assert "out_features=10" in summary.skipped["odd_out"] and "multiple of 16" in summary.skipped["odd_out"]
    assert "in_features=24" in summary.skipped["odd_in"]
    assert "torch.float64" in summary.skipped["f64"]
    assert "subclass of torch.nn.Linear" in summary.skipped["lora"]
    assert "5 skipped" in str(summary) and "odd_out" in str(summary)
    assert type(model["odd_out"]) is nn.Linear and type(model["lora"]) is LoRALinear


def test_convert_is_idempotent() -> None:
    model = make_model()
    first = quiet_convert(model)
    caches = [m.weight_cache for m in model.modules() if isinstance(m, fp8.Linear)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing converted: no CPU warning either
        second = fp8.convert(model, scaling="rowwise" if fp8.rowwise_supported("cpu") else "tensorwise")
    assert not second.changed and second.converted == ()
    assert set(second.already) == set(first.converted)
    assert "nothing changed" in str(second) and "6 already fp8.Linear" in str(second)
    assert [m.weight_cache for m in model.modules() if isinstance(m, fp8.Linear)] == caches
    assert all(m.scaling == "tensorwise" for m in model.modules() if isinstance(m, fp8.Linear))


def test_the_root_and_a_shared_module_are_converted_once() -> None:
    lin = nn.Linear(32, 32)
    assert quiet_convert(lin).converted == ("",) and isinstance(lin, fp8.Linear)
    shared = nn.Linear(32, 32)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    assert quiet_convert(model).converted == ("0",)


def test_unconvert_is_the_inverse() -> None:
    model = make_model()
    original = copy.deepcopy(model)
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    model.add_module("norm_linear", fp8.LayerNormLinear(64, 64, dtype=torch.bfloat16))
    original.add_module("norm_linear", copy.deepcopy(model.norm_linear))
    quiet_convert(model)
    model(torch.randn(16, 64, dtype=torch.bfloat16))  # fills the weight caches

    summary = fp8.unconvert(model)
    assert set(summary.converted) == {"0.up", "0.down", "0.inner.proj", "1.up", "1.down", "1.inner.proj"}
    assert set(summary.skipped) == {"norm_linear"} and "no torch.nn.Linear form" in summary.skipped["norm_linear"]
    for name, m in model.named_modules():
        if name and name != "norm_linear" and isinstance(m, nn.Linear):
            assert type(m) is nn.Linear
            leftover = [a for a in fp8.Linear.FP8_STATE if a in vars(m)]
            assert not leftover, f"{name} keeps FP8 state {leftover}"
    for name, p in model.named_parameters():
        if not name.startswith("norm_linear"):
            assert p is params[name]
    assert [k for k in model.state_dict() if not k.startswith("norm_linear")] == keys
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    assert torch.equal(model[:2](x), original[:2](x)), "the unconverted model does not compute nn.Linear's result"
    again = fp8.unconvert(model)
    assert not again.changed and len(again.already) == 6


def test_bad_input_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="contains no torch.nn.Linear module"):
        fp8.convert(nn.Sequential(nn.ReLU(), nn.LayerNorm(8)))
    with pytest.raises(ValueError, match="contains no torch.nn.Linear module"):
        fp8.unconvert(nn.ReLU())
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        fp8.convert(torch.zeros(3))
    with pytest.raises(ValueError, match="scaling must be one of"):
        fp8.convert(nn.Linear(32, 32), scaling="blockwise")
    with pytest.raises(ValueError, match="weight_layouts must be 'one'"):
        fp8.convert(nn.Linear(32, 32), weight_layouts="two")
    with pytest.raises(TypeError, match="module_filter_fn must be a callable"):
        fp8.convert(nn.Linear(32, 32), module_filter_fn="lm_head")


def test_device_without_fp8_gemms_raises_unless_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    # What a GPU below sm_89 answers, played on the CPU (unsupported_reason is where convert asks).
    monkeypatch.setattr(conversion, "unsupported_reason", lambda device: "FP8 GEMMs need compute capability 8.9 or newer; the GPU is sm_80")
    model = make_model()
    with pytest.raises(ValueError, match=r"sm_80.*Nothing was converted; pass allow_fallback=True"):
        fp8.convert(model)
    assert not any(isinstance(m, fp8.Linear) for m in model.modules()), "a refused convert changed the model"
    with pytest.warns(UserWarning, match="allow_fallback=True: 6 Linear module.s. stay torch.nn.Linear"):
        summary = fp8.convert(model, allow_fallback=True)
    assert summary.converted == () and len(summary.skipped) == 6
    assert all("sm_80" in r for r in summary.skipped.values())
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))


def test_cpu_convert_warns_that_cpu_scaled_mm_is_slow() -> None:
    with pytest.warns(UserWarning, match=r"6 Linear module.s. converted on the CPU.*1,250x"):
        fp8.convert(make_model())


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 (sm_89+)")
def test_convert_on_an_fp8_gpu_warns_nothing() -> None:
    model = make_model("cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(fp8.convert(model).converted) == 6
    assert model[0].up.weight.is_cuda


# ---------------------------------------------------------------------------------------------
# a real model: HF Llama converted, then offloaded
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")
@pytest.mark.parametrize("device", DEVICES)
def test_converted_hf_llama_offloads_bitwise(device: str, request: pytest.FixtureRequest) -> None:
    if device == "cuda":
        request.getfixturevalue("repeatable_attention")  # efficient/math SDPA: flash's backward varies
    model, ids = tiny_llama(layers=3, device=device)
    model.to(torch.bfloat16)
    summary = quiet_convert(model, module_filter_fn=lambda m, name: name != "lm_head")
    assert len(summary.converted) == 3 * 7 and summary.filtered == ("lm_head",)
    expected = llama_grads(model, ids)
    assert_bitwise(expected, llama_grads(model, ids))  # the plain run repeats itself
    oa = offload.OffloadActivations(model.model.layers, num_offload_layers=2, min_offload_bytes=0,
                                    device="cpu" if device == "cpu" else None)
    for _ in range(2):
        assert_bitwise(expected, llama_grads(model, ids, oa))
    stats = oa.stats
    assert stats["offloaded_bytes"] > 0, "nothing was offloaded: the comparison proves nothing"
    assert stats["weight_cache_bytes"] == fp8.weight_cache_bytes(model.model.layers) > 0
    oa.close()


def test_convert_swaps_llama_norms_and_mlps_too_and_unconvert_puts_them_back() -> None:
    """One call gives a Llama the FP8-saving norms and MLPs (``llama_ops=True``, the default);
    unconvert restores the original modules with the same Parameters."""
    pytest.importorskip("transformers")
    from _util import tiny_llama

    model, _ = tiny_llama(2)
    layer = model.model.layers[0]
    norm, mlp, weight = layer.input_layernorm, layer.mlp, layer.input_layernorm.weight
    with pytest.warns(UserWarning, match="slow"):
        summary = fp8.convert(model, module_filter_fn=lambda m, name: name != "lm_head")
    assert isinstance(layer.input_layernorm, fp8.RMSNorm) and isinstance(layer.mlp, fp8.SwiGLUMLP)
    assert layer.input_layernorm.weight is weight
    assert summary.llama_ops is not None and summary.llama_ops.norms == 4 and summary.llama_ops.mlps == 2
    assert "RMSNorms" in str(summary)
    back = fp8.unconvert(model)
    assert layer.input_layernorm is norm and layer.mlp is mlp and norm.weight is weight
    assert back.restored_ops == 6
    with pytest.warns(UserWarning, match="slow"):
        plain = fp8.convert(model, llama_ops=False)
    assert plain.llama_ops is None and layer.mlp is mlp
