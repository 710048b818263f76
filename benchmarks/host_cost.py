"""What offload adds to a host-bound step (T5a, T5c): SMALL, MOE or GPT-A against plain, the
saved-tensor hooks' floor and ``save_on_cpu``, with small layers sharing one copy (``group_bytes``,
issue 35) or not, and the native hooks or the Python ones. (``group_bytes.py`` until issue 50;
its runs are the ``group_bytes*.json`` that docs/benchmarks.md quotes.)

SMALL (16 x Linear 1024 + GELU, 256 tokens, bf16; TransformerEngine's call shape, 15 layers
offloaded, every activation however small) is host-bound: each layer's group moves 1 MiB, and
the fixed host work per group (close, D2H and H2D submissions, their events, the waits) costs
more than the transfer. The variants, in their order: plain; offload with the defaults
(``group_bytes`` 32 MiB: one group; the native saved-tensor hooks, issue 35's sixth round); the
same with the Python hooks (``OFFLOAD_NATIVE_HOOKS=0``); ``group_bytes`` of 0 (off: every layer a
group, the default before issue 35's fourth round), 4 and 16 MiB (4 groups and 1); the hooks'
floor (``measure.HooksFloor``), with Python hooks and with C ones (``Tensor.detach``);
offload with a host budget of 0 (every decision made, nothing copied); ``save_on_cpu``.

Two ways to time them, both in one process:

- ``--interleave`` (the one to quote): every variant's context is built up front, and each cycle
  times one step of each in turn (``benchmarks/interleave.py``); ``--steps`` cycles, ratios per
  cycle, then their median. Drift on the H100 VM (27-36% between blocks of steps) falls on every
  variant alike.
- rounds (``--rounds``): each variant times ``--steps`` steps as a block, the variants in turn,
  each round starting one variant later (see :func:`one_round`); the ratios are per round. The
  method of the fourth and fifth rounds, kept to reproduce their figures.

``--workload moe`` runs the same variants on MOE (8 layers of 64 experts, T5c), whose layers
of about 10 MiB share groups too; ``--workload gpt_a`` on GPT-A (whose layers are each a group of
their own anyway), for the <= 1% check of a change to the default path. ``--variants`` keeps the
listed ones (comma-separated labels; plain always runs).

Usage: ``python benchmarks/host_cost.py [--workload small|moe|gpt_a] [--interleave]
[--rounds 4] [--steps 100] [--variants LABELS]``; ``--cpu-smoke`` for a tiny CPU check. Writes
``benchmarks/results/host_cost[_<workload>][_interleaved].json`` (no suffix for SMALL).
"""

from __future__ import annotations

import contextlib
import os
import statistics
from typing import Any, Iterator, Optional

import common
import interleave
import measure
import workloads

GROUP_MIB = (0, 4, 16)


