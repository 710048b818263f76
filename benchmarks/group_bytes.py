"""Small layers sharing one copy (``group_bytes``, issue 35) on SMALL, in alternating rounds.

SMALL (16 x Linear 1024 + GELU, 256 tokens, bf16; TransformerEngine's call shape, 15 layers
offloaded, every activation however small) is host-bound: each layer's group moves 1 MiB, and
the fixed host work per group (close, D2H and H2D submissions, their events, the waits) costs
more than the transfer. Each round times, in one process and in turn: plain, offload with the
defaults (``group_bytes`` 32 MiB: one group), offload with ``group_bytes`` of 0 (off: every
layer a group, the default before issue 35's fourth round), 4 and 16 MiB (4 groups and 1), the
hooks' floor (``cpu_overhead.HooksFloor``) and ``save_on_cpu``. Rounds alternate the
variants so that the host's drift (27-36% between rounds on the H100 VM) falls on all of them;
the ratios are per round, then the median over rounds.

Usage: ``python benchmarks/group_bytes.py [--rounds 4] [--steps 100]``; ``--cpu-smoke`` for a
tiny CPU check. Writes ``benchmarks/results/group_bytes.json``.
"""

from __future__ import annotations

import statistics
from typing import Any, Optional

import common
import cpu_overhead
import workloads

GROUP_MIB = (0, 4, 16)


def one_round(env: common.Env, spec: Any, layers: Any, x: Any, steps: int) -> list[dict[str, Any]]:
    """Every variant once, in order; rows of :func:`common.run_variant`."""
    k = spec.layers - 1
    base = {"num_layers": k, "min_offload_bytes": 0}
    floor = cpu_overhead.HooksFloor()
    rows = [common.run_variant(env, "plain", layers, x, steps=steps),
            common.run_variant(env, "offload (default)", layers, x, offload=base, steps=steps)]
    for mib in GROUP_MIB:
        label = f"offload group_bytes={mib} MiB" if mib else "offload group_bytes=0 (off)"
        rows.append(common.run_variant(env, label, layers, x,
                                       offload={**base, "group_bytes": mib << 20}, steps=steps))
    rows.append(common.run_variant(env, "hooks floor", layers, x, layer_calls=(floor, floor.sync), steps=steps))
    rows.append(common.run_variant(env, "save_on_cpu", layers, x, forward_wrapper=common.save_on_cpu_wrapper(), steps=steps))
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = common.make_parser(__doc__, warmup=20, steps=100, smoke_warmup=1, smoke_steps=3)
    parser.add_argument("--rounds", type=int, default=4)
    env = common.setup(parser, argv)
    spec = workloads.small(workloads.scale_for(env.smoke))
    print(spec.describe(), flush=True)
    layers, make_input = spec.build(env.device)
    x = make_input()
    rounds = []
    for r in range(env.args.rounds):
        print(f"round {r + 1}:", flush=True)
        rounds.append(one_round(env, spec, layers, x, env.args.steps))
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
    common.print_table(f"SMALL, {len(rounds)} alternating rounds ({common.device_name(env)}): step / plain step of the same round",
                       summary, [("variant", "variant", ""), ("ratio_median", "x plain (median)", ".2f"),
                                 ("ratios", "per round", ""), ("groups", "groups", "")])
    common.write_json("group_bytes", env, {"workload": spec.describe(), "summary": summary, "rounds": rounds})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
