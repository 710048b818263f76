"""A HuggingFace Llama trained with activation offload, its gradients checked against plain.

    python examples/hf_llama.py                 # CUDA if available, else the CPU
    python examples/hf_llama.py --device cpu

Builds a tiny ``transformers.LlamaForCausalLM`` with random weights (no download), then runs one
training step three ways from the same weights and input:

1. plain;
2. ``offload.OffloadActivations(model.model.layers, num_offload_layers=n - 1)``: all decoder layers but the last offload
   their saved activations (on the CPU through the host transport, ``device="cpu"``);
3. a plan for ``memory_budget_bytes="lowest"``: per layer keep, offload or recompute, the fastest
   plan within 3% of the lowest peak. ``OffloadActivations`` warms up, calibrates and probes on
   its first three steps, plans on the fourth, and follows the plan from then on. On the CPU the
   planner works from the saved activations alone (there is no allocator to read);
4. every MLP under ``offload.selective_recompute`` (its SiLU and product recomputed in backward
   from the kept GEMM outputs) and the layers offloaded as in 2.

Each way's gradients must equal the plain step's bit for bit; the stats report of each is
printed. Exit code 1 if any gradient differs. Needs ``transformers`` (``pip install transformers``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Any, Optional

import torch

import offload
from offload.repeatable import repeatable_attention


def tiny_llama(device: torch.device, layers: int = 4, hidden: int = 128) -> tuple[Any, torch.Tensor]:
    """A random-weight Llama (SDPA attention, no KV cache) and a batch of token ids."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
        use_cache=False, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device)
    ids = torch.randint(0, config.vocab_size, (2, 64), device=device)
    return model, ids


def train_step(model: Any, ids: torch.Tensor, wrapper: Any = None) -> list[torch.Tensor]:
    """One step: the loss on the ids themselves, backward; returns the gradients."""
    model.zero_grad(set_to_none=True)
    with wrapper if wrapper is not None else contextlib.nullcontext():
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Every gradient equal bit for bit."""
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def main(argv: Optional[list[str]] = None) -> int:
    """Run the example; returns the exit code (1 if a gradient differs from plain's)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    args = parser.parse_args(argv)
    # Deterministic cuBLAS (the repeatable attention's deterministic mode) needs this before its
    # first use.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, ids = tiny_llama(device)
    layers = model.model.layers
    # The example's activations are small: min_offload_bytes=0 lets every one of them travel.
    options = {"device": device, "min_offload_bytes": 0}
    ok = True
    with repeatable_attention(device):
        expected = train_step(model, ids)
        if not bitwise_equal(expected, train_step(model, ids)):
            print("the plain step does not repeat itself here: the bitwise check would prove nothing")
            return 1

        oa = offload.OffloadActivations(layers, num_offload_layers=len(layers) - 1, **options)
        same = all(bitwise_equal(expected, train_step(model, ids, oa)) for _ in range(2))
        ok &= same
        print(f"OffloadActivations(model.model.layers): gradients bitwise equal to plain: {same}")
        print(oa.report(), "\n")
        oa.close()

        planned = offload.OffloadActivations(layers, memory_budget_bytes="lowest", **options)
        for _ in range(4):  # warm-up, calibration, probe, then the first planned step
            train_step(model, ids, planned)
        same = bitwise_equal(expected, train_step(model, ids, planned))
        ok &= same
        print(f"plan for the lowest peak: {planned.plan.describe() if planned.plan else 'none'}; "
              f"gradients bitwise equal to plain: {same}")
        print(planned.plan.table() if planned.plan else '')
        print(planned.report())
        planned.close()

        with offload.selective_recompute([layer.mlp for layer in layers]):
            oa = offload.OffloadActivations(layers, num_offload_layers=len(layers) - 1, **options)
            same = all(bitwise_equal(expected, train_step(model, ids, oa)) for _ in range(2))
            ok &= same
            print(f"selective_recompute(MLPs) + OffloadActivations: gradients bitwise equal to plain: {same}")
            oa.close()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
