"""Small layers sharing one copy (``group_bytes``, issue 35) on SMALL, in alternating rounds.

SMALL (16 x Linear 1024 + GELU, 256 tokens, bf16; TransformerEngine's call shape, 15 layers
offloaded, every activation however small) is host-bound: each layer's group moves 1 MiB, and
the fixed host work per group (close, D2H and H2D submissions, their events, the waits) costs
more than the transfer. Each round times, in one process and in turn: plain, offload with the
defaults (``group_bytes`` 32 MiB: one group), the same with the native saved-tensor hooks
(``OFFLOAD_NATIVE_HOOKS=1``, issue 35's fifth round), offload with ``group_bytes`` of 0 (off:
every layer a group, the default before issue 35's fourth round), 4 and 16 MiB (4 groups and
1), the hooks' floor (``cpu_overhead.HooksFloor``) and ``save_on_cpu``. Rounds alternate the
variants so that the host's drift (27-36% between rounds on the H100 VM) falls on all of them,
and each round starts one variant later, so that every variant runs at every place in a round
(see :func:`one_round`); the ratios are per round, then the median over rounds.

``--workload moe`` runs the same variants on MOE (8 layers of 64 experts, T5c), whose layers
of about 10 MiB share groups too.

Usage: ``python benchmarks/group_bytes.py [--workload small|moe] [--rounds 4] [--steps 100]``;
``--cpu-smoke`` for a tiny CPU check. Writes ``benchmarks/results/group_bytes.json``
(``group_bytes_moe.json`` for MOE).
"""

from __future__ import annotations

import contextlib
import os
import statistics
from typing import Any, Iterator, Optional

import common
import cpu_overhead
import workloads

GROUP_MIB = (0, 4, 16)


@contextlib.contextmanager
def native_hooks(on: bool) -> Iterator[None]:
    """Contexts made inside push the native saved-tensor hooks if ``on`` (``OFFLOAD_NATIVE_HOOKS``)."""
    before = os.environ.get("OFFLOAD_NATIVE_HOOKS")
    os.environ["OFFLOAD_NATIVE_HOOKS"] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["OFFLOAD_NATIVE_HOOKS"]
        else:
            os.environ["OFFLOAD_NATIVE_HOOKS"] = before


def one_round(env: common.Env, spec: Any, layers: Any, x: Any, steps: int, first: int = 0) -> list[dict[str, Any]]:
    """Every variant once; rows of :func:`common.run_variant`, in the variants' order.

    They run in that order rotated to start at variant ``first``: a variant's place in the
    round moves its time on the H100 VM by up to 10% (two contexts of the same settings, timed
    in one round, came out 1.36x and 1.51x plain), so each round starts one variant later and
    every variant takes every place. Each row says where it ran (``position``).
    """
    k = spec.layers - 1
    base = {"num_layers": k, "min_offload_bytes": 0}
    floor = cpu_overhead.HooksFloor()
    variants: list[tuple[str, dict[str, Any]]] = [("plain", {}), ("offload (default)", {"offload": base}),
                                                  ("offload (native hooks)", {"offload": base, "native_hooks": True})]
    for mib in GROUP_MIB:
        label = f"offload group_bytes={mib} MiB" if mib else "offload group_bytes=0 (off)"
        variants.append((label, {"offload": {**base, "group_bytes": mib << 20}}))
    variants.append(("hooks floor", {"layer_calls": (floor, floor.sync)}))
    variants.append(("save_on_cpu", {"forward_wrapper": common.save_on_cpu_wrapper()}))
    rows: list[Optional[dict[str, Any]]] = [None] * len(variants)
    for position in range(len(variants)):
        i = (first + position) % len(variants)
        label, kw = variants[i]
        with native_hooks(kw.pop("native_hooks", False)):
            row = common.run_variant(env, label, layers, x, steps=steps, **kw)
        row["position"] = position
        rows[i] = row
    return rows  # type: ignore[return-value]


def main(argv: Optional[list[str]] = None) -> int:
    parser = common.make_parser(__doc__, warmup=20, steps=100, smoke_warmup=1, smoke_steps=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--workload", choices=("small", "moe"), default="small",
                        help="SMALL (T5a) or MOE, 8 layers of 64 experts (T5c)")
    env = common.setup(parser, argv)
    build = workloads.small if env.args.workload == "small" else workloads.moe
    spec = build(workloads.scale_for(env.smoke))
    print(spec.describe(), flush=True)
    layers, make_input = spec.build(env.device)
    x = make_input()
    rounds = []
    for r in range(env.args.rounds):
        print(f"round {r + 1}:", flush=True)
        rounds.append(one_round(env, spec, layers, x, env.args.steps, first=r))
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
    name = "group_bytes" if env.args.workload == "small" else "group_bytes_moe"
    common.write_json(name, env, {"workload": spec.describe(), "summary": summary, "rounds": rounds})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
