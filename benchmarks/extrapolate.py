"""EXTRAPOLATE (issue 33): how well one probe predicts other batch shapes.

LLAMA-1B's HF shape (hidden 2048, 16 layers, bf16, SDPA), batch 4. The planner probes one length
(``--probe-length``, default 2048) and :func:`offload.planner.scaling.profile_at` predicts the
profile at each of ``--lengths``; a probe at that length measures it. Per length: the relative
error of the prediction for the layers' saved bytes and a checkpoint's inputs (summed over the
layers), their transient peaks (forward and backward), their forward and backward times, the
head's peak bytes and time, and the plain step's peak and time as the cost model predicts them
from each profile; and the plain step's peak as measured. ``--attention eager`` (HF's eager
attention) or ``math`` (SDPA's math backend) materializes the scores, which grow with the length
squared; ``--model small`` is a hidden-256, 3-layer Llama for such runs at long lengths.

    python benchmarks/extrapolate.py                      # on the H100: ~2 minutes
    python benchmarks/extrapolate.py --attention eager --model small --batch 1 \
        --probe-length 1024 --lengths 4096,16384 --out benchmarks/results/extrapolate_eager.json
    python benchmarks/extrapolate.py --cpu-smoke          # a tiny model on the CPU

Writes benchmarks/results/extrapolate.json (``--out``) and prints one row per length.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import offload
from offload.planner.scaling import profile_at
from offload.planner.shapes import StepShape


# --model: (hidden, intermediate, layers, heads, key/value heads, vocabulary).
MODELS = {"1b": (2048, 8192, 16, 32, 8, 32000), "small": (256, 704, 3, 4, 2, 32000)}


def _model(smoke: bool, device: str, size: str, attention: str) -> Any:
    import transformers

    implementation = "eager" if attention == "eager" else "sdpa"
    if smoke:
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                          max_position_embeddings=256, use_cache=False,
                                          attn_implementation=implementation)
        dtype = torch.float32
    else:
        hidden, intermediate, layers, heads, kv_heads, vocab = MODELS[size]
        config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                                          num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                                          max_position_embeddings=131072, use_cache=False,
                                          attn_implementation=implementation)
        dtype = torch.bfloat16
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype)


def _backend(attention: str) -> Any:
    # SDPA's math backend materializes the scores as eager attention does.
    return sdpa_kernel([SDPBackend.MATH]) if attention == "math" else contextlib.nullcontext()


def _step(model: Any, batch: int, length: int, device: str, attention: str) -> Any:
    ids = torch.randint(0, model.config.vocab_size, (batch, length), device=device)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with _backend(attention):
            model(input_ids=ids, labels=ids).loss.backward()

    return step


def _profile(step: Any, model: Any, device: str, min_offload_bytes: int) -> offload.planner.StepProfile:
    return offload.planner.profile_step(model.model.layers, step, device=device, warmup_steps=1,
                                        min_offload_bytes=min_offload_bytes)


def _plain_peak(step: Any, device: str) -> int:
    # The plain step's peak as measured (0 on the CPU, which has no such counter).
    if device != "cuda":
        return 0
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def _figures(p: offload.planner.StepProfile) -> dict[str, float]:
    return {
        "saved_bytes": sum(l.saved_bytes for l in p.layers),
        "input_bytes": sum(l.input_bytes for l in p.layers),
        "forward_peak_bytes": sum(l.forward_peak_bytes for l in p.layers),
        "backward_peak_bytes": sum(l.backward_peak_bytes for l in p.layers),
        "forward_ms": sum(l.forward_ms for l in p.layers),
        "backward_ms": sum(l.backward_ms for l in p.layers),
        "attention_ms": sum(l.attention_forward_ms + l.attention_backward_ms for l in p.layers),
        "head_bytes": p.head_bytes,
        "head_ms": p.head_ms,
        "plain_peak_bytes": p.plain_peak_bytes,
        "plain_step_ms": p.plain_step_ms,
    }


def main() -> None:
    """Probe one length, predict the others, measure them; print and write the errors."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--probe-length", type=int, default=2048)
    parser.add_argument("--lengths", default="1024,4096,8192")
    parser.add_argument("--model", choices=sorted(MODELS), default="1b")
    parser.add_argument("--attention", choices=("sdpa", "eager", "math"), default="sdpa",
                        help="sdpa (torch picks the kernel), eager (HF's), math (SDPA's math backend)")
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "extrapolate.json"))
    args = parser.parse_args()
    device = "cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda"
    probe_length = 24 if args.cpu_smoke else args.probe_length
    lengths = [40, 64] if args.cpu_smoke else [int(n) for n in args.lengths.split(",")]
    model = _model(args.cpu_smoke, device, args.model, args.attention)
    start = time.perf_counter()
    # The smoke model's tensors are all below the default 64 KiB floor at its probe's length.
    floor = 0 if args.cpu_smoke else offload.api.DEFAULT_MIN_OFFLOAD_BYTES
    probe = _profile(_step(model, args.batch, probe_length, device, args.attention), model, device, floor)
    rows: list[dict[str, Any]] = []
    for length in lengths:
        step = _step(model, args.batch, length, device, args.attention)
        predicted = _figures(profile_at(probe, StepShape(args.batch, length)))
        measured = _figures(_profile(step, model, device, floor))
        errors = {k: (predicted[k] - measured[k]) / measured[k] if measured[k] else 0.0 for k in measured}
        plain_peak = _plain_peak(step, device)
        if plain_peak:  # the prediction against the plain step itself, not against its model
            errors["plain_peak_run"] = predicted["plain_peak_bytes"] / plain_peak - 1
        rows.append({"length": length, "predicted": predicted, "measured": measured, "error": errors,
                     "plain_peak_measured": plain_peak})
        print(f"length {length:>6} (probe {probe_length}): " + ", ".join(
            f"{k} {100 * v:+.1f}%" for k, v in errors.items()), flush=True)
    doc = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "batch": args.batch,
           "model": "smoke" if args.cpu_smoke else args.model, "attention": args.attention,
           "probe_length": probe_length, "probe_kind": probe.probe, "rows": rows,
           "seconds": time.perf_counter() - start}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