@contextlib.contextmanager
def python_hooks(on: bool) -> Iterator[None]:
    """Contexts made inside push the Python saved-tensor hooks if ``on`` (``OFFLOAD_NATIVE_HOOKS=0``);
    else the defaults apply."""
    if not on:
        yield
        return
    before = os.environ.get("OFFLOAD_NATIVE_HOOKS")
    os.environ["OFFLOAD_NATIVE_HOOKS"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["OFFLOAD_NATIVE_HOOKS"]
        else:
            os.environ["OFFLOAD_NATIVE_HOOKS"] = before


def variants(spec: Any, keep: Optional[list[str]] = None) -> list[tuple[str, dict[str, Any]]]:
    """The contenders, in their order: ``(label, keyword arguments of measure.run_variant)``, where
    ``python_hooks`` (popped before the call) says whether the context pushes the Python hooks.
    ``keep``: the labels to keep (plain always is); an unknown label is an error."""
    base = {"num_layers": spec.layers - 1, "min_offload_bytes": 0}
    floor = measure.HooksFloor()
    out: list[tuple[str, dict[str, Any]]] = [("plain", {}), ("offload (default)", {"offload": base}),
                                             ("offload (Python hooks)", {"offload": base, "python_hooks": True})]
    for mib in GROUP_MIB:
        label = f"offload group_bytes={mib} MiB" if mib else "offload group_bytes=0 (off)"
        out.append((label, {"offload": {**base, "group_bytes": mib << 20}}))
    out.append(("hooks floor", {"layer_calls": (floor, floor.sync)}))
    native_floor = measure.HooksFloor(native=True)
    out.append(("hooks floor (C)", {"layer_calls": (native_floor, native_floor.sync)}))
    # Every tensor refused by the host budget: the hooks and every per-tensor decision, no
    # group ever copied. Its first step warns, once, that it offloaded nothing because it was
    # given host_budget_bytes=0: expected here (the other variants offload on every step).
    out.append(("offload (nothing fits)", {"offload": {**base, "host_budget_bytes": 0}}))
    out.append(("save_on_cpu", {"forward_wrapper": measure.save_on_cpu_wrapper()}))
    if keep is None:
        return out
    unknown = set(keep) - {label for label, _ in out}
    if unknown:
        raise SystemExit(f"host_cost.py: --variants: no variant {sorted(unknown)}; the variants are "
                         f"{[label for label, _ in out]}")
    return [(label, kw) for label, kw in out if label == "plain" or label in keep]


def one_round(env: common.Env, spec: Any, layers: Any, x: Any, steps: int, first: int = 0,
              keep: Optional[list[str]] = None) -> list[dict[str, Any]]:
    """Every variant once; rows of :func:`measure.run_variant`, in the variants' order.

    They run in that order rotated to start at variant ``first``: a variant's place in the
    round moves its time on the H100 VM by up to 10% (two contexts of the same settings, timed
    in one round, came out 1.36x and 1.51x plain), so each round starts one variant later and
    every variant takes every place. Each row says where it ran (``position``).
    """
    contenders = variants(spec, keep)
    rows: list[Optional[dict[str, Any]]] = [None] * len(contenders)
    for position in range(len(contenders)):
        i = (first + position) % len(contenders)
        label, kw = contenders[i]
        with python_hooks(kw.pop("python_hooks", False)):
            row = measure.run_variant(env, label, layers, x, steps=steps, **kw)
        row["position"] = position
        rows[i] = row
    return rows  # type: ignore[return-value]


def interleaved(env: common.Env, spec: Any, layers: Any, x: Any, keep: Optional[list[str]] = None) -> list[dict[str, Any]]:
    """Every variant's context at once, timed a step of each in turn (``interleave.run_cycles``,
    ``--steps`` cycles after ``--warmup`` steps each): the summary rows of ``interleave.summarize``."""
    contenders = []
    for label, kw in variants(spec, keep):
        v = interleave.Variant(label, step=lambda: None)
        with python_hooks(kw.pop("python_hooks", False)):
            v.step, v.context = measure.variant_step(env, layers, x, on_forward=v.forward_done, **kw)
        contenders.append(v)
    interleave.run_cycles(env, contenders, warmup=env.args.warmup, cycles=env.args.steps)
    return interleave.summarize(contenders)


def main(argv: Optional[list[str]] = None) -> int:
    parser = common.make_parser(__doc__, warmup=20, steps=100, smoke_warmup=1, smoke_steps=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--workload", choices=("small", "moe", "gpt_a"), default="small",
                        help="SMALL (T5a), MOE, 8 layers of 64 experts (T5c), or GPT-A (the <= 1%% check)")
    parser.add_argument("--variants", default=None,
                        help="comma-separated labels of the variants to run (plain always runs); default: all")
    parser.add_argument("--interleave", action="store_true",
                        help="time one step of each variant in turn, --steps cycles (benchmarks/interleave.py); "
                             "writes host_cost[_<workload>]_interleaved.json")
    env = common.setup(parser, argv)
    spec = workloads.WORKLOADS[env.args.workload](workloads.scale_for(env.smoke))
    keep = None if env.args.variants is None else [v.strip() for v in env.args.variants.split(",") if v.strip()]
    print(spec.describe(), flush=True)
    layers, make_input = spec.build(env.device)
    x = make_input()
    name = "host_cost" if env.args.workload == "small" else f"host_cost_{env.args.workload}"
    if env.args.interleave:
        summary = interleaved(env, spec, layers, x, keep)
        table = [{**row, "ci95": "{:.3f}-{:.3f}".format(*row["ratio_ci95"])} for row in summary]
        common.print_table(f"{spec.name}, {env.args.steps} interleaved cycles ({common.device_name(env)}): step / plain step of the same cycle",
                           table, [("variant", "variant", ""), ("ratio_median", "x plain (median)", ".3f"),
                                     ("ratio_p25", "p25", ".3f"), ("ratio_p75", "p75", ".3f"),
                                     ("ci95", "median's 95% interval", ""), ("ratio_fast", "fast steps", ".3f"),
                                     ("host_ratio_median", "host time", ".3f"),
                                     ("forward_ratio_median", "forward", ".3f"), ("backward_ratio_median", "backward", ".3f"),
                                     ("step_ms", "step ms", ".2f"), ("groups", "groups", "")])
        common.write_json(name + "_interleaved", env, {"workload": spec.describe(), "summary": summary})
        return 0
    rounds = []
    for r in range(env.args.rounds):
        print(f"round {r + 1}:", flush=True)
        rounds.append(one_round(env, spec, layers, x, env.args.steps, first=r, keep=keep))
    summary = []
    for i, row in enumerate(rounds[0]):
        ratios = [rs[i]["step_ms"] / rs[0]["step_ms"] for rs in rounds if "error" not in rs[i] and "error" not in rs[0]]
        summary.append({
            "variant": row["variant"],
            "ratio_median": statistics.median(ratios) if ratios else None,
            "ratios": [round(v, 3) for v in ratios],
            "step_ms": [rs[i].get("step_ms") for rs in rounds],
            "groups": [(rs[i].get("stats") or {}).get("groups_offloaded") for rs in rounds],
        })
    common.print_table(f"{spec.name}, {len(rounds)} alternating rounds ({common.device_name(env)}): step / plain step of the same round",
                       summary, [("variant", "variant", ""), ("ratio_median", "x plain (median)", ".2f"),
                                 ("ratios", "per round", ""), ("groups", "groups", "")])
    common.write_json(name, env, {"workload": spec.describe(), "summary": summary, "rounds": rounds})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
