"""FP8 end to end on real model code: HF LlamaForCausalLM at the LLAMA-2B shape, bf16 against FP8.

One model, one process. Its decoder Linears run first in bf16, then converted in place by
``offload.fp8.convert`` (the same Parameters: nothing else changes between the two) with the
layers' norms and MLPs swapped by ``offload.fp8.convert_llama_ops`` for the FP8-saving
``fp8.RMSNorm`` and ``fp8.SwiGLUMLP`` (one more FP8 plain row, "Linears only", leaves them out),
then, when torchao is importable, as torchao's Float8Linear (``convert_to_float8_training``, eager,
HF's own norms and MLPs). The LM head stays bf16 in every contender. Per precision:

  plain; ``OffloadActivations(layers, num_offload_layers=k)`` for each ``--ks``; and the planner
  (``offload.planner``: one probe, then the fastest plan) at one common budget, ``--budget`` x bf16
  plain's measured peak. FP8 plain also runs with ``weight_layouts="both"`` (the weight cache's
  other setting: both FP8 layouts cached, no transpose in backward).

Reported per contender: step time (median of ``--steps`` CUDA-event-timed steps after
``--warmup``), peak (``max_memory_allocated`` over the timed steps, reset per contender),
tokens/s, the FP8 weight cache's bytes, ratios to bf16 plain, and the loss of one forward
(FP8 against bf16: a sanity check, not a tolerance test). On the GPU, also what the weight
cache's one layout costs: the FP8 transposes of a step, Triton kernel against torch's copy.

Targets (docs/benchmarks.md): T18 FP8 plain step <= 0.75x bf16 plain at a peak <= 0.90x;
T19 FP8 plan at 75% of bf16 plain's peak, step <= 0.80x bf16 plain.

Writes benchmarks/results/fp8_llama.json and, with matplotlib, fp8_llama.png.

    python benchmarks/fp8_llama.py                  # on the GPU (a few minutes)
    python benchmarks/fp8_llama.py --ks 4 --no-torchao
    python benchmarks/fp8_llama.py --cpu-smoke      # a tiny Llama on the CPU: checks the script
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Env, free_memory, make_parser, print_table, setup, verdict, write_json  # noqa: E402
from measure import timed_row  # noqa: E402
from pareto import plot  # noqa: E402
from workloads import LlamaSpec, llama_2b, llama_step  # noqa: E402

import offload  # noqa: E402
from offload import fp8  # noqa: E402

# --cpu-smoke's model: LLAMA-2B's 8 layers (so the k sweep is the same) at widths where torch's
# CPU _scaled_mm (about 0.03 GFLOP/s) finishes a step in about a second. Every dim is a
# multiple of 16, as FP8 GEMMs need; float32, since this CPU's bf16 matmuls at these sizes took
# milliseconds each.
SMOKE_SPEC = LlamaSpec("LLAMA-2B (CPU smoke)", hidden=32, intermediate=64, layers=8, heads=2, kv_heads=1,
                       batch=2, seq=16, vocab=128, dtype=torch.float32)
TARGETS = {"T18_step": 0.75, "T18_peak": 0.90, "T19_step": 0.80}


def decoder_only(module: torch.nn.Module, name: str) -> bool:
    """Convert the decoder layers' Linears, not the LM head (as torchao's docs advise)."""
    return name != "lm_head"


def to_fp8(model: torch.nn.Module, weight_layouts: str, ops: bool = True) -> fp8.ConvertSummary:
    """Our FP8, one call: the decoder Linears as fp8.Linear and, with ``ops`` (convert's
    default), the norms and MLPs as the FP8-saving ``fp8.RMSNorm`` and ``fp8.SwiGLUMLP``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the CPU warning, in --cpu-smoke
        return fp8.convert(model, module_filter_fn=decoder_only, weight_layouts=weight_layouts, llama_ops=ops)


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


