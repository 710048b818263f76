"""LLAMA-2B (HF ``LlamaForCausalLM``): what the FP8 ops around the GEMMs save, and what they cost.

Three variants of one model, in one process (issue 27, part 3):

* ``bf16``: the model as built.
* ``fp8_linear``: the decoder layers' ``nn.Linear``s swapped for ``fp8.Linear`` by
  ``offload.fp8.convert(model.model.layers)`` (the LM head stays bf16).
* ``fp8_ops``: then ``offload.fp8.convert_llama_ops(model)``: ``fp8.RMSNorm`` (saves its input and
  rstd; q/k/v and gate/up share one quantization of its output and remake their wgrad operand)
  and ``fp8.SwiGLUMLP`` (saves FP8 gate and up; down_proj remakes its wgrad operand).

Per variant: plain step time (CUDA events, median), tokens/s, peak GiB, and the bytes one
decoder layer saves per token (saved-tensor census, each storage once, parameters left out), by
submodule. Targets to read it against: issue 27's T18 (FP8 step <= 0.75x bf16 at a peak <=
0.90x) needs the weight-cache work of part 2 as well; this script shows part 3's share.

Needs ``offload.fp8.convert`` (issue 27, part 1): without it the script says so and exits 0.
Usage: ``python benchmarks/fp8_llama_ops.py [--steps N]``; ``--cpu-smoke`` for a tiny CPU check.
Writes ``benchmarks/results/fp8_llama_ops.json``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

import common
import workloads


class _CallLayer(nn.Module):
    """A decoder layer called as ``layer(hidden_states)``, with the model's rotary embeddings."""

    def __init__(self, model: nn.Module, index: int) -> None:
        super().__init__()
        self.layer = model.model.layers[index]
        object.__setattr__(self, "rotary", model.model.rotary_emb)  # not a submodule

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(h.shape[1], device=h.device)[None].expand(h.shape[0], -1)
        out = self.layer(h, position_embeddings=self.rotary(h, positions))
        return out[0] if isinstance(out, tuple) else out


def census(env: common.Env, model: nn.Module, spec: workloads.LlamaSpec) -> dict[str, Any]:
    """Bytes decoder layer 0 saves, per token, in total and by submodule."""
    x = torch.randn(spec.batch, spec.seq, spec.hidden, device=env.device, dtype=spec.dtype, requires_grad=True)
    c = common.saved_tensor_census(_CallLayer(model, 0), x * 1)
    tokens = spec.batch * spec.seq
    del x
    common.free_memory(env)
    return {"per_token": c.total / tokens, "by_module_per_token": {k: v / tokens for k, v in c.by_module.items()},
            "tensors": c.tensors}


def run(env: common.Env, label: str, model: nn.Module, ids: torch.Tensor, spec: workloads.LlamaSpec) -> dict[str, Any]:
    row: dict[str, Any] = {"variant": label, **census(env, model, spec)}
    timing = common.time_steps(workloads.llama_step(model, ids), env)
    row.update(step_ms=timing.median_ms, peak_bytes=timing.peak_bytes, peak_gib=common.gib(timing.peak_bytes),
               tokens_per_s=spec.batch * spec.seq / (timing.median_ms / 1e3), timing=timing.summary())
    common.free_memory(env)
    print(f"  {label:<12} {row['step_ms']:.1f} ms/step, peak {common.fmt(row['peak_gib'], '.2f')} GiB, "
          f"layer saves {row['per_token']:.0f} B/token", flush=True)
    return row


def main(argv: Optional[list[str]] = None) -> int:
    parser = common.make_parser(__doc__, warmup=3, steps=10)
    env = common.setup(parser, argv)
    from offload import fp8  # noqa: PLC0415

    convert = getattr(fp8, "convert", None)
    why = None if convert is not None else "offload.fp8.convert is missing (issue 27, part 1)"
    if why is None and not fp8.scaled_mm_supported(env.device):
        why = f"FP8 GEMMs are not supported on {common.device_name(env)}"
    if why is not None:
        print(f"SKIP fp8_llama_ops: {why}")
        common.write_json("fp8_llama_ops", env, {"skipped": why})
        return 0
    spec = workloads.llama_2b(workloads.scale_for(env.smoke))
    print(f"device: {common.device_name(env)}; torch {torch.__version__}; {spec.describe()}")
    model, ids = spec.build(env.device)
    rows = [run(env, "bf16", model, ids, spec)]
    convert(model.model.layers)
    rows.append(run(env, "fp8_linear", model, ids, spec))
    summary = fp8.convert_llama_ops(model)
    print(f"  {summary}")
    rows.append(run(env, "fp8_ops", model, ids, spec))
    base = rows[0]
    for r in rows:
        r["step_vs_bf16"] = r["step_ms"] / base["step_ms"]
        r["peak_vs_bf16"] = r["peak_bytes"] / base["peak_bytes"] if r["peak_bytes"] and base["peak_bytes"] else None
        r["saved_vs_bf16"] = r["per_token"] / base["per_token"]
    common.print_table(
        f"{spec.name}, plain steps", rows,
        [("variant", "variant", ""), ("step_ms", "step ms", ".1f"), ("step_vs_bf16", "x bf16", ".3f"),
         ("tokens_per_s", "tokens/s", ".0f"), ("peak_gib", "peak GiB", ".2f"), ("peak_vs_bf16", "x bf16", ".3f"),
         ("per_token", "layer B/token", ".0f"), ("saved_vs_bf16", "x bf16", ".3f")],
    )
    common.write_json("fp8_llama_ops", env, {"spec": spec.describe(), "convert_llama_ops": str(summary), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
