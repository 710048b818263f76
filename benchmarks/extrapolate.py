"""EXTRAPOLATE (issue 33): how well one probe predicts other batch shapes.

LLAMA-1B's HF shape (hidden 2048, 16 layers, bf16, SDPA), batch 4. The planner probes one length
(``--probe-length``, default 2048) and :func:`offload.planner.scaling.profile_at` predicts the
profile at each of ``--lengths``; a probe at that length measures it. Per length: the relative
error of the prediction for the layers' saved bytes and a checkpoint's inputs (summed over the
layers), their forward and backward times, the head's peak bytes and time, and the plain step's
peak and time as the cost model predicts them from each profile.

    python benchmarks/extrapolate.py                      # on the H100: ~2 minutes
    python benchmarks/extrapolate.py --cpu-smoke          # a tiny model on the CPU

Writes benchmarks/results/extrapolate.json (``--out``) and prints one row per length.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

import offload
from offload.planner.scaling import profile_at
from offload.planner.shapes import StepShape


def _model(smoke: bool, device: str) -> Any:
    import transformers

    if smoke:
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                          max_position_embeddings=256, use_cache=False)
        dtype = torch.float32
    else:
        config = transformers.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                          num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                          max_position_embeddings=131072, use_cache=False,
                                          attn_implementation="sdpa")
        dtype = torch.bfloat16
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype)


def _profile(model: Any, batch: int, length: int, device: str, min_offload_bytes: int) -> offload.planner.StepProfile:
    ids = torch.randint(0, model.config.vocab_size, (batch, length), device=device)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    return offload.planner.profile_step(model.model.layers, step, device=device, warmup_steps=1,
                                        min_offload_bytes=min_offload_bytes)


def _figures(p: offload.planner.StepProfile) -> dict[str, float]:
    return {
        "saved_bytes": sum(l.saved_bytes for l in p.layers),
        "input_bytes": sum(l.input_bytes for l in p.layers),
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
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "extrapolate.json"))
    args = parser.parse_args()
    device = "cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda"
    probe_length = 24 if args.cpu_smoke else args.probe_length
    lengths = [40, 64] if args.cpu_smoke else [int(n) for n in args.lengths.split(",")]
    model = _model(args.cpu_smoke, device)
    start = time.perf_counter()
    # The smoke model's tensors are all below the default 64 KiB floor at its probe's length.
    floor = 0 if args.cpu_smoke else offload.api.DEFAULT_MIN_OFFLOAD_BYTES
    probe = _profile(model, args.batch, probe_length, device, floor)
    rows: list[dict[str, Any]] = []
    for length in lengths:
        predicted = _figures(profile_at(probe, StepShape(args.batch, length)))
        measured = _figures(_profile(model, args.batch, length, device, floor))
        errors = {k: (predicted[k] - measured[k]) / measured[k] if measured[k] else 0.0 for k in measured}
        rows.append({"length": length, "predicted": predicted, "measured": measured, "error": errors})
        print(f"length {length:>6} (probe {probe_length}): " + ", ".join(
            f"{k} {100 * v:+.1f}%" for k, v in errors.items()), flush=True)
    doc = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "batch": args.batch,
           "probe_length": probe_length, "probe_kind": probe.probe, "rows": rows,
           "seconds": time.perf_counter() - start}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
