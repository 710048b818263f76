"""Longer than one GPU (issue 51, T29-T32): context parallelism on PyTorch's engine
(``offload.parallel``: ring attention over SDPA, FSDP2 over the dp x cp mesh), contender by
contender, one set of processes per contender.

Contenders (``--contenders``):

- ``plain``: CP + FSDP2, nothing else (torchtitan's composition): the baseline that must run.
- ``hf_ckpt``: the same with HF's activation checkpointing (non-reentrant).
- ``ours``: the same with ``OffloadActivations(model.model.layers, model=model,
  memory_budget_bytes="device")``: each rank plans its shard (the tiled head where nothing
  untiled fits), the plan decisions agreed over every rank.
- ``ours_1gpu``: ``ours`` on ONE process (a mesh of one: nothing sharded): the one-GPU step of
  this project that T30 compares with.

Cases (``--case``): ``T29`` the LLAMA-8B shape (vocab 128256, base frozen: only the RMSNorm weights
train, as T21) at 1,048,576 tokens (``--length 1572864`` for the stretch); ``T30`` LLAMA-1B's shape
at 131,072 tokens (2-GPU step <= 0.6x ``ours_1gpu``'s); ``T31`` LLAMA-1B at 8192 (its numerics
are checked by ``tests/distributed/cp_scenarios.py``; here its step times); ``T32`` ``ours`` at
T30's length, its planning cost in steps ((the steps before the first planned one - as many
steady steps) / a steady step, as T27). ``--smoke``: a tiny Llama with eager attention (the CPU
has no ring kernel; the figures mean nothing), 2 gloo processes.

Every rank times each step (synchronised wall clock) and reads its peak
(``torch.cuda.max_memory_allocated``); rank 0 prints one line per step (flushed) and the parent
writes ``benchmarks/results/context_parallel_<case>.json`` and, with matplotlib, a PNG of median
step time and peak per contender. The NCCL timeout is 300 s: a hang shows as an error.

    python benchmarks/context_parallel.py --case T31                  # every contender, 2 GPUs
    python benchmarks/context_parallel.py --case T30 --contenders ours,ours_1gpu
    python benchmarks/context_parallel.py --case T29 --contenders ours --steps 1
    python benchmarks/context_parallel.py --smoke                     # 2 gloo processes on the CPU

**A step that takes minutes (T29).** ``ours`` runs no probe step at the full length: the first
full-length call is probed short inside it (``offload.layers.model_form``; under FSDP2 since
issue 51, the probe steps run ahead of FSDP2's root hook) and runs planned; that step's phase is
``"probed short, planned"``. ``--probe-length L`` instead runs the probe steps (and one planned
step) at ``L`` global tokens first; the full-length bucket's plan is then made from that profile
(``offload.planner.scaling``), at once (plans ahead off). ``--progress K`` (T29's default 4):
rank 0 prints a line every ``K`` layers in forward and backward (elapsed s, layer index),
flushed (``benchmarks/cp_long_step.py``). ``--layers N`` is the **preflight**: the same case with
``N`` decoder layers, one full-length step, and its extrapolation to the whole model: the step
from the measured layer time, and the planner's own plan for all layers at this length (device
budget, host room: GPU peak and host bytes a rank, the node's RAM shared by its ranks), ending in
``verdict: GO`` or ``verdict: NO-GO (why, and the length that would fit)``; ``--time-left-s S``
makes a step longer than ``S`` a NO-GO.

**T29 in one device session** (``run``; 30 min of device time, a machine held at most 30 min,
10 min a command, warm 30 s after a call). Measured on the H200s (docs/benchmarks.md, T29): on 2
GPUs a step is 22-27 min and the 32 checkpoint boundaries take 128 GiB of host a rank, more than a
256 GiB node holds for two; on 4 (``--nproc 4``, kind ``nvidia-h200-x4``) the preflight says
8.4-13 min and 89 GiB of host a rank: GO. So run it on 4, and say so: the target names 2.
``--plan-only`` is the check before a step of minutes: the whole model, probed short inside its
first full-length call, planned, and stopped before its first layer runs (a minute or two: the
build and the probe); it prints the plan, its predicted step, GPU peak and host a rank, the
node's RAM, and GO or NO-GO. (A ``--layers 2`` preflight measures a layer's time, but its plan is
extrapolated: it missed what stopped the whole model's own plan on the H200.) Call 1
(``timeout_s`` 600) builds, checks the plan (with the ``--probe-length`` fallback if the short
probe fails) and, on GO, starts the full run detached (``setsid``: it outlives the call while the
machine is held)::

    pip install -q --no-build-isolation --no-deps -e . > /tmp/build.log 2>&1 || { tail /tmp/build.log; exit 1; }
    mkdir -p /tmp/t29; P=""; T="python benchmarks/context_parallel.py --case T29 --contenders ours --nproc 4"
    $T --plan-only --time-left-s 1200 --out /tmp/t29/pre.json > /tmp/t29/pre.txt 2>&1 \
      || { P="--probe-length 65536"; $T --plan-only --time-left-s 1140 $P --out /tmp/t29/pre.json > /tmp/t29/pre.txt 2>&1; }
    grep -E "^ours (step|plan only|host|verdict)|Error" /tmp/t29/pre.txt | tail -14
    cp /tmp/t29/pre.txt /tmp/t29/pre.json $OUT/
    if grep -q "verdict: GO" /tmp/t29/pre.txt; then
      setsid nohup $T --steps 1 $P --out /tmp/t29/T29.json > /tmp/t29/log 2>&1 < /dev/null & echo started
    fi

Then, back to back (within 30 s of each other, or the machine goes back and the run with it),
calls that wait up to ~9.5 min each and show the log's tail (``timeout_s`` 600)::

    for i in $(seq 57); do grep -qE "^wrote|Traceback" /tmp/t29/log && break; sleep 10; done
    tail -6 /tmp/t29/log; cp /tmp/t29/log /tmp/t29/T29.json /tmp/t29/T29.png $OUT/ 2>/dev/null; true

The log shows ``ours step 0: forward layer 8/32, 301.2 s``-style lines as the step goes; the run
is over at ``wrote ...`` (the JSON and PNG come back in ``$OUT``: put them in
``benchmarks/results/context_parallel_T29.json``). On NO-GO, the preflight's lines say why (no
plan fits the GPU and host, the node's RAM, or the time left) and which ``--length`` would fit.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workers import spawn_ranks  # noqa: E402
from workloads import hf_checkpointing, llama_1b, llama_8b_shape, train_norms_only  # noqa: E402

import offload  # noqa: E402
from offload.layers.model_form import head_info  # noqa: E402
from cp_long_step import LayerClock, PlanMade, extrapolate, layer_weight_bytes, per_layer_ms, plan_only_report, \
    planned_figures, preflight_report, stop_when_planned  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CONTENDERS = ("plain", "hf_ckpt", "ours", "ours_1gpu")
CASES = {  # case: (spec maker, base frozen, length, steps)
    "T29": (llama_8b_shape, True, 1048576, 2),
    "T30": (llama_1b, False, 131072, 4),
    "T31": (llama_1b, False, 8192, 6),
    "T32": (llama_1b, False, 131072, 6),
    "smoke": (llama_1b, False, 64, 4),
}
TIMEOUT_S = 300
MORE_FOR_A_PLAN = 6  # steps past --steps a planned contender may take to show a planned step
PROGRESS = {"T29": 4}  # layers between rank 0's progress lines (0: none)
# A step's phase: at the `with`'s entry no plan ("probe") or one ("planned"), and a first long
# batch probed short inside its own call, then run planned.
SHORT = "probed short, planned"


def parser() -> argparse.ArgumentParser:
    """This script's options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=sorted(CASES), default="T31", help="which target (default T31)")
    p.add_argument("--contenders", default=None, help=f"comma-separated, of {','.join(CONTENDERS)} (default: the case's)")
    p.add_argument("--length", type=int, default=None, help="tokens per sequence (default: the case's)")
    p.add_argument("--steps", type=int, default=None, help="steps per contender (default: the case's)")
    p.add_argument("--nproc", type=int, default=2, help="GPUs (processes) for the CP contenders; cp = nproc")
    p.add_argument("--probe-length", type=int, default=0,
                   help="planned contenders run their probe steps at this many tokens first (e.g. 65536; "
                        "default 0: the first full-length call is probed short inside it)")
    p.add_argument("--layers", type=int, default=None,
                   help="preflight: the case with this many decoder layers, one full-length step, extrapolated")
    p.add_argument("--plan-only", action="store_true",
                   help="the whole model's own plan at the full length (probed short inside the first call), "
                        "then stop before the step runs: plan, predicted step, GPU peak and host a rank, the "
                        "node's RAM, GO or NO-GO (minutes sooner than a step of minutes shows a plan that fails)")
    p.add_argument("--time-left-s", type=float, default=None,
                   help="preflight: the seconds a full step may take (its verdict is NO-GO past them)")
    p.add_argument("--short-probe-tokens", type=int, default=None,
                   help="the short probe's tokens (offload.layers.model_form.SHORT_PROBE_TOKENS; for the CPU smoke)")
    p.add_argument("--progress", type=int, default=None,
                   help="rank 0 prints a line every this many layers in forward and backward (default: T29's 4)")
    p.add_argument("--out", type=Path, default=None, help="the JSON (default benchmarks/results/context_parallel_<case>.json)")
    p.add_argument("--smoke", "--cpu-smoke", dest="smoke", action="store_true",
                   help="a tiny Llama on 2 gloo processes (the figures mean nothing)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # contender,record-path: one rank's run
    return p


def _default_contenders(case: str) -> list[str]:
    return {"T29": ["ours"], "T32": ["ours"], "T30": ["ours", "ours_1gpu"]}.get(case, list(CONTENDERS))


# -- one rank --------------------------------------------------------------------------------------
def _build(args: argparse.Namespace, device: torch.device) -> tuple[Any, int, int]:
    make, frozen, length, _ = CASES[args.case]
    spec = dataclasses.replace(make(), batch=1, seq=args.length or length)
    if args.smoke:  # float32: what gloo reduces on every torch
        spec = dataclasses.replace(spec, hidden=64, intermediate=128, layers=2, heads=2, kv_heads=1, vocab=128,
                                   dtype=torch.float32)
    args.full_layers = spec.layers  # what a preflight extrapolates to
    if args.layers:
        spec = dataclasses.replace(spec, layers=args.layers)
    model, _ = spec.build(device, init_in_dtype=True)  # the same weights on every rank
    if args.smoke:
        model.config._attn_implementation = "eager"  # the CPU has no ring kernel
    trainable = train_norms_only(model) if frozen else sum(p.numel() for p in model.parameters())
    return model, spec.seq, trainable


def _context(contender: str, model: Any, smoke: bool, probe_length: int) -> Optional[Any]:
    if not contender.startswith("ours"):
        return None
    budget: Any = 1 << 30 if smoke else "device"  # on the CPU a byte budget plans as "device" does on CUDA
    kw: dict[str, Any] = {"device": "cpu", "min_offload_bytes": 0} if smoke else {}
    if probe_length:
        # The full-length bucket is new after the short one's: its own plan at once, not a
        # stand-in while it is made in the background (a preflight measures the plan itself).
        kw["plan_ahead"] = False
    return offload.OffloadActivations(model.model.layers, model=model, memory_budget_bytes=budget, **kw)


def _phase(oa: Optional[Any]) -> str:
    if oa is None:
        return "-"
    return "planned" if oa.plan is not None else "probe"


def _progress(args: argparse.Namespace) -> int:
    if args.progress is not None:
        return args.progress
    return 1 if args.layers else PROGRESS.get(args.case, 0)


def run_rank(args: argparse.Namespace, contender: str, record_path: Path) -> int:
    """One rank of one contender: build, shard, the steps; its records to ``record_path``."""
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    if args.short_probe_tokens:
        offload.layers.model_form.SHORT_PROBE_TOKENS = args.short_probe_tokens
    records: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    preflight: Optional[dict[str, Any]] = None
    try:
        from torch.distributed.fsdp import fully_shard

        meshes = offload.parallel.make_mesh(cp=dist.get_world_size(), device_type=device.type)
        model, length, info["trainable_params"] = _build(args, device)
        for module in [*model.model.layers, model]:
            fully_shard(module, mesh=meshes.fsdp)
        short = args.probe_length if contender.startswith("ours") else 0
        oa = _context(contender, model, args.smoke, short)
        layers = list(model.model.layers)
        every = _progress(args)
        clock = LayerClock(layers, device, every) if rank == 0 and (every or args.layers) else None
        if args.plan_only and oa is not None:
            stop_when_planned(layers[0], oa, length // dist.get_world_size())
        vocab = model.config.vocab_size
        ckpt = hf_checkpointing(model) if contender == "hf_ckpt" else contextlib.nullcontext()
        steps = 1 if args.plan_only else args.steps or (1 if args.layers else CASES[args.case][3])
        run = _Runner(contender, model, meshes, oa, vocab, device, clock, rank == 0, dist.get_world_size())
        with ckpt:
            # Probe steps (and one planned step) at the short length, so that the first step at
            # the full length is a planned one: no full-length probe step.
            while short and oa is not None and oa.plan is None and len(records) < MORE_FOR_A_PLAN:
                if run.step(records, len(records), short):
                    break
            # Not for a step of minutes (T29, a preflight): --steps full-length steps, planned or not.
            extra = MORE_FOR_A_PLAN if oa is not None and args.case != "T29" and not (args.layers or args.plan_only) else 0
            for i in range(steps + extra):
                # A planned contender goes on past --steps until a step ran under its plan.
                if i >= steps and any(r.get("phase") in ("planned", SHORT) and r["length"] == length for r in records):
                    break
                if run.step(records, len(records), length):
                    break
        info["plan"] = oa.plan.describe() if oa is not None and oa.plan is not None else None
        if args.layers and oa is not None and oa.plan is not None and not any("error" in r for r in records):
            preflight = extrapolate(oa.plan, args.full_layers, layer_weight_bytes(layers[-1]),
                                    oa.engine.arena.plan_host_bytes(), head_info(model))
    except Exception as exc:  # noqa: BLE001 - a failure outside a step is this contender's result
        traceback.print_exc()
        info["error"] = f"{type(exc).__name__}: {exc}"[:600]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    if args.layers:
        info["preflight"] = [None] * dist.get_world_size()
        dist.all_gather_object(info["preflight"], preflight)
    if rank == 0:
        record_path.write_text(json.dumps({"ranks": gathered, **info}))
    dist.destroy_process_group()
    return 0


@dataclasses.dataclass
class _Runner:
    """One contender's steps on this rank (rank 0 prints each)."""

    contender: str
    model: Any
    meshes: Any
    oa: Optional[Any]
    vocab: int
    device: torch.device
    clock: Optional[LayerClock]
    prints: bool
    cp: int

    def step(self, records: list[dict[str, Any]], i: int, length: int) -> bool:
        """Run step ``i`` at ``length`` tokens, append its record; whether it failed."""
        label = f"{self.contender} step {i}"
        if self.clock is not None:
            self.clock.start(label, length // self.cp)
        r = _step(i, self.model, self.meshes, self.oa, self.vocab, length, self.device, self.clock)
        records.append(r)
        if self.prints:
            shown = r.get("error") or f"{r['ms'] / 1e3:.2f} s, peak {r['peak_bytes'] / 2**30:.2f} GiB"
            host = f", host {r['host_bytes'] / 2**30:.2f} GiB" if r.get("host_bytes") is not None else ""
            print(f"{label}: {length} tokens on {self.meshes.cp.size()} ranks, {shown}{host}, {r['phase']}",
                  flush=True)
        return "error" in r


def _step(i: int, model: Any, meshes: Any, oa: Optional[Any], vocab: int, length: int,
          device: torch.device, clock: Optional[LayerClock] = None) -> dict[str, Any]:
    cuda = device.type == "cuda"
    g = torch.Generator().manual_seed(1000 + i)  # the same batch on every CP rank
    ids = torch.randint(0, vocab, (1, length), generator=g).to(device)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    record: dict[str, Any] = {"step": i, "length": length}
    start = time.perf_counter()
    try:
        # The smoke's eager attention would be refused (context_parallel patches SDPA only).
        checked = None if model.config._attn_implementation == "eager" else model
        with offload.parallel.context_parallel(meshes.cp, {"input_ids": ids, "labels": ids}, model=checked) as shard:
            with oa if oa is not None else contextlib.nullcontext():
                record["phase"] = _phase(oa)  # at the entry: the plan in force for this step
                loss = model(**shard.inputs).loss
                if record["phase"] == "probe" and oa is not None and oa.plan is not None:
                    # Planned at its model entry. If it began as a probe step (the first steps'
                    # record says so), the call was probed short inside it first; else it is
                    # the first planned step, counted with the probe steps (T32, as before).
                    kinds = [row["kind"] for row in oa.first_steps]
                    record["phase"] = SHORT if kinds and kinds[-1] != "planned" else "probe"
            (loss * shard.loss_scale).backward()
        record["loss"] = offload.parallel.global_loss(loss, meshes.cp, meshes.dp).item()
        if cuda:
            torch.cuda.synchronize(device)
        record["ms"] = (time.perf_counter() - start) * 1e3
        if clock is not None:
            end = clock.finish()
            record["layer_ms"] = per_layer_ms(clock.marks, clock.count)
            first = next((t for phase, _, t in clock.marks if phase == "fwd"), None)
            # From the first layer's entry on: without a short probe run inside the call.
            record["clock_ms"] = 1e3 * (end - first) if first is not None else None
    except PlanMade:  # --plan-only: the step's own plan, the step not run
        record.update(phase="plan only", planned=planned_figures(oa.plan), ms=(time.perf_counter() - start) * 1e3)
    except Exception as exc:  # noqa: BLE001 - recorded; FSDP2 cannot go on past it
        traceback.print_exc()
        record["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    record.setdefault("phase", _phase(oa))
    record["peak_bytes"] = torch.cuda.max_memory_allocated(device) if cuda else 0
    if oa is not None:
        record["host_bytes"] = oa.stats["host_peak_bytes"]  # the most this rank's arena held at once
    model.zero_grad(set_to_none=True)
    return record


def run_argv(argv: list[str]) -> int:
    """One rank, from its command line (what :func:`workers.spawn_ranks` calls)."""
    args = parser().parse_args(argv)
    contender, path = args.worker.split(",", 1)
    return run_rank(args, contender, Path(path))


# -- the parent ------------------------------------------------------------------------------------
def summarize(contender: str, result: dict[str, Any], length: int) -> dict[str, Any]:
    """Median steady step (slowest rank, past the first step and any probe, at the full
    ``length``), peak, planning cost, and a preflight's per-layer figures."""
    ranks = result.get("ranks") or [[]]
    steps = [[r[i] for r in ranks] for i in range(min(len(r) for r in ranks))]
    ok = [s for s in steps if not any("error" in r for r in s)]
    ms = [max(r["ms"] for r in s) for s in ok]
    full = [s for s in ok if s[0]["length"] == length]
    steady = [m for s, m in zip(ok, ms) if s[0]["step"] >= 1 and s[0]["phase"] in ("-", "planned")
              and s[0]["length"] == length]
    median = sorted(steady)[len(steady) // 2] if steady else None
    before_plan = [m for s, m in zip(ok, ms) if s[0]["phase"] in ("probe", SHORT)]
    planning = (sum(before_plan) - len(before_plan) * median) / median if median and before_plan else None
    errors = [r["error"] for s in steps for r in s if "error" in r] + ([result["error"]] if "error" in result else [])
    return {"contender": contender, "steps_finished": len(ok), "median_steady_ms": median,
            "full_length_steps": len(full),
            # The first step at the full length: a planned one, not a probe step (T29's condition).
            "first_full_phase": full[0][0]["phase"] if full else None,
            "full_ms": [max(r["ms"] for r in s) for s in full],
            "layer_ms": [s[0].get("layer_ms") for s in full],
            "clock_ms": [s[0].get("clock_ms") for s in full],
            "host_bytes": [max(r.get("host_bytes") or 0 for r in s) for s in full],
            "peak_bytes": max((r["peak_bytes"] for s in steps for r in s), default=0),
            "preflight": result.get("preflight"),
            "planned": [r["planned"] for s in full for r in s if r.get("planned")],  # --plan-only, a rank each
            "planning_steps": planning, "losses": [s[0].get("loss") for s in ok], "errors": errors[:3],
            "plan": result.get("plan"), "trainable_params": result.get("trainable_params")}


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> Optional[Path]:
    """Median step and peak per contender, if matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["contender"] for r in rows]
    a.bar(names, [(r["median_steady_ms"] or 0) / 1e3 for r in rows])
    a.set_ylabel("median step (s)")
    b.bar(names, [r["peak_bytes"] / 2**30 for r in rows])
    b.set_ylabel("peak per GPU (GiB)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def verdicts(case: str, rows: dict[str, dict[str, Any]], nproc: int = 2) -> list[str]:
    """The case's target, PASS or MISS with the figures (T29 on ``nproc`` GPUs: the target's are 2)."""
    ours = rows.get("ours")
    if case == "T29" and ours:
        return [f"T29 one step of the LLAMA-8B shape on {nproc} GPUs: {'PASS' if ours['full_length_steps'] else 'MISS'} "
                f"({ours['full_length_steps']} steps at the full length, the first one {ours['first_full_phase']}; "
                f"{ours['full_ms']} ms, peak {ours['peak_bytes'] / 2**30:.1f} GiB)"]
    if case == "T30" and ours and rows.get("ours_1gpu") and ours["median_steady_ms"] and rows["ours_1gpu"]["median_steady_ms"]:
        ratio = ours["median_steady_ms"] / rows["ours_1gpu"]["median_steady_ms"]
        return [f"T30 2-GPU step / 1-GPU step <= 0.6: {'PASS' if ratio <= 0.6 else 'MISS'} ({ratio:.2f})"]
    if case == "T32" and ours and ours["planning_steps"] is not None:
        return [f"T32 planning <= 2 steps: {'PASS' if ours['planning_steps'] <= 2 else 'MISS'} "
                f"({ours['planning_steps']:.2f} steps)"]
    return []


def main(argv: Optional[list[str]] = None) -> int:
    """Spawn each contender's ranks in turn (``--nproc``, one for ``ours_1gpu``), then report."""
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.worker:  # under torchrun, one contender: --worker ours,/tmp/ours.json
        return run_argv(argv)
    case = "smoke" if args.smoke else args.case
    argv = [a for a in argv if a not in ("--smoke", "--cpu-smoke")] + (["--smoke", "--case", "smoke"] if args.smoke else [])
    contenders = args.contenders.split(",") if args.contenders else _default_contenders(case)
    length = args.length or CASES[case][2]
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for contender in contenders:
            path = Path(tmp) / f"{contender}.json"
            nproc = 1 if contender == "ours_1gpu" else args.nproc
            code = spawn_ranks(run_argv, nproc, [*argv, "--worker", f"{contender},{path}"])
            result = json.loads(path.read_text()) if path.exists() else {"error": f"the ranks exited with {code}"}
            rows[contender] = summarize(contender, result, length)
            print(f"{contender}: {rows[contender]}", flush=True)
    lines = verdicts(case, rows, args.nproc) if not (args.layers or args.plan_only) else []
    if args.layers:
        import psutil

        memory = psutil.virtual_memory()
        full = dataclasses.replace(CASES[case][0]()).layers if not args.smoke else 2
        for contender, row in rows.items():
            lines += [f"{contender} {line}" for line in
                      preflight_report(row, args.layers, full, length, args.nproc, memory.total, memory.available,
                                                       args.time_left_s)]
    if args.plan_only:
        import psutil

        memory = psutil.virtual_memory()
        for contender, row in rows.items():
            lines += [f"{contender} {line}" for line in plan_only_report(row, length, args.nproc, memory.total,
                                                                         memory.available, args.time_left_s)]
    for line in lines:
        print(line)
    name = f"context_parallel_{case}" + (f"_preflight{args.layers}" if args.layers else "_plan" if args.plan_only else "")
    out = args.out or RESULTS / ("smoke" if args.smoke else "") / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"case": case, "length": length, "nproc": args.nproc, "layers": args.layers,
               "probe_length": args.probe_length, "rows": list(rows.values()),
               "verdicts": lines, "torch": torch.__version__,
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    out.write_text(json.dumps(payload, indent=1))
    png = plot(list(rows.values()), out.with_suffix(".png"), f"context parallel {case}")
    print(f"wrote {out}" + (f" and {png}" if png else ""))
    return 0 if all(r["steps_finished"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
