"""FP8-MLP: bytes offloaded by the FP8 MLP block vs bf16 (target T6 of docs/benchmarks.md).

Stacks of 8 x the GPT-A MLP block (LayerNorm, Linear 4096->16384, GELU, Linear 16384->4096,
residual), batch 2 x seq 4096 tokens, bf16 parameters and inputs:

* FP8-MLP: ``offload.models.FP8MLPBlock``: ``fp8.LayerNormLinear`` (saves only the bf16 LN input
  and its per-row mean/rstd; the FP8 wgrad operand is recomputed in backward), ``fp8.GELU``
  (saves its input in FP8 e4m3), ``fp8.Linear`` (saves its columnwise FP8 input), tensorwise.
  Per token ~2h + 4h + 4h = 10h bytes.
* FP8-LINEAR-MLP: the earlier variant for reference, ``MLPBlock`` with ``fp8.Linear`` only
  (LayerNorm and GELU save bf16): 2h + h + 8h + 4h = 15h.
* BF16-MLP: ``MLPBlock`` with ``nn.Linear``: 2h + 2h + 8h + 8h = 20h.

Each runs plain and with offload v2 ``num_layers=7`` (default selection "auto"; the FP8 layers'
saved tensors are tagged with ``mark_activation_offload``).

Per run: step ms (CUDA events, median) and ratio to the same stack's plain run, peak GiB, bytes
offloaded (stats ``offloaded_bytes``) and per offloaded layer (/ 7), tensors offloaded, achieved
GB/s each way, compute wait ms.

T6: offloaded bytes per layer of the FP8-MLP stack <= 0.55 x the bf16 stack's; gradients (every
parameter and the input) bitwise equal with and without offload (checked for every stack, after
a plain-vs-plain control that shows the plain step repeats itself bit for bit).

A census of the tensors autograd saves in one layer (by submodule and dtype; '<self>' is the
functional GELU in MLPBlock.forward) is printed too, to show where the bytes are: in FP8-MLP the
LN input is the only bf16 activation (``ln_fc1``), the GELU input (``act``) and the fc2 input are
FP8.

Skips cleanly (exit 0, JSON with "skipped") when ``offload.fp8`` cannot be imported, lacks the
layers, or FP8 GEMMs are not supported on the device. Usage: ``python benchmarks/fp8_mlp.py
[--steps N]``; ``--cpu-smoke`` for a tiny CPU check. Writes ``benchmarks/results/fp8_mlp.json``.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch

import common
import measure
import workloads
from offload.models import run_layers

MiB = float(1 << 20)


def fp8_unavailable(env: common.Env) -> Optional[str]:
    """Why the FP8 stack cannot run here, or None."""
    try:
        from offload import fp8  # noqa: PLC0415 - lazy on purpose
    except Exception as exc:  # noqa: BLE001 - absent or broken: skip, do not crash
        return f"offload.fp8 cannot be imported ({type(exc).__name__}: {exc})"
    for attr in ("Linear", "LayerNormLinear", "GELU", "scaled_mm_supported"):
        if not hasattr(fp8, attr):
            return f"offload.fp8 has no {attr}"
    try:
        if not fp8.scaled_mm_supported(env.device):
            return f"FP8 GEMMs (torch._scaled_mm) are not supported on {common.device_name(env)}"
    except Exception as exc:  # noqa: BLE001
        return f"offload.fp8.scaled_mm_supported failed ({type(exc).__name__}: {exc})"
    return None


def gradients(layers: torch.nn.ModuleList, x: torch.Tensor, dy: torch.Tensor, ctx: Any = None, sync: Any = None) -> list[torch.Tensor]:
    """One forward/backward; every parameter's gradient and the input's, cloned."""
    params = list(layers.parameters())
    for p in params:
        p.grad = None
    x.grad = None
    y = run_layers(layers, x, ctx, sync)
    y.backward(dy)
    del y
    out = [p.grad.clone() for p in params] + [x.grad.clone()]
    for p in params:
        p.grad = None
    x.grad = None
    return out


def bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[bool, int]:
    """(all equal, index of the first different gradient or -1)."""
    for i, (u, v) in enumerate(zip(a, b)):
        if not torch.equal(u, v):
            return False, i
    return len(a) == len(b), -1


def check_bitwise(env: common.Env, layers: torch.nn.ModuleList, x: torch.Tensor, k: int) -> dict[str, Any]:
    """Plain twice (control), then offload for two steps (the second reuses the arena)."""
    g = torch.Generator(device=x.device).manual_seed(99)
    dy = torch.randn(x.shape, generator=g, device=x.device, dtype=x.dtype)
    ref = gradients(layers, x, dy)
    control, _ = bitwise_equal(ref, gradients(layers, x, dy))
    ctx, sync = measure.offload_context(env, k, len(layers))
    steps = []
    for _ in range(2):
        ok, first = bitwise_equal(ref, gradients(layers, x, dy, ctx, sync))
        steps.append({"equal": ok, "first_diff": first})
    offloaded = ctx.stats["offloaded_tensors"]
    del ctx, sync, ref
    common.free_memory(env)
    return {"plain_repeatable": control, "offload_steps": steps, "equal": all(s["equal"] for s in steps), "offloaded_tensors": offloaded}


def main(argv: Optional[list[str]] = None) -> int:
    parser = common.make_parser(__doc__, warmup=3, steps=10)
    parser.add_argument("--scaling", choices=["tensorwise", "rowwise"], default="tensorwise", help="FP8 Linear scaling")
    parser.add_argument("--no-bitwise", action="store_true", help="skip the gradient bitwise check")
    env = common.setup(parser, argv)
    args = env.args

    why = fp8_unavailable(env)
    if why is not None:
        print(f"SKIP fp8_mlp: {why}")
        common.write_json("fp8_mlp", env, {"skipped": why})
        return 0

    scale = workloads.scale_for(env.smoke)
    specs = [
        workloads.fp8_mlp(scale, fp8=True, scaling=args.scaling),
        workloads.fp8_mlp(scale, fp8=True, scaling=args.scaling, fp8_norm_act=False),
        workloads.fp8_mlp(scale, fp8=False),
    ]
    k = specs[0].layers - 1
    print(f"device: {common.device_name(env)}; torch {torch.__version__}; offload v2 num_layers={k}; "
          f"{args.warmup} warm-up + {args.steps} timed steps per variant")
    rows: list[dict[str, Any]] = []
    census: dict[str, Any] = {}
    bitwise: dict[str, Any] = {}
    for spec in specs:
        print(spec.describe())
        try:
            layers, make_input = spec.build(env.device)
        except Exception as exc:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            rows.append({"variant": f"{spec.name} (build)", "error": f"{type(exc).__name__}: {exc}"})
            continue
        x = make_input()
        try:
            c = measure.saved_tensor_census(layers[0], x.detach().clone().requires_grad_(True) * 1)
            census[spec.name] = {"by_module": c.by_module, "by_dtype": c.by_dtype, "total": c.total, "tensors": c.tensors}
        except Exception as exc:  # noqa: BLE001
            census[spec.name] = {"error": f"{type(exc).__name__}: {exc}"}
        common.free_memory(env)
        plain = measure.run_variant(env, f"{spec.name} plain", layers, x)
        off = measure.run_variant(env, f"{spec.name} offload k={k}", layers, x, offload={"num_layers": k})
        for r in (plain, off):
            r["stack"] = spec.name
        if "error" not in plain and "error" not in off:
            off["ratio"] = off["step_ms"] / plain["step_ms"]
            plain["ratio"] = 1.0
            if plain.get("peak_bytes") is not None:
                off["drop_gib"] = common.gib(plain["peak_bytes"] - off["peak_bytes"])
        if "error" not in off:
            off["per_layer_bytes"] = off["offloaded_bytes"] / k
            off["per_layer_mib"] = off["per_layer_bytes"] / MiB
        rows += [plain, off]
        if not args.no_bitwise:
            try:
                bitwise[spec.name] = check_bitwise(env, layers, x, k)
            except Exception as exc:  # noqa: BLE001
                import traceback

                traceback.print_exc()
                bitwise[spec.name] = {"error": f"{type(exc).__name__}: {exc}", "equal": None}
            b = bitwise[spec.name]
            for r in (plain, off):
                r["grads_bitwise"] = b.get("equal") if "stats" in r else b.get("plain_repeatable")
        del layers, x, make_input
        common.free_memory(env)

    # -- target T6 ------------------------------------------------------------------------------
    fp8_name, bf16_name = specs[0].name, specs[-1].name
    off_rows = {r["stack"]: r for r in rows if "stack" in r and "stats" in r and "error" not in r}
    off_fp8, off_bf16 = off_rows.get(fp8_name), off_rows.get(bf16_name)
    ratio = off_fp8["per_layer_bytes"] / off_bf16["per_layer_bytes"] if off_fp8 and off_bf16 else None
    bytes_ok = None if ratio is None else ratio <= 0.55
    grads_ok: Optional[bool] = None
    if len(bitwise) == len(specs) and all(b.get("equal") is not None for b in bitwise.values()):
        grads_ok = all(b["equal"] for b in bitwise.values())
    t6 = None if bytes_ok is None or grads_ok is None else (bytes_ok and grads_ok)
    if args.no_bitwise:
        t6 = bytes_ok if bytes_ok is False else None

    def vs_bf16(per_stack: dict[str, Any], key: str) -> dict[str, Optional[float]]:
        """Each FP8 stack's ``key`` over the bf16 stack's."""
        base = (per_stack.get(bf16_name) or {}).get(key)
        out: dict[str, Optional[float]] = {}
        for spec in specs[:-1]:
            v = (per_stack.get(spec.name) or {}).get(key)
            out[spec.name] = v / base if v and base else None
        return out

    offload_ratios = vs_bf16(off_rows, "per_layer_bytes")
    census_ratios = vs_bf16(census, "total")
    lines = [
        f"T6 {common.verdict(t6)}  offloaded bytes per layer: FP8 {common.fmt(off_fp8 and off_fp8['per_layer_mib'], '.1f')} MiB vs "
        f"bf16 {common.fmt(off_bf16 and off_bf16['per_layer_mib'], '.1f')} MiB = {common.fmt(ratio, '.3f')}x (need <= 0.55) "
        f"[{common.verdict(bytes_ok)}]; gradients bitwise equal to no offload: "
        + (", ".join(f"{n} {common.verdict(b.get('equal'))} (plain repeatable: {common.fmt(b.get('plain_repeatable'))})"
                     for n, b in bitwise.items()) or "not checked"),
        "     offloaded bytes per layer vs bf16: "
        + ", ".join(f"{n} {common.fmt(v, '.3f')}x" for n, v in offload_ratios.items())
        + "; census of one layer's saved tensors vs bf16: "
        + ", ".join(f"{n} {common.fmt(v, '.3f')}x" for n, v in census_ratios.items()),
    ]
    targets = {"T6": {"ok": t6, "bytes_ratio": ratio, "bytes_ok": bytes_ok, "grads_ok": grads_ok,
                      "offloaded_ratio_vs_bf16": offload_ratios, "census_total_ratio_vs_bf16": census_ratios}}

    failed = [r["variant"] for r in rows if "error" in r]
    common.write_json("fp8_mlp", env, {
        "workloads": [s.describe() for s in specs],
        "num_layers": k,
        "targets": targets,
        "census_one_layer": census,
        "bitwise": bitwise,
        "rows": rows,
        "failed": failed,
    })

    print("\nsaved tensors of one layer (MiB, by submodule / dtype; '<self>' = MLPBlock's functional GELU):")
    for name, c in census.items():
        if "error" in c:
            print(f"  {name}: census failed: {c['error']}")
            continue
        mods = ", ".join(f"{m} {v / MiB:.1f}" for m, v in c["by_module"].items())
        dts = ", ".join(f"{d} {v / MiB:.1f}" for d, v in c["by_dtype"].items())
        print(f"  {name}: total {c['total'] / MiB:.1f} in {c['tensors']} tensors | {mods} | {dts}")
    print("\ntargets (measured in this run):")
    for line in lines:
        print("  " + line)
    for r in rows:
        if "error" in r:
            r["variant"] += " (FAILED)"
    common.print_table(f"FP8-MLP vs FP8-LINEAR-MLP vs BF16-MLP ({common.device_name(env)})", rows, [
        ("variant", "variant", ""),
        ("step_ms", "step ms", ".2f"),
        ("ratio", "x plain", ".3f"),
        ("peak_gib", "peak GiB", ".2f"),
        ("drop_gib", "drop GiB", ".2f"),
        ("offloaded_gib", "offl GiB", ".3f"),
        ("per_layer_mib", "MiB/layer", ".1f"),
        ("offloaded_tensors", "tensors", ""),
        ("d2h_gbps", "D2H GB/s", ".1f"),
        ("h2d_gbps", "H2D GB/s", ".1f"),
        ("wait_ms", "wait ms", ".2f"),
        ("grads_bitwise", "bitwise", ""),
    ])
    return common.exit_status(failed)


if __name__ == "__main__":
    sys.exit(main())
