"""One obvious way in: each entry point runs where CUDA is absent, a disabled context answers like
an enabled one, and every error speaks of the arguments the caller passed."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from torch import nn

import offload
from offload.layers.find import find_layers
from offload.models import GPT, run_layers

from _util import assert_bitwise, make_gpt_layers, oa_step, plain_reference, tiny_llama, train_step

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="device=None means CUDA where CUDA is present")


# -- CPU by default -------------------------------------------------------------------------------
@no_cuda
def test_te_call_shape_runs_on_a_cpu_only_machine_without_device() -> None:
    layers = make_gpt_layers()
    x = torch.randn(2, 16, 64)
    expected = plain_reference(layers, x)
    ctx, sync = offload.get_cpu_offload_context(True, num_layers=3, model_layers=4, min_offload_bytes=0)
    assert ctx.engine.transport.name == "cpu"
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    assert ctx.stats["offloaded_bytes"] > 0


@no_cuda
def test_plan_runs_on_a_cpu_only_machine_without_device() -> None:
    layers = make_gpt_layers()
    x = torch.randn(2, 16, 64)
    plan = offload.plan(layers, lambda: train_step(layers, x), memory_budget_bytes="lowest")
    assert len(plan.layers) == len(layers)


# -- enabled=False ----------------------------------------------------------------------------------
def test_disabled_context_has_stats_and_report_and_runs_the_te_loop() -> None:
    layers = make_gpt_layers()
    x = torch.randn(2, 16, 64)
    expected = plain_reference(layers, x)
    ctx, sync = offload.get_cpu_offload_context(enabled=False, num_layers=3, model_layers=4)
    assert_bitwise(expected, train_step(layers, x, ctx, sync))
    assert ctx.stats["mode"] == "disabled" and ctx.stats["offloaded_bytes"] == 0
    assert set(ctx.stats) == set(offload.StepStats.__annotations__)
    assert "disabled" in ctx.report()
    assert ctx.reserve(1 << 20) == 0


def test_disabled_manual_context_gives_a_controller_that_does_nothing() -> None:
    ctx, sync, controller = offload.get_cpu_offload_context(False, manual_synchronization=True)
    controller.start_offload_layer(0)
    controller.release_activation_forward_gpu_memory(0)
    controller.start_reload_layer(0)
    assert ctx.stats["mode"] == "disabled"


def test_disabled_offload_activations_has_the_same_stats_keys() -> None:
    oa = offload.OffloadActivations(make_gpt_layers(), enabled=False)
    assert set(oa.stats) == set(offload.StepStats.__annotations__)


@pytest.mark.parametrize("api", ["OffloadActivations", "get_cpu_offload_context"])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_enabled_must_be_a_bool(api: str, value: object) -> None:
    with pytest.raises(TypeError, match=f"{api}: enabled must be True or False"):
        if api == "OffloadActivations":
            offload.OffloadActivations(make_gpt_layers(), enabled=value)  # type: ignore[arg-type]
        else:
            offload.get_cpu_offload_context(enabled=value)  # type: ignore[arg-type]


# -- the offload count, in OffloadActivations' words ------------------------------------------------
def test_a_count_of_the_wrong_type_names_num_offload_layers() -> None:
    with pytest.raises(TypeError) as info:
        offload.OffloadActivations(make_gpt_layers(), "2")  # type: ignore[arg-type]
    assert "num_offload_layers must be an integer" in str(info.value)
    assert "num_layers must" not in str(info.value)


@pytest.mark.parametrize("name", ["num_offload_layers", "num_layers"])
def test_too_many_offloaded_layers_speaks_of_the_layers_given(name: str) -> None:
    with pytest.raises(ValueError) as info:
        offload.OffloadActivations(make_gpt_layers(4), **{name: 10})
    message = str(info.value)
    assert f"{name}=10" in message and "4 layers given" in message and "at most 3" in message
    for foreign in ("model_layers", "NVTE_CPU_OFFLOAD_V1", "manual_synchronization"):
        assert foreign not in message, f"the error talks about {foreign}, which OffloadActivations users never set"


def test_num_layers_alone_is_the_alias_of_num_offload_layers() -> None:
    layers = make_gpt_layers(4)
    x = torch.randn(2, 16, 64)
    expected = plain_reference(layers, x)
    oa = offload.OffloadActivations(layers, num_layers=1, device="cpu", min_offload_bytes=0)
    assert_bitwise(expected, oa_step(layers, x, oa))
    assert oa.stats["groups_offloaded"] == 1


def test_both_count_names_with_different_values_are_refused() -> None:
    with pytest.raises(ValueError, match="num_offload_layers or num_layers, not both"):
        offload.OffloadActivations(make_gpt_layers(4), 1, num_layers=2)


# -- a model where its layers were expected ---------------------------------------------------------
def test_a_model_passed_for_its_layers_is_told_which_attribute_to_pass() -> None:
    model = GPT(vocab=100, hidden=32, heads=4, layers=3, max_seq=16)
    with pytest.raises(TypeError) as info:
        offload.OffloadActivations(model)
    message = str(info.value)
    assert "pass model.layers (or the module list that holds the repeated layers)" in message
    assert "model.layers (a ModuleList of 3 GPTBlock)" in message
    assert "not iterable" not in message


def test_an_hf_model_passed_for_its_layers_names_model_model_layers() -> None:
    pytest.importorskip("transformers")
    model, _ = tiny_llama(layers=3)
    with pytest.raises(TypeError, match=r"model\.model\.layers \(a ModuleList of 3 LlamaDecoderLayer\)"):
        offload.OffloadActivations(model)


def test_a_gpt2_style_model_names_transformer_h() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32)
    with pytest.raises(TypeError, match=r"model\.transformer\.h \(a ModuleList of 2 GPT2Block\)"):
        offload.OffloadActivations(transformers.GPT2LMHeadModel(config))


def test_a_module_without_repeated_layers_says_none_was_found() -> None:
    class Single(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

    with pytest.raises(TypeError, match="no module list of repeated layers was found in this Single"):
        offload.OffloadActivations(Single())


def test_find_layers_prefers_the_stack_to_lists_inside_a_layer() -> None:
    class MoELayer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norms = nn.ModuleList(nn.LayerNorm(8) for _ in range(2))
            self.blocks = nn.ModuleList(MoELayer() for _ in range(3))

    model = Model()
    assert find_layers(model) == ("blocks", model.blocks)
    assert find_layers(nn.Linear(2, 2)) is None


# -- one context per thread on one model ------------------------------------------------------------
def test_each_thread_with_its_own_context_on_one_model_offloads_its_own_forward() -> None:
    layers = make_gpt_layers(4)
    inputs = [torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(i)) for i in range(2)]

    def grads(x: torch.Tensor, oa: object = None) -> list[torch.Tensor]:
        # autograd.grad, not .grad: two threads accumulating into one .grad would race.
        xin = x.detach().requires_grad_(True)
        with oa if oa is not None else torch.enable_grad():
            out = run_layers(layers, xin)
        loss = (out.float() ** 2).mean()
        return list(torch.autograd.grad(loss, [*layers.parameters(), xin]))

    expected = [grads(x) for x in inputs]
    assert all(torch.equal(a, b) for a, b in zip(expected[0], grads(inputs[0])))
    # Both forwards are inside their `with` at once: each waits at the first layer for the other.
    barrier = threading.Barrier(2, timeout=30)

    def meet(*_: object) -> None:
        barrier.wait()

    handle = layers[0].register_forward_pre_hook(meet)
    contexts = [offload.OffloadActivations(layers, device="cpu", min_offload_bytes=0, group_bytes=0) for _ in range(2)]
    results: list[object] = [None, None]

    def run(i: int) -> None:
        try:
            results[i] = grads(inputs[i], contexts[i])
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    handle.remove()
    for i in range(2):
        assert not isinstance(results[i], BaseException), f"thread {i} raised: {results[i]!r}"
        assert_bitwise(expected[i], results[i])  # type: ignore[arg-type]
        assert contexts[i].stats["groups_offloaded"] == 3, contexts[i].report()


def test_contexts_dropped_without_close_leave_no_hooks_behind() -> None:
    layers = make_gpt_layers(2)
    x = torch.randn(2, 16, 64)
    for _ in range(3):
        oa_step(layers, x, offload.OffloadActivations(layers, device="cpu", min_offload_bytes=0))
        gc.collect()
    # One pair: the last context's. The earlier contexts' hooks were inert but still called.
    assert len(layers[0]._forward_pre_hooks) == 1 and len(layers[0]._forward_hooks) == 1
