"""Two single-GPU jobs side by side on one node (issue 48 §3): both finish, and each holds the host
memory its plan needs, not the node's.

The report: LLAMA-1B's shape at long context held about 140 GB of a 252 GiB node's RAM while its
plan needed about 45 GiB (its host budget was 75% of the node's total), and when a second job
started on the node, the kernel's OOM killer ended the first; the second's steps slowed from 6.6 s
to 58 s, pinning under that memory pressure. Now the host budget is the node's: what it has
available, less a floor for the OS and others, read whenever the pool grows, and what is held is
bounded by the plan's need plus a slack (``offload.host.node``, ``offload.host.room``).

Each job is a worker process running LLAMA-1B's shape (HF LlamaForCausalLM, hidden 2048,
intermediate 8192, 16 layers, 32/8 heads, vocab 32000, bf16, sdpa, ``use_cache=False``), batch 1 at
``--length`` tokens, for ``--steps`` steps (probe steps included) under
``OffloadActivations(model.model.layers)``, the default. With two GPUs visible the jobs run on GPU 0
and GPU 1; with one, both share it, each capped by ``torch.cuda.set_per_process_memory_fraction``
to ``--fraction`` of it. The second job builds its model at once, then starts its steps when the
first one's plan is in force (a second job arriving on a busy node; ``--together``: at once).

``--node-gib G`` simulates a node of G GiB (``OFFLOAD_SIMULATED_NODE``: the two jobs publish what
they hold, and each reads the node's available memory as G GiB less both): on a machine with more
RAM than the node to stand for, the bound is then the simulated one.

Per job: each step's wall time (synchronised), the plan, host bytes needed by the plan, held (the
process ledger's peak) and the node's available memory and floor as last read, the process's peak
RSS, the device peak; then whether each held at most what the node allows. JSON to ``--out``
(default ``benchmarks/results/shared_node.json``).

    python benchmarks/shared_node.py                         # 65536 tokens, 4 steps (~3 min, H200)
    python benchmarks/shared_node.py --node-gib 48 --length 32768
    python benchmarks/shared_node.py --cpu-smoke             # tiny check of the script, no GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, Env, apply_defaults, exit_status, make_parser, print_table, setup, verdict, write_json  # noqa: E402
from workers import add_worker_options, check_cuda_or_exit, parent_env, parent_meta, spawn_all, worker_env, worker_info, \
    write_worker_result  # noqa: E402
from workloads import llama_1b, llama_step, scale_for  # noqa: E402

import offload  # noqa: E402
from offload.host.ledger import process_host_memory  # noqa: E402
from offload.host.node import SIMULATED_NODE_ENV_VAR, node_floor  # noqa: E402

GIB = 1 << 30
SMOKE_LENGTH = 64
WAIT_FOR_FIRST_S = 180.0


def parse(argv: list[str]) -> argparse.ArgumentParser:
    parser = make_parser(__doc__, warmup=0, steps=4, smoke_warmup=0, smoke_steps=5)
    add_worker_options(parser)
    parser.add_argument("--length", type=int, default=65536, help="tokens per step, batch 1 (default 65536)")
    parser.add_argument("--node-gib", type=float, default=None, help="simulate a node of this many GiB")
    parser.add_argument("--fraction", type=float, default=0.47,
                        help="each job's share of the GPU when both share one (default 0.47)")
    parser.add_argument("--together", action="store_true", help="start both jobs' steps at once")
    parser.add_argument("--out", default=None, help="results file (default benchmarks/results/shared_node.json)")
    parser.add_argument("--sync", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--gpu", type=int, default=None, help=argparse.SUPPRESS)
    return parser


# -- a job ---------------------------------------------------------------------------------------
def run_job(env: Env, role: str, sync: Path) -> dict[str, Any]:
    """One job: build, wait for the first job's plan (the second), run the steps, report."""
    args = env.args
    if env.cuda and args.gpu is None:  # both on one GPU: each to its share
        torch.cuda.set_per_process_memory_fraction(args.fraction, env.device)
    spec = dataclasses.replace(llama_1b(scale_for(env.smoke)), name="LLAMA-1B-SHAPE", batch=1,
                               seq=SMOKE_LENGTH if env.smoke else args.length)
    model, ids = spec.build(env.device)
    kw: dict[str, Any] = {"device": "cpu", "memory_budget_bytes": "lowest"} if env.smoke else {}
    oa = offload.OffloadActivations(model.model.layers, **kw)
    step = llama_step(model, ids, lambda: oa)
    if role == "second" and not args.together:
        start = time.monotonic()
        while not (sync / "first_planned").exists() and time.monotonic() - start < WAIT_FOR_FIRST_S:
            time.sleep(0.2)
    steps = []
    for i in range(args.steps):
        env.sync()
        if env.cuda:
            torch.cuda.reset_peak_memory_stats(env.device)
        t0 = time.perf_counter()
        step()
        env.sync()
        ms = (time.perf_counter() - t0) * 1e3
        stats = oa.stats
        host = process_host_memory()
        steps.append({
            "step": i + 1, "ms": ms, "plan": oa.plan.describe() if oa.plan is not None else None,
            "host_needed_bytes": stats["host_needed_bytes"], "host_held_bytes": host["held_bytes"],
            "host_peak_bytes": host["peak_bytes"], "node_available_bytes": host["node_available_bytes"],
            "kept": stats["kept"],
            "device_peak_bytes": int(torch.cuda.max_memory_allocated(env.device)) if env.cuda else None,
        })
        print(f"{role} step {i + 1}: {ms:.0f} ms, plan {steps[-1]['plan']}, host held "
              f"{host['held_bytes'] / GIB:.2f} GiB (peak {host['peak_bytes'] / GIB:.2f}), needed "
              f"{(stats['host_needed_bytes'] or 0) / GIB:.2f} GiB, node available "
              f"{(host['node_available_bytes'] or 0) / GIB:.1f} GiB", flush=True)
        if role == "first" and oa.plan is not None:
            (sync / "first_planned").touch()
    (sync / f"{role}_done").touch()
    (sync / "first_planned").touch()  # a first job that never planned must not hold the second
    host = process_host_memory()
    return {
        "role": role, "info": worker_info(env), "spec": spec.describe(), "steps": steps,
        "plan": oa.plan.describe() if oa.plan is not None else None,
        "budget_reason": oa.plan.budget_reason if oa.plan is not None else None,
        "host": host, "host_needed_bytes": oa.stats["host_needed_bytes"],
        "host_bound_bytes": oa.stats["host_bound_bytes"], "kept": oa.stats["kept"],
        "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "report": oa.report(),
    }


