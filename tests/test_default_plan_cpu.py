"""The one-line default of ``OffloadActivations(layers)`` (issue 33, items 6 and 8), on CPU.

On CUDA, told no count, plan or budget, it plans for ``memory_budget_bytes="device"``; on the
CPU (and with the v1 schedule, manual synchronization, or layers the model checkpoints itself) it
offloads all layers but the last, as an explicit ``num_offload_layers`` does everywhere. The
choice is a pure function (``offload.layers.args.default_budget``), tested here case by case; the
CUDA side of the decision is faked by patching the device type it reads, on disabled contexts
(no engine, so no GPU needed). ``measure_peak`` defaults to on for planned steps on CUDA only.
The GPU side runs in ``tests/test_default_plan_gpu.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import offload
from offload.layers import args as layer_args
from offload.api import resolve_device
from offload.layers.args import default_budget, device_type

from _util import assert_bitwise, make_gpt_layers, oa_step, plain_reference


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default decides as it would on a CUDA device (the contexts built must be disabled:
    there is no GPU to build an engine on)."""
    monkeypatch.setattr(layer_args, "device_type", lambda device: "cuda")


# -- the pure decision -----------------------------------------------------------------------------
@pytest.mark.parametrize("case, expected", [
    (dict(device_type="cuda"), "device"),
    (dict(device_type="cpu"), None),
    (dict(device_type="cuda", count_given=True), None),
    (dict(device_type="cuda", plan_given=True), None),
    (dict(device_type="cuda", budget="lowest"), "lowest"),
    (dict(device_type="cpu", budget="lowest"), "lowest"),
    (dict(device_type="cuda", budget=1 << 30), 1 << 30),
    (dict(device_type="cuda", mode="v1"), None),
    (dict(device_type="cuda", manual=True), None),
    (dict(device_type="cuda", checkpointed=True), None),
])
def test_default_budget_is_device_only_on_cuda_when_nothing_else_was_chosen(case: dict[str, Any], expected: Any) -> None:
    arguments = {"count_given": False, "plan_given": False, "budget": None, **case}
    assert default_budget(**arguments) == expected


def test_device_type_is_the_type_resolve_device_gives() -> None:
    assert device_type(None) == resolve_device(None).type
    assert device_type("cpu") == "cpu" and device_type(torch.device("cpu")) == "cpu"
    assert device_type("cuda:1") == "cuda" and device_type(0) == "cuda"
    # Values the engine refuses read as the CPU here (the engine raises for them, in its words).
    assert device_type("tpu!") == "cpu" and device_type(["cpu"]) == "cpu"


def test_checkpointed_reads_hf_and_torch_checkpointing() -> None:
    layers = make_gpt_layers(2)
    assert not layer_args.checkpointed(layers)
    layers[1].gradient_checkpointing = True  # what HF's activation_checkpointing_enable() sets
    assert layer_args.checkpointed(layers)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    assert layer_args.checkpointed([checkpoint_wrapper(make_gpt_layers(1)[0])])


# -- on the CPU: the fixed count, as before ----------------------------------------------------------
def test_the_default_on_a_cpu_device_offloads_all_layers_but_the_last() -> None:
    layers, x = make_gpt_layers(4), torch.randn(2, 16, 64)
    expected = plain_reference(layers, x)
    oa = offload.OffloadActivations(layers, device="cpu", min_offload_bytes=0)
    assert oa.budget is None and oa.plan is None and oa.measure_peak is False
    assert repr(oa) == "OffloadActivations(4 layers (GPTBlock), offloading 3 of them)"
    for _ in range(2):
        assert_bitwise(expected, oa_step(layers, x, oa))
    stats = oa.stats
    # Layers 0..2, whose tiny groups share one copy (the default group_bytes).
    assert oa.engine.schedule.num_layers == 3
    assert stats["mode"] == "v2" and stats["groups_offloaded"] == 1 and stats["offloaded_bytes"] > 0, stats


@pytest.mark.parametrize("name", ["num_offload_layers", "num_layers"])
def test_an_explicit_count_gives_the_fixed_schedule(name: str) -> None:
    layers, x = make_gpt_layers(4), torch.randn(2, 16, 64)
    expected = plain_reference(layers, x)
    oa = offload.OffloadActivations(layers, device="cpu", min_offload_bytes=0, **{name: 2})
    assert oa.budget is None
    assert_bitwise(expected, oa_step(layers, x, oa))
    assert oa.engine.schedule.num_layers == 2  # layers 0 and 1, sharing one small group
    assert oa.stats["mode"] == "v2" and oa.stats["groups_offloaded"] == 1


