"""FSDP2 with each rank at its own length every step (issue 48's repro): the default
``OffloadActivations(model.model.layers)`` against HF checkpointing, one contender per run.

The model is LLAMA-1B's shape (``workloads.llama_1b``: HF ``LlamaForCausalLM``, hidden 2048, 16
layers, vocab 32000, bf16, SDPA), batch 1, ``fully_shard`` on every decoder layer and then on the
model. At step ``i`` rank ``r`` trains on ``T * (1, 0.5, 0.75, 0.375)[(i + r) % 4]`` tokens, so
the ranks' lengths differ at every step (dynamic padding in SFT). Before issue 48's fix no step
of ``offload`` finished: one rank left the planner's probe a step before the other and waited in
its all-reduce while the other waited in FSDP2's all-gather.

Each step is timed on every rank (synchronised wall clock) and each rank's
``torch.cuda.max_memory_allocated`` read for it; rank 0 prints a line per step and writes the
JSON to ``--out``. The process group's timeout is 120 s, so a hang shows as NCCL's error, not as
a job that never ends. An error in a step (out of memory, ``BudgetError``) is recorded and ends
the run (FSDP2's collectives cannot go on past one rank's failure).

    torchrun --standalone --nproc-per-node 2 benchmarks/fsdp_varlen.py --mode offload --length 32768 --steps 6 --out offload.json
    torchrun --standalone --nproc-per-node 2 benchmarks/fsdp_varlen.py --mode checkpoint --length 32768 --steps 6 --out ckpt.json
    python benchmarks/fsdp_varlen.py --cpu-smoke --out /tmp/smoke.json   # 2 gloo processes, a tiny Llama
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workers import spawn_ranks  # noqa: E402
from workloads import hf_checkpointing, llama_1b  # noqa: E402

import offload  # noqa: E402

FACTORS = (1.0, 0.5, 0.75, 0.375)
TIMEOUT_S = 120


def parser() -> argparse.ArgumentParser:
    """This script's options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("offload", "checkpoint"), default="offload",
                   help="offload: OffloadActivations(model.model.layers), the default; checkpoint: HF checkpointing")
    p.add_argument("--length", type=int, default=65536, help="T, the longest length of the stream (default 65536)")
    p.add_argument("--steps", type=int, default=8, help="steps (default 8)")
    p.add_argument("--out", type=Path, default=None, help="where rank 0 writes the JSON")
    p.add_argument("--nproc", type=int, default=2, help="processes to spawn without torchrun (default 2)")
    p.add_argument("--cpu-smoke", action="store_true", help="a tiny Llama on 2 gloo processes (the figures mean nothing)")
    return p


def length_at(base: int, step: int, rank: int) -> int:
    """Rank ``rank``'s length at ``step``."""
    return max(1, int(base * FACTORS[(step + rank) % len(FACTORS)]))


def _phase(oa: Any) -> str:
    planned = getattr(oa, "_planned", None)
    if planned is None:
        return "fixed"
    return "probe" if planned._probing else "planned"