class Bench:
    """The contenders of one model, timed in one process; rows in the order run."""

    def __init__(self, env: Env, spec: LlamaSpec) -> None:
        self.env = env
        self.spec = spec
        self.model, self.ids = spec.build(env.device)
        self.layers = self.model.model.layers
        self.rows: list[dict[str, Any]] = []
        self.tokens = spec.batch * spec.seq
        # --cpu-smoke's tensors are all below the default 64 KiB threshold: offload them anyway.
        self.offload_kw: dict[str, Any] = {"device": env.offload_device, **({"min_offload_bytes": 0} if env.smoke else {})}

    def row(self, precision: str, label: str, wrapper: Optional[Callable[[], Any]] = None, **extra: Any) -> dict[str, Any]:
        row = timed_row(self.env, f"{precision} {label}", llama_step(self.model, self.ids, wrapper),
                        precision=precision, **extra)
        row["weight_cache_bytes"] = fp8.weight_cache_bytes(self.layers)  # after its steps: filled
        if row.get("step_ms"):
            row["tokens_per_s"] = self.tokens / (row["step_ms"] / 1e3)
        self.rows.append(row)
        return row

    def offloaded(self, precision: str, ks: list[int]) -> None:
        for k in ks:
            oa = offload.OffloadActivations(self.layers, num_offload_layers=k, **self.offload_kw)
            self.row(precision, f"offload k={k}", lambda oa=oa: oa, k=k)
            oa.close()

    def planned(self, precision: str, budget: Optional[int], budget_label: str) -> Optional[int]:
        """The planner's plan at ``budget`` (None: 75% of this model's own probe, for --cpu-smoke,
        where no peak is measured). Returns the budget used."""
        profile = offload.planner.profile_step(self.layers, llama_step(self.model, self.ids), **self.offload_kw)
        free_memory(self.env)
        if budget is None:
            budget = int(self.env.args.budget * profile.plain_peak_bytes)
        try:
            plan = offload.planner.choose(profile, budget)
        except ValueError as exc:
            self.rows.append({"variant": f"{precision} plan @ {budget_label}", "precision": precision, "error": str(exc)})
            print(f"  {precision} plan: {exc}")
            return budget
        oa = offload.OffloadActivations(self.layers, plan=plan, **self.offload_kw)
        self.row(precision, f"plan @ {budget_label}", lambda: oa, budget=budget, plan=plan.describe(),
                 predicted_step_ms=plan.prediction.step_ms, predicted_peak_bytes=plan.prediction.peak_bytes)
        oa.close()
        return budget

    def torchao(self, ks: list[int]) -> Optional[str]:
        """torchao's float8 training Linears on the decoder, eager; a note when it cannot run."""
        try:
            from torchao.float8 import convert_to_float8_training
        except ImportError as exc:
            return f"torchao not importable ({exc}); its rows are left out"
        # Back to nn.Linear and HF's own norms and MLPs (the same Parameters) for torchao's swap.
        fp8.unconvert(self.model)
        try:
            convert_to_float8_training(self.layers)
        except Exception as exc:  # noqa: BLE001 - a torchao that refuses this torch/GPU: say so
            return f"torchao convert_to_float8_training failed: {type(exc).__name__}: {exc}"
        self.loss["torchao"] = loss_of(self.model, self.ids)
        self.row("torchao", "plain")
        self.offloaded("torchao", ks)
        return None

    def run(self, ks: list[int], with_torchao: bool) -> dict[str, Any]:
        env = self.env
        print(f"\n{self.spec.describe()}", flush=True)
        # The baseline's name: bf16, or fp32 in --cpu-smoke (see SMOKE_SPEC).
        base = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(self.spec.dtype, str(self.spec.dtype))
        self.loss = {base: loss_of(self.model, self.ids)}
        bf16 = self.row(base, "plain")
        self.offloaded(base, ks)
        measured = bf16.get("peak_bytes")
        label = f"{env.args.budget:.0%} of {base} plain"
        budget = self.planned(base, int(env.args.budget * measured) if measured else None, label)

        # Part 3's share: the Linears alone first (norms and SwiGLU saving bf16), then every op.
        to_fp8(self.model, "one", ops=False)
        self.row("FP8", "plain (Linears only)", weight_layouts="one")
        fp8.unconvert(self.model)
        converted = to_fp8(self.model, "both")
        self.loss["FP8"] = loss_of(self.model, self.ids)
        self.row("FP8", "plain (both layouts)", weight_layouts="both")
        fp8.unconvert(self.model)
        to_fp8(self.model, "one")
        fp8_plain = self.row("FP8", "plain", weight_layouts="one")
        self.offloaded("FP8", ks)
        self.planned("FP8", budget, label)
        llama_ops = str(converted.llama_ops)  # what the FP8 rows ran
        note = self.torchao(ks) if with_torchao else "torchao left out (--no-torchao)"
        if note:
            print(f"  {note}")

        for r in self.rows:
            if r.get("step_ms") and bf16.get("step_ms"):
                r["x_plain"] = r["step_ms"] / bf16["step_ms"]
            if r.get("peak_bytes") and measured:
                r["peak_x_bf16"] = r["peak_bytes"] / measured
        print_table(f"{self.spec.name}: {base} against FP8 (ratios to {base} plain, one process)", self.rows, [
            ("variant", "contender", ""), ("step_ms", "step ms", ".1f"), ("x_plain", f"x {base}", ".3f"),
            ("peak_gib", "peak GiB", ".2f"), ("peak_x_bf16", f"peak x {base}", ".3f"),
            ("tokens_per_s", "tokens/s", ".0f"), ("weight_cache_bytes", "FP8 cache B", ""),
        ])
        print(f"  loss of one forward: {', '.join(f'{k} {v:.4f}' for k, v in self.loss.items())}")
        plan_row = next((r for r in self.rows if r["variant"].startswith("FP8 plan")), {})
        targets = check_targets(bf16, fp8_plain, plan_row)
        return {"workload": self.spec.describe(), "converted": len(converted.converted), "llama_ops": llama_ops,
                "budget_bytes": budget,
                "rows": self.rows, "loss": self.loss, "targets": targets, "torchao": note or "eager, tensorwise",
                "transposes": transpose_costs(env, self.layers)}


