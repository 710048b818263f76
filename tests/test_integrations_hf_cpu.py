"""HF Trainer and TRL's SFTTrainer with offload_trainer, on CPU with a tiny random-init Llama (no
download, no tokenizer files): the parameters and every optimizer step's gradients are bitwise
those of the same trainer without offload, once two plain runs are seen to repeat themselves."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import offload  # noqa: E402
from offload.integrations.hf import offload_trainer  # noqa: E402

from _util import tiny_llama  # noqa: E402

# The installed transformers' name for activation checkpointing in TrainingArguments.
CHECKPOINTING = (
    "activation_checkpointing"
    if "activation_checkpointing" in transformers.TrainingArguments.__dataclass_fields__ else "gradient_checkpointing"
)

STEPS = 3


class TokenDataset(torch.utils.data.Dataset):
    """Random token ids, the labels the ids themselves: what a causal LM trains on."""

    def __init__(self, rows: int = 8, length: int = 32, vocab: int = 128) -> None:
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, vocab, (rows, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class GradientLog(transformers.TrainerCallback):
    """Every optimizer step's gradients, taken just before the step."""

    def __init__(self) -> None:
        self.steps: list[list[torch.Tensor]] = []

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        self.steps.append([p.grad.clone() for p in model.parameters() if p.grad is not None])


def training_args(tmp_path: Path, steps: int = STEPS, **kw: Any) -> Any:
    return transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=steps, learning_rate=1e-3,
        report_to=[], use_cpu=True, dataloader_num_workers=0, seed=0, save_strategy="no",
        logging_strategy="no", disable_tqdm=True, **kw,
    )


def run_trainer(tmp_path: Path, offload_options: Optional[dict[str, Any]] = None, steps: int = STEPS,
                args: Optional[dict[str, Any]] = None) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], Any]:
    """Train a fresh tiny Llama; its final parameters, its gradients per step and the offload."""
    model, _ = tiny_llama(layers=3)
    log = GradientLog()
    trainer = transformers.Trainer(model=model, args=training_args(tmp_path, steps, **(args or {})),
                                   train_dataset=TokenDataset(), callbacks=[log])
    oa = offload_trainer(trainer, **offload_options) if offload_options is not None else None
    trainer.train()
    return [p.detach().clone() for p in model.parameters()], log.steps, oa


def assert_same(a: tuple[Any, Any, Any], b: tuple[Any, Any, Any], what: str) -> None:
    params_a, grads_a, _ = a
    params_b, grads_b, _ = b
    assert len(grads_a) == len(grads_b) > 0, f"{what}: {len(grads_a)} against {len(grads_b)} optimizer steps"
    for step, (ga, gb) in enumerate(zip(grads_a, grads_b), 1):
        assert len(ga) == len(gb) and all(torch.equal(x, y) for x, y in zip(ga, gb)), \
            f"{what}: the gradients of optimizer step {step} differ"
    assert all(torch.equal(x, y) for x, y in zip(params_a, params_b)), f"{what}: the trained parameters differ"


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Any]:
    first = run_trainer(tmp_path_factory.mktemp("plain"))
    assert_same(first, run_trainer(tmp_path_factory.mktemp("plain2")), "two plain runs (the reference repeats itself)")
    return first


def test_trainer_with_offload_trains_bitwise_like_the_plain_trainer(plain: Any, tmp_path: Path) -> None:
    got = run_trainer(tmp_path, {"min_offload_bytes": 0, "group_bytes": 0})
    assert_same(plain, got, "Trainer + offload_trainer")
    stats = got[2].stats
    assert stats["groups_offloaded"] == 2 and stats["finished"], got[2].report()  # 3 layers: all but the last
    assert stats["transport"] == "cpu"


def test_trainer_with_a_memory_budget_plans_and_trains_bitwise(tmp_path: Path, tmp_path_factory: Any) -> None:
    # The plan is made on the fourth forward (warm-up, calibration, probe) and followed from then on.
    steps = 6
    reference = run_trainer(tmp_path_factory.mktemp("plain6"), steps=steps)
    got = run_trainer(tmp_path, {"memory_budget_bytes": "lowest", "min_offload_bytes": 0}, steps=steps)
    assert_same(reference, got, "Trainer + offload_trainer(memory_budget_bytes='lowest')")
    assert got[2].plan is not None and "layer" in got[2].plan_report()


def test_explicit_layers_and_num_offload_layers(plain: Any, tmp_path: Path) -> None:
    model, _ = tiny_llama(layers=3)
    trainer = transformers.Trainer(model=model, args=training_args(tmp_path), train_dataset=TokenDataset())
    oa = offload_trainer(trainer, layers=model.model.layers, num_offload_layers=1, min_offload_bytes=0)
    trainer.train()
    assert oa.stats["groups_offloaded"] == 1
    assert all(torch.equal(x, y) for x, y in zip(plain[0], model.parameters()))


def test_evaluation_and_no_grad_forwards_are_not_offloaded(tmp_path: Path) -> None:
    model, _ = tiny_llama(layers=3)
    trainer = transformers.Trainer(model=model, args=training_args(tmp_path), train_dataset=TokenDataset(),
                                   eval_dataset=TokenDataset(rows=4))
    plain_loss = trainer.evaluate()["eval_loss"]
    oa = offload_trainer(trainer, min_offload_bytes=0)
    assert trainer.evaluate()["eval_loss"] == plain_loss
    assert oa.stats["step"] == 0, "an evaluation forward was counted as a training step"
    trainer.train()
    with torch.no_grad():  # e.g. TRL's metrics forward after the training forward
        model(input_ids=TokenDataset().ids[:2])
    assert oa.stats["step"] == STEPS