# -- the CUDA side of the decision, faked ---------------------------------------------------------------
@pytest.mark.usefixtures("fake_cuda")
def test_on_cuda_the_default_is_a_device_plan_and_says_so() -> None:
    oa = offload.OffloadActivations(make_gpt_layers(4), enabled=False)
    assert oa.budget == "device"
    assert repr(oa) == ("OffloadActivations(4 layers (GPTBlock), memory_budget_bytes='device' "
                        "(the default on CUDA; planning), disabled)")
    oa.set_budget("lowest")  # the caller's budget now: no longer called the default
    assert oa.budget == "lowest" and "the default" not in repr(oa)


@pytest.mark.usefixtures("fake_cuda")
@pytest.mark.parametrize("options", [
    dict(num_offload_layers=3), dict(num_layers=1), dict(mode="v1"), dict(manual_synchronization=True),
], ids=["num_offload_layers", "num_layers", "v1", "manual"])
def test_on_cuda_a_chosen_count_or_schedule_keeps_the_fixed_count(options: dict[str, Any]) -> None:
    oa = offload.OffloadActivations(make_gpt_layers(4), enabled=False, **options)
    assert oa.budget is None and "planning" not in repr(oa)
    with pytest.raises(ValueError, match="offloads a fixed number of layers"):
        oa.set_budget("lowest")


@pytest.mark.usefixtures("fake_cuda")
def test_on_cuda_the_v1_environment_variable_keeps_the_fixed_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    assert offload.OffloadActivations(make_gpt_layers(4), enabled=False).budget is None
    # An explicit mode wins over the environment, as everywhere.
    assert offload.OffloadActivations(make_gpt_layers(4), enabled=False, mode="v2").budget == "device"


@pytest.mark.usefixtures("fake_cuda")
def test_on_cuda_layers_the_model_checkpoints_keep_the_fixed_count() -> None:
    layers = make_gpt_layers(4)
    for layer in layers:
        layer.gradient_checkpointing = True  # HF's flag: a plan would recompute them twice
    assert offload.OffloadActivations(layers, enabled=False).budget is None


@pytest.mark.usefixtures("fake_cuda")
def test_a_count_with_a_budget_is_still_refused() -> None:
    with pytest.raises(ValueError, match="takes num_offload_layers .* or a plan / memory_budget_bytes"):
        offload.OffloadActivations(make_gpt_layers(4), 2, memory_budget_bytes="lowest", enabled=False)


# -- measure_peak ------------------------------------------------------------------------------------------
def test_measure_peak_defaults_off_on_the_cpu_and_an_explicit_value_wins() -> None:
    layers = make_gpt_layers(4)
    assert offload.OffloadActivations(layers, memory_budget_bytes="lowest", device="cpu").measure_peak is False
    assert offload.OffloadActivations(layers, memory_budget_bytes="lowest", device="cpu",
                                      measure_peak=True).measure_peak is True
    assert offload.OffloadActivations(layers, device="cpu", measure_peak=False).measure_peak is False
    with pytest.raises(TypeError, match="measure_peak must be True or False"):
        offload.OffloadActivations(layers, device="cpu", measure_peak="yes")  # type: ignore[arg-type]
    # The form without layers has no plans: None and False are fine, True is refused.
    offload.OffloadActivations(device="cpu", measure_peak=False)
    with pytest.raises(ValueError, match="measure_peak cannot apply"):
        offload.OffloadActivations(device="cpu", measure_peak=True)


# -- offload_trainer inherits the default ---------------------------------------------------------
def _trainer(tmp_path: Any, checkpointing: bool) -> Any:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from _util import tiny_llama

    name = ("activation_checkpointing" if "activation_checkpointing" in transformers.TrainingArguments.__dataclass_fields__
            else "gradient_checkpointing")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True,
                                          disable_tqdm=True, **{name: checkpointing})
    return transformers.Trainer(model=tiny_llama(layers=3)[0], args=args, train_dataset=[])


@pytest.mark.usefixtures("fake_cuda")
def test_offload_trainer_takes_the_default_and_the_fixed_count_under_checkpointing(tmp_path: Any) -> None:
    from offload.integrations.hf import offload_trainer

    assert offload_trainer(_trainer(tmp_path, False), enabled=False).budget == "device"
    # The Trainer's own checkpointing (TRL's SFTConfig default) is turned on in train(), after
    # offload_trainer: the fixed count, which composes with it, not a plan recomputing again.
    assert offload_trainer(_trainer(tmp_path, True), enabled=False).budget is None
    assert offload_trainer(_trainer(tmp_path, False), enabled=False, num_offload_layers=1).budget is None
    assert '"device"' in (offload_trainer.__doc__ or "")