# -- the parent ------------------------------------------------------------------------------------
def judge(results: dict[str, dict[str, Any]], node_total: int | None) -> dict[str, Any]:
    """Whether both finished, and each held at most the node's room and its plan's bound."""
    finished = {role: "error" not in r and len(r.get("steps", [])) == r.get("steps_wanted") for role, r in results.items()}
    peaks = {role: r["host"]["peak_bytes"] for role, r in results.items() if "host" in r}
    within_plan = {role: r["host_bound_bytes"] is None or r["host"]["peak_bytes"] <= r["host_bound_bytes"]
                   for role, r in results.items() if "host" in r}
    out: dict[str, Any] = {"finished": finished, "host_peaks": peaks, "within_plan_bound": within_plan}
    if node_total is not None and peaks:
        out["node_total_bytes"], out["node_floor_bytes"] = node_total, node_floor(node_total)
        out["within_node"] = sum(peaks.values()) <= node_total - node_floor(node_total)
    return out


def main(argv: list[str]) -> int:
    parser = parse(argv)
    args = parser.parse_args(argv)
    if args.worker:
        env = setup(parser, argv)
        result = run_job(env, args.worker, Path(args.sync))
        write_worker_result(args.worker_out, result)
        return 0
    apply_defaults(parser, args)
    check_cuda_or_exit(args, "shared_node.py")
    env = parent_env(args)
    gpus = 0 if args.cpu_smoke else torch.cuda.device_count()
    node_total = int(args.node_gib * GIB) if args.node_gib else None
    with tempfile.TemporaryDirectory(prefix="shared-node-") as tmp:
        extra = worker_env(env)
        if node_total is not None:
            extra[SIMULATED_NODE_ENV_VAR] = f"{node_total}:{Path(tmp) / 'node'}"
        passed = [a for a in argv if a not in ("--together",)]
        jobs = []
        for i, role in enumerate(("first", "second")):
            worker_argv = [*passed, "--worker", role, "--sync", tmp] + (["--together"] if args.together else [])
            if gpus >= 2:
                worker_argv += ["--gpu", str(i)]
            jobs.append((role, worker_argv))
        if gpus >= 2:  # each job on its own GPU: the worker sees it as cuda:0
            results = spawn_each_on_gpu(jobs, extra, args.worker_timeout)
        else:
            results = spawn_all(Path(__file__), jobs, parallel=2, timeout=args.worker_timeout, extra_env=extra)
    for r in results.values():
        r["steps_wanted"] = args.steps
    verdicts = judge(results, node_total)
    rows = [{"job": role, "step": s["step"], "ms": s["ms"], "plan": s["plan"],
             "needed GiB": (s["host_needed_bytes"] or 0) / GIB, "held GiB": s["host_held_bytes"] / GIB,
             "peak GiB": s["host_peak_bytes"] / GIB, "node avail GiB": (s["node_available_bytes"] or 0) / GIB}
            for role, r in results.items() for s in r.get("steps", [])]
    print_table("two jobs on one node", rows, [("job", "job", ""), ("step", "step", ""), ("ms", "step ms", ".0f"),
                                               ("plan", "plan", ""), ("needed GiB", "needed GiB", ".2f"),
                                               ("held GiB", "held GiB", ".2f"), ("peak GiB", "peak GiB", ".2f"),
                                               ("node avail GiB", "node avail GiB", ".1f")])
    failed = [f"{role} did not finish" for role, ok in verdicts["finished"].items() if not ok]
    failed += [f"{role} held more than its plan's bound" for role, ok in verdicts["within_plan_bound"].items() if not ok]
    if verdicts.get("within_node") is False:
        failed.append("the two jobs together held more than the node less its floor")
    print(f"both finished: {verdict(not any('finish' in f for f in failed))}; within the plans' bounds: "
          f"{verdict(all(verdicts['within_plan_bound'].values()))}; within the node: {verdict(verdicts.get('within_node'))}")
    path = Path(args.out) if args.out else None
    if path is None and args.name is None:
        path = (RESULTS_DIR / "smoke" if args.cpu_smoke else RESULTS_DIR) / "shared_node.json"
    write_json("shared_node", env, {"args": vars(args), "gpus": gpus, "jobs": results, "verdicts": verdicts},
               meta=parent_meta(env, list(results.values())), path=path)
    return exit_status(failed)


def spawn_each_on_gpu(jobs: list[tuple[str, list[str]]], extra: dict[str, str],
                      timeout: float | None) -> dict[str, dict[str, Any]]:
    """Both jobs at once, each with its own GPU visible (``CUDA_VISIBLE_DEVICES``)."""
    from concurrent.futures import ThreadPoolExecutor

    from workers import spawn

    def one(job: tuple[str, list[str]], gpu: int) -> dict[str, Any]:
        return spawn(Path(__file__), job[1], job[0], timeout=timeout, extra_env={**extra, "CUDA_VISIBLE_DEVICES": str(gpu)})

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(one, job, gpu) for job, gpu in zip(jobs, (0, 1))]
        return {job[0]: f.result() for job, f in zip(jobs, futures)}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