def test_a_failed_forward_leaves_the_context_ready_for_the_next(tmp_path: Path) -> None:
    model, ids = tiny_llama(layers=3)
    trainer = transformers.Trainer(model=model, args=training_args(tmp_path), train_dataset=TokenDataset())
    oa = offload_trainer(trainer, min_offload_bytes=0, group_bytes=0)
    with pytest.raises(IndexError):
        model(input_ids=ids + 1000)  # out of the vocabulary: the embedding raises
    assert not oa.active
    try:
        raise KeyError("handled by the caller")
    except KeyError:  # a forward inside an except block (a retry) is not a failed forward
        model(input_ids=ids, labels=ids).loss.backward()
    assert oa.stats["groups_offloaded"] == 2 and oa.stats["finished"]


def test_offload_trainer_refuses_what_it_cannot_offload(tmp_path: Path) -> None:
    model, _ = tiny_llama(layers=3)
    trainer = transformers.Trainer(model=model, args=training_args(tmp_path), train_dataset=TokenDataset())
    with pytest.raises(TypeError, match=r"offload_trainer\(\) got unexpected keyword argument 'num_offload_layer' \(did you mean 'num_offload_layers'\?\)"):
        offload_trainer(trainer, num_offload_layer=1)
    with pytest.raises(TypeError, match="takes a transformers.Trainer"):
        offload_trainer(model)
    with pytest.raises(TypeError, match="OffloadActivations: enabled must be True or False"):
        offload_trainer(trainer, enabled="yes")
    offload_trainer(trainer)
    with pytest.raises(RuntimeError, match="offloaded already"):
        offload_trainer(trainer)
    checkpointed = transformers.Trainer(model=tiny_llama(layers=3)[0], train_dataset=TokenDataset(),
                                        args=training_args(tmp_path, **{CHECKPOINTING: True}))
    with pytest.raises(ValueError, match=f"turn the Trainer's {CHECKPOINTING} off"):
        offload_trainer(checkpointed, memory_budget_bytes="lowest")


def test_a_model_without_repeated_layers_asks_for_layers(tmp_path: Path) -> None:
    class Flat(transformers.PreTrainedModel):
        config_class = transformers.PretrainedConfig

        def __init__(self) -> None:
            super().__init__(transformers.PretrainedConfig())
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, labels: Any = None) -> Any:
            return (self.proj(x).sum(),)

    trainer = transformers.Trainer(model=Flat(), args=training_args(tmp_path), train_dataset=TokenDataset())
    with pytest.raises(ValueError, match=r"no module list of repeated layers was found in the trainer's Flat; pass them"):
        offload_trainer(trainer)


# -- TRL ---------------------------------------------------------------------------------------------
def sft_trainer(tmp_path: Path, use_cpu: bool = True, **config: Any) -> tuple[Any, Any]:
    """TRL's SFTTrainer on pre-tokenized rows, with a tokenizer built in memory (no download)."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(128)}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")), pad_token="t1", eos_token="t2",
        unk_token="t0",
    )
    rows = datasets.Dataset.from_dict({"input_ids": TokenDataset().ids.tolist()})
    # TRL's SFTConfig turns checkpointing on by default under transformers' deprecated name;
    # the same setting under the current name where the installed transformers has it (5.24
    # does, 5.17 does not), without the deprecation warning.
    config.setdefault(CHECKPOINTING, True)
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=STEPS, learning_rate=1e-3,
                         report_to=[], use_cpu=use_cpu, dataloader_num_workers=0, seed=0, save_strategy="no",
                         logging_strategy="no", disable_tqdm=True, **config)
    model, _ = tiny_llama(layers=3)
    log = GradientLog()
    return trl.SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer, callbacks=[log]), log


def run_sft(tmp_path: Path, offload_options: Optional[dict[str, Any]] = None, use_cpu: bool = True,
            **config: Any) -> tuple[Any, Any, Any]:
    """Train with TRL's SFTTrainer (``config``: SFTConfig options); offload_trainer with
    ``offload_options`` unless None. Parameters, gradients per step, and the offload."""
    trainer, log = sft_trainer(tmp_path, use_cpu, **config)
    oa = offload_trainer(trainer, **offload_options) if offload_options is not None else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's notes on padding-free and tokenizer defaults
        trainer.train()
    return [p.detach().clone() for p in trainer.model.parameters()], log.steps, oa


def test_trl_sft_trainer_with_offload_trains_bitwise_like_without(tmp_path_factory: Any) -> None:
    reference = run_sft(tmp_path_factory.mktemp("sft"))
    assert_same(reference, run_sft(tmp_path_factory.mktemp("sft2")), "two plain SFTTrainer runs")
    got = run_sft(tmp_path_factory.mktemp("sft_offload"), {"min_offload_bytes": 0, "group_bytes": 0})
    assert_same(reference, got, "SFTTrainer + offload_trainer")
    assert got[2].stats["groups_offloaded"] == 2 and got[2].stats["finished"]


def test_trl_own_offload_context_is_replaced(tmp_path: Path) -> None:
    trainer, _ = sft_trainer(tmp_path)
    entered: list[bool] = []

    @contextlib.contextmanager
    def trl_context() -> Any:  # stands in for TRL's torchtune copy (activation_offloading=True)
        entered.append(True)
        yield

    trainer.maybe_activation_offload_context = trl_context()
    offload_trainer(trainer, min_offload_bytes=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert not entered, "TRL's own offload context still ran beside offload's"
