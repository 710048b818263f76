"""FSDP2 on two GPUs: LLAMA-2B-shaped layers, plain against checkpointing, fixed-k offload and
the planner, tokens/s and peak memory per rank.

The model is ``workloads.llama_2b`` (HF ``LlamaForCausalLM`` with ``LlamaDecoderLayer``s: hidden
4096, intermediate 14336, 64 heads, 16 KV heads, 8 layers, batch 2 x 4096 tokens per rank, bf16,
SDPA), ``fully_shard`` on every decoder layer and at the root. Contenders, one after the other in
the same processes:

  plain              no offload, no checkpointing
  HF checkpointing   ``workloads.hf_checkpointing`` (non-reentrant)
  offload k=...      ``OffloadActivations(model.model.layers, num_offload_layers=k)`` (``--ks``)
  plan @ ...         the planner (``offload.planner``): rank 0 probes a plain step and plans for
                     checkpointing's peak (and the lowest peak); every rank follows rank 0's plan,
                     so that all ranks issue FSDP2's collectives in the same order

Each rank times its own steps (CUDA events, medians) and reads its own peak
(``max_memory_allocated``); tokens/s is the rank's tokens over its step time, and the total
the sum over the ranks. Rank 0 prints the table and writes benchmarks/results/distributed.json.

    torchrun --standalone --nproc-per-node 2 benchmarks/distributed.py
    python benchmarks/distributed.py               # spawns the 2 processes itself
    python benchmarks/distributed.py --cpu-smoke   # 2 gloo processes on the CPU, tiny sizes
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    Env, exit_status, free_memory, gib, make_parser, print_table, setup, write_json,
)
from measure import time_steps  # noqa: E402
from workers import spawn_ranks  # noqa: E402
from workloads import hf_checkpointing, llama_2b, llama_step, scale_for  # noqa: E402

import offload  # noqa: E402


def parser() -> Any:
    """The common benchmark options and this script's own."""
    p = make_parser(__doc__, warmup=2, steps=4, smoke_warmup=1, smoke_steps=1)
    p.add_argument("--nproc", type=int, default=2, help="processes to spawn without torchrun (default 2)")
    p.add_argument("--ks", default=None, help="fixed offload counts (default 2,4,7; 3 with --cpu-smoke)")
    p.add_argument("--no-planner", action="store_true", help="leave the planner out")
    return p