def run_rank(args: argparse.Namespace) -> int:
    """One rank: build, shard, run the stream; rank 0 reports."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    smoke = args.cpu_smoke or not torch.cuda.is_available()
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing_(en|dis)able.*", category=FutureWarning)
    if smoke:
        device, backend = torch.device("cpu"), "gloo"
    else:
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        spec = dataclasses.replace(llama_1b(), batch=1, seq=args.length)
        if smoke:  # float32: what gloo reduces on every torch
            spec = dataclasses.replace(spec, hidden=64, intermediate=128, layers=2, heads=2, kv_heads=1, vocab=128,
                                       dtype=torch.float32)
        model, _ = spec.build(device)  # the same weights on every rank
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        oa: Optional[Any] = None
        if args.mode == "offload":
            # The one-line default; on the CPU (smoke) a byte budget makes it plan as on CUDA.
            kw: dict[str, Any] = {"device": "cpu", "memory_budget_bytes": 1 << 30} if smoke else {}
            oa = offload.OffloadActivations(model.model.layers, **kw)
        records = stream(args, model, oa, device, spec.vocab, rank, world)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, records)
        if rank == 0:
            report(args, spec.describe(), world, gathered, oa)
        failed = any(r.get("error") for rs in gathered for r in rs)
        return 1 if failed or sum(1 for r in gathered[0] if not r.get("error")) < args.steps else 0
    finally:
        dist.destroy_process_group()


def stream(args: argparse.Namespace, model: Any, oa: Optional[Any], device: torch.device, vocab: int, rank: int,
           world: int) -> list[dict[str, Any]]:
    """The steps on this rank: per step, its length, wall ms, peak, phase, error."""
    cuda = device.type == "cuda"
    records = []
    ckpt = hf_checkpointing(model) if args.mode == "checkpoint" else contextlib.nullcontext()
    with ckpt:
        for i in range(args.steps):
            length = length_at(args.length, i, rank)
            g = torch.Generator(device=device).manual_seed(1000 * i + rank)
            ids = torch.randint(0, vocab, (1, length), generator=g, device=device)
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            record: dict[str, Any] = {"step": i, "rank": rank, "length": length}
            start = time.perf_counter()
            try:
                with oa if oa is not None else contextlib.nullcontext():
                    record["phase"] = _phase(oa) if oa is not None else "checkpoint"
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                del loss
                if cuda:
                    torch.cuda.synchronize(device)
                record["ms"] = (time.perf_counter() - start) * 1e3
            except Exception as exc:  # noqa: BLE001 - recorded; FSDP2 cannot go on past it
                traceback.print_exc()
                record["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            record["peak_bytes"] = torch.cuda.max_memory_allocated(device) if cuda else None
            model.zero_grad(set_to_none=True)
            records.append(record)
            if rank == 0:
                print(f"step {i}: rank 0 length {length}, {record.get('ms', float('nan')):.0f} ms, "
                      f"{record.get('phase', '')} {record.get('error', '')}", flush=True)
            if "error" in record:
                break
    return records


def report(args: argparse.Namespace, workload: str, world: int, gathered: list[list[dict[str, Any]]],
           oa: Optional[Any]) -> None:
    """A line per step (every rank's length, ms and peak) and the JSON."""
    print(f"\n{workload}; FSDP2 over {world} ranks; mode {args.mode}; T {args.length}")
    steps = []
    for i in range(max(len(rs) for rs in gathered)):
        per_rank = [rs[i] if i < len(rs) else {} for rs in gathered]
        ms = [r.get("ms") for r in per_rank]
        peaks = [r.get("peak_bytes") for r in per_rank]
        errors = [r.get("error") for r in per_rank if r.get("error")]
        steps.append({"step": i, "lengths": [r.get("length") for r in per_rank], "ms": ms, "peak_bytes": peaks,
                      "phase": [r.get("phase") for r in per_rank], "errors": errors})
        peak_txt = ", ".join(f"{p / 2**30:.2f}" if p else "-" for p in peaks)
        ms_txt = ", ".join(f"{m:.0f}" if m is not None else "-" for m in ms)
        print(f"  step {i}: lengths {steps[-1]['lengths']}  ms [{ms_txt}]  peak GiB [{peak_txt}]  "
              f"{steps[-1]['phase']}{'  ' + '; '.join(errors) if errors else ''}")
    finished = [s for s in steps if not s["errors"] and all(m is not None for m in s["ms"])]
    # The steady steps: past the probe's (offload) and the first (both), so the contenders compare.
    steady = [max(s["ms"]) for s in finished if s["step"] >= 1 and all(p in ("planned", "checkpoint") for p in s["phase"])]
    summary = {"steps_finished": len(finished), "steps": args.steps,
               "median_steady_ms": sorted(steady)[len(steady) // 2] if steady else None,
               "max_peak_bytes": [max((s["peak_bytes"][r] or 0) for s in steps) for r in range(world)]}
    print(f"steps finished {summary['steps_finished']}/{args.steps}; median steady step "
          f"{summary['median_steady_ms'] or float('nan'):.0f} ms (slowest rank); peak GiB per rank "
          f"{[round(p / 2**30, 2) for p in summary['max_peak_bytes']]}")
    plan = getattr(oa, "plan", None) if oa is not None else None
    payload = {"workload": workload, "world": world, "mode": args.mode, "length": args.length,
               "factors": FACTORS, "summary": summary, "per_step": steps,
               "plan": plan.describe() if plan is not None else None,
               "torch": torch.__version__, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=1))
        print(f"wrote {args.out}")


def run_argv(argv: list[str]) -> int:
    """This rank, from its command line (what :func:`workers.spawn_ranks` calls)."""
    return run_rank(parser().parse_args(argv))


def main(argv: Optional[list[str]] = None) -> int:
    """Under torchrun: this rank. Otherwise spawn ``--nproc`` ranks on this machine."""
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.cpu_smoke and "--length" not in " ".join(argv):
        argv = [*argv, "--length", "64"]
    if "RANK" in os.environ:  # under torchrun
        return run_argv(argv)
    return spawn_ranks(run_argv, args.nproc, argv)


if __name__ == "__main__":
    sys.exit(main())