def transpose_costs(env: Env, layers: torch.nn.Module, reps: int = 20) -> Optional[dict[str, Any]]:
    """What one layout costs per step: the FP8 transposes dgrad's operands need (one per weight
    and backward), by the Triton kernel and by torch's copy of the transposed view, CUDA-event
    timed per weight shape and summed over the decoder's weights."""
    if not env.cuda:
        return None
    from offload.fp8 import cast
    from offload.fp8.weights import quantize_weight

    shapes: dict[tuple[int, int], int] = {}
    for m in layers.modules():
        if isinstance(m, torch.nn.Linear):
            shapes[tuple(m.weight.shape)] = shapes.get(tuple(m.weight.shape), 0) + 1
    out: dict[str, Any] = {"shapes": [], "triton_ms_per_step": 0.0, "torch_ms_per_step": 0.0}
    for shape, count in shapes.items():
        row = quantize_weight(torch.randn(shape, device=env.device, dtype=torch.bfloat16), "tensorwise").fprop.t()
        figures = {"shape": list(shape), "count": count}
        for name, fn in (("triton", cast.transpose), ("torch", lambda t: t.t().contiguous())):
            fn(row)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn(row)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end) / reps
            figures[f"{name}_ms"] = ms
            figures[f"{name}_gbps"] = 2 * row.numel() / ms / 1e6  # bytes read and written
            out[f"{name}_ms_per_step"] += ms * count
        out["shapes"].append(figures)
    print(f"  one layout's transposes per step: Triton {out['triton_ms_per_step']:.2f} ms, "
          f"torch copy {out['torch_ms_per_step']:.2f} ms "
          f"({', '.join(f'{s[0]}x{s[1]}: {f:.0f} GB/s' for s, f in ((f['shape'], f['triton_gbps']) for f in out['shapes']))})")
    return out


def check_targets(bf16: dict[str, Any], fp8_plain: dict[str, Any], fp8_plan: dict[str, Any]) -> list[dict[str, Any]]:
    """T18 and T19 as met / missed (None: not measured, e.g. no peak on the CPU)."""
    out = []
    b_ms, b_peak = bf16.get("step_ms"), bf16.get("peak_bytes")
    f_ms, f_peak = fp8_plain.get("step_ms"), fp8_plain.get("peak_bytes")
    if b_ms and f_ms:
        peak = f_peak / b_peak if f_peak and b_peak else None
        ok = None if peak is None else f_ms <= TARGETS["T18_step"] * b_ms and peak <= TARGETS["T18_peak"]
        out.append({"target": "T18", "ok": ok, "figure": f"FP8 plain step {f_ms / b_ms:.3f}x bf16 plain (<= 0.75), peak "
                    + (f"{peak:.3f}x (<= 0.90)" if peak is not None else "not measured")})
    p_ms = fp8_plan.get("step_ms")
    if b_ms and p_ms:
        out.append({"target": "T19", "ok": p_ms <= TARGETS["T19_step"] * b_ms,
                    "figure": f"FP8 plan step {p_ms / b_ms:.3f}x bf16 plain (<= 0.80)"})
    for t in out:
        print(f"  {t['target']:<6} {verdict(t['ok'])}  {t['figure']}")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = make_parser(__doc__, warmup=3, steps=10, smoke_warmup=1, smoke_steps=1)
    parser.add_argument("--ks", default="4,7", help="fixed offload counts (default 4,7)")
    parser.add_argument("--budget", type=float, default=0.75, help="the plans' budget as a fraction of bf16 plain's peak")
    parser.add_argument("--no-torchao", action="store_true", help="leave out torchao's float8 Linears")
    env = setup(parser, argv)
    spec = SMOKE_SPEC if env.smoke else llama_2b()
    ks = [k for k in (int(v) for v in env.args.ks.split(",")) if 0 < k < spec.layers]
    result = Bench(env, spec).run(ks, with_torchao=not env.args.no_torchao)
    write_json("fp8_llama", env, {"results": result})
    if not env.args.no_json:
        folder = common.RESULTS_DIR / "smoke" if env.smoke else common.RESULTS_DIR
        plot({spec.name: result}, folder / f"{env.args.name or 'fp8_llama'}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