def shard(model: Any, env: Env, world: int) -> None:
    """FSDP2: every decoder layer, then the root (embeddings, final norm, head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(env.device.type, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def measure(env: Env, label: str, step: Callable[[], None], tokens: int, **extra: Any) -> dict[str, Any]:
    """One contender on this rank; a failure is recorded, and the ranks meet again after it."""
    row: dict[str, Any] = {"variant": label, "rank": dist.get_rank(), **extra}
    try:
        timing = time_steps(step, env)
        row.update(step_ms=timing.median_ms, tokens_per_s=tokens / timing.median_ms * 1e3,
                   peak_bytes=timing.peak_bytes, peak_gib=gib(timing.peak_bytes))
    except Exception as exc:  # noqa: BLE001 - one failing contender must not hide the others
        traceback.print_exc()
        row["error"] = f"{type(exc).__name__}: {exc}"
    free_memory(env)
    dist.barrier()
    return row


def planned_rows(env: Env, model: Any, ids: torch.Tensor, tokens: int, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank 0 probes and plans; every rank follows the plan rank 0 chose."""
    layers = model.model.layers
    dev = env.offload_device
    ckpt = next((r for r in rows if r["variant"] == "HF checkpointing" and r.get("peak_bytes")), None)
    budgets: list[tuple[str, Any]] = [("lowest", "lowest")]
    if ckpt is not None:
        budgets.insert(0, ("checkpointing's peak", int(ckpt["peak_bytes"])))
    plans: list[Any] = [None] * len(budgets)
    problem = [None]
    if dist.get_rank() == 0:
        try:
            # Every rank runs the probe's steps (FSDP2's collectives need all of them); rank 0's
            # figures decide.
            profile = offload.planner.profile_step(layers, llama_step(model, ids), device=dev)
            if env.smoke:  # no allocator peak on the host: fractions of the activations instead
                budgets = [("half", profile.plain_peak_bytes // 2), ("lowest", "lowest")]
            plans = [offload.planner.choose(profile, budget) for _, budget in budgets]
        except Exception as exc:  # noqa: BLE001 - the planner may not apply; say why
            traceback.print_exc()
            problem = [f"{type(exc).__name__}: {exc}"]
    else:
        with contextlib.suppress(Exception):  # the probe's steps, in step with rank 0
            offload.planner.profile_step(layers, llama_step(model, ids), device=dev)
    shared = [problem, plans, budgets]
    dist.broadcast_object_list(shared, src=0)
    problem, plans, budgets = shared
    if problem[0] is not None:
        return [{"variant": "plan", "rank": dist.get_rank(), "error": problem[0]}]
    out = []
    for (label, budget), plan in zip(budgets, plans):
        oa = offload.OffloadActivations(layers, plan=plan, device=dev)
        out.append(measure(env, f"plan @ {label}", llama_step(model, ids, lambda oa=oa: oa), tokens,
                           plan=plan.describe(), predicted_step_ms=plan.prediction.step_ms,
                           predicted_peak_gib=gib(plan.prediction.peak_bytes)))
        oa.close()
        del oa
    return out


def run_rank(argv: list[str]) -> int:
    """One rank: build, shard, time every contender; rank 0 reports."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    smoke = "--cpu-smoke" in argv
    if rank != 0:  # rank 0 speaks for all (errors still reach stderr)
        sys.stdout = open(os.devnull, "w")
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing_(en|dis)able.*", category=FutureWarning)
    if not smoke and torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    backend = "gloo" if smoke or not torch.cuda.is_available() else "nccl"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=600))
    try:
        env = setup(parser(), argv)
        spec = llama_2b(scale_for(env.smoke))
        if env.smoke:
            spec = dataclasses.replace(spec, dtype=torch.float32)  # what gloo reduces on every torch
        ks = [int(k) for k in (env.args.ks or ("3" if env.smoke else "2,4,7")).split(",")]
        model, _ = spec.build(env.device)  # the same weights on every rank
        g = torch.Generator(device=env.device).manual_seed(1000 + rank)  # each rank its own batch
        ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=g, device=env.device)
        shard(model, env, world)
        tokens = spec.batch * spec.seq
        layers = model.model.layers
        rows = [measure(env, "plain", llama_step(model, ids), tokens)]
        with hf_checkpointing(model):
            rows.append(measure(env, "HF checkpointing", llama_step(model, ids), tokens))
        for k in ks:
            oa = offload.OffloadActivations(layers, num_offload_layers=k, device=env.offload_device)
            rows.append(measure(env, f"offload k={k}", llama_step(model, ids, lambda oa=oa: oa), tokens, k=k,
                                host_numa=oa.stats.get("host_numa_source")))
            oa.close()
            del oa
        if not env.args.no_planner:
            all_rows: list[Any] = [None] * world
            dist.all_gather_object(all_rows, rows)  # rank 0 plans from every rank's figures
            rows += planned_rows(env, model, ids, tokens, all_rows[0])
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, rows)
        failed = sorted({f"{r['variant']} (rank {r['rank']})" for rs in gathered for r in rs if "error" in r})
        if rank == 0:
            report(env, spec, world, [r for rs in gathered for r in rs])
        return exit_status(failed) if rank == 0 else 0
    finally:
        dist.destroy_process_group()


def report(env: Env, spec: Any, world: int, rows: list[dict[str, Any]]) -> None:
    """The table (one line per contender and rank) and the JSON."""
    plain = {r["rank"]: r.get("step_ms") for r in rows if r["variant"] == "plain"}
    totals: dict[str, float] = {}
    for r in rows:
        if r.get("step_ms") and plain.get(r["rank"]):
            r["x_plain"] = r["step_ms"] / plain[r["rank"]]
        if r.get("tokens_per_s"):
            totals[r["variant"]] = totals.get(r["variant"], 0.0) + r["tokens_per_s"]
    print(f"\n{spec.describe()}\nFSDP2 over {world} ranks ({env.device.type}); per rank:")
    print_table("step, tokens/s and peak per rank", rows, [
        ("variant", "contender", ""), ("rank", "rank", "d"), ("step_ms", "step ms", ".1f"),
        ("x_plain", "x plain", ".2f"), ("tokens_per_s", "tokens/s", ".0f"), ("peak_gib", "peak GiB", ".2f"),
        ("error", "error", ""),
    ])
    print("\ntokens/s, all ranks: " + ", ".join(f"{k} {v:.0f}" for k, v in totals.items()))
    write_json("distributed", env, {"workload": spec.describe(), "world": world, "rows": rows, "total_tokens_per_s": totals})


def main() -> int:
    """Under torchrun: this rank. Otherwise spawn ``--nproc`` ranks on this machine."""
    argv = sys.argv[1:]
    if "RANK" in os.environ:  # under torchrun
        return run_rank(argv)
    return spawn_ranks(run_rank, parser().parse_args(argv).nproc, argv)


if __name__ == "__main__":
    sys.exit(main())
