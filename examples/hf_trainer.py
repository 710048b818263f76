"""HF ``transformers.Trainer`` with activation offload in one line, checked against the plain Trainer.

    python examples/hf_trainer.py                 # CUDA if available, else the CPU
    python examples/hf_trainer.py --device cpu --steps 3

Builds a tiny random-init ``LlamaForCausalLM`` (no download) and a dataset of random token ids
(no tokenizer), trains it for a few optimizer steps with a plain ``Trainer``, then from the same
weights with one more line::

    oa = offload.integrations.hf.offload_trainer(trainer)   # all decoder layers but the last

and prints the offload report and whether the trained parameters are bitwise equal to the plain
run's. Exit code 1 if they differ. Needs ``transformers`` and ``accelerate``
(``pip install -e '.[test]'``). TRL's ``SFTTrainer`` takes the same call.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any, Optional

import torch

import offload
from offload.repeatable import repeatable_attention


class TokenDataset(torch.utils.data.Dataset):
    """Rows of random token ids; a causal LM's labels are its inputs."""

    def __init__(self, rows: int, length: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama() -> Any:
    """A random-weight Llama of 4 decoder layers, the same weights on every call."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def train(device: torch.device, steps: int, offloaded: bool) -> tuple[list[torch.Tensor], Optional[Any]]:
    """Train a fresh tiny Llama for ``steps`` optimizer steps; its parameters and the offload."""
    import transformers

    model = tiny_llama()
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=2, max_steps=steps, learning_rate=1e-3,
            use_cpu=device.type == "cpu", report_to=[], dataloader_num_workers=0, seed=0,
            save_strategy="no", logging_strategy="no", disable_tqdm=True,
        )
        trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenDataset(16, 64, 256))
        # The one line. The example's activations are small: min_offload_bytes=0 lets every one
        # of them travel (by default tensors under 64 KiB stay put).
        oa = offload.integrations.hf.offload_trainer(trainer, min_offload_bytes=0) if offloaded else None
        trainer.train()
    return [p.detach().clone() for p in model.parameters()], oa


def main(argv: Optional[list[str]] = None) -> int:
    """Run the example; returns the exit code (1 if the offloaded run's parameters differ)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    args = parser.parse_args(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before its first use
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with repeatable_attention(device):
        plain, _ = train(device, args.steps, offloaded=False)
        again, _ = train(device, args.steps, offloaded=False)
        if not all(torch.equal(a, b) for a, b in zip(plain, again)):
            print("the plain Trainer does not repeat itself here: a bitwise check would prove nothing")
            return 1
        got, oa = train(device, args.steps, offloaded=True)
    same = all(torch.equal(a, b) for a, b in zip(plain, got))
    print(oa.report())
    print(f"\nTrainer + offload_trainer, {args.steps} optimizer steps: parameters bitwise equal to the "
          f"plain Trainer's: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
