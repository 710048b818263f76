"""The first steps with offload against a steady step (issue 12; target T14 of docs/benchmarks.md).

The first step with offload makes its pinned host memory (``torch.empty(pin_memory=True)`` costs
~0.7 ms per MB on our H100 host); T14 asks that it cost at most 1.5x a steady step.

Workloads, one after the other in one process, GPU memory freed between them:

* GPT-A (``workloads.gpt_a``), TransformerEngine's call shape, all layers but the last offloaded;
* LLAMA-1B (HF ``LlamaForCausalLM``, random init, bf16, SDPA, as ``pareto.py`` builds it) with
  ``OffloadActivations(model.model.layers)`` (all layers but the last offloaded).

Variants per workload, in this order:

1. ``plain (cold)``: the plain model's first steps in this process (after ``--warmup`` untimed
   plain steps, 0 by default). CUDA and cuBLAS warm-up hit plain too; this run is also the warm-up
   that keeps cold-CUDA costs out of the offload variants' step 1.
2. ``offload``: a FRESH context (a new object, so step 1 really makes its pinned memory).
3. ``offload, no wait``: a fresh context with ``wait_for_pinning=False``: a group whose pinned
   block is not ready stays on the GPU (the GPU has room here) while the block pins in the
   background, so step 1 does not wait; its cost is a higher peak in the first steps (the peak of
   steps 1, 2 and the steady step are reported). Engines without the option skip it.
4. ``offload + reserve``: a fresh context, ``ctx.reserve(nbytes)`` called before step 1 and timed
   on its own (``nbytes``: the most pinned bytes the ``offload`` run held, else its offloaded
   bytes). Engines without ``reserve`` (before issue 12) skip it.
5. ``plain (warm)``: the plain model again, for its step 1 in a warm process.

Before every variant the CUDA caching allocator and PyTorch's pinned host cache are emptied (so no
variant inherits the pinned blocks of the one before it, and every step 1 grows the device
allocator alike: ``plain (warm)`` shows what that costs without offload).

Each step (forward + backward, gradients dropped, no optimizer) is timed with the host wall clock
around the whole step, ``torch.cuda.synchronize()`` at its end (and before its start). Reported:
step 1, step 2 and the steady step (median of steps 5..N), the ratios step1/steady and
step2/steady, and ``pinned_allocations`` / ``pinned_bytes_held`` of the context's stats after
steps 1 and 2 and at the end. T14: step 1 <= 1.5x steady, judged on the ``offload`` variant (the
reserve variant's verdict, reserve call excluded, is printed next to it).

``--registration GIB`` measures instead what pinning in the background costs this thread's GPU
work (issue 50 s1: a first plan's stand-in step ran as long as its plan's blocks took to pin): three
loops, ``kernels`` (eight 8192^2 bf16 matmuls, then a synchronise), ``launches`` (400 tiny
kernels, then a synchronise) and ``queued`` (400 of those matmuls, about 0.6 s of GPU work queued
ahead, then a synchronise: a stall of the host thread's launches alone hides behind the queue, one
of the GPU's work does not), each timed alone, then again and again while ``--pinner-workers``
threads (default: ``offload.host.pinning.PINNER_WORKERS``) pin ``GIB`` GiB in blocks of ``--block-mib``
with ``--pin-method`` (``register_huge``, the arena's for blocks from 8 MiB; ``host_alloc``:
``cuMemHostAlloc``; ``staged``: ``register_huge`` in its two halves, every block faulted in, then
every block locked, ``PinnedBuffer(..., lock_now=False)`` and ``lock_pages()``, a row for each).
The stall is the loops' time beyond their quiet median, reported against the pinning's wall
time. It needs the native extension and CUDA.

``--new-lengths`` measures instead a new length's first step against its later ones (issue 50 s2;
``new_lengths.py``): LLAMA-1B, batch 4, ``OffloadActivations(layers, num_offload_layers=0)``, two
steps at 1024, then three at each of 2048, 3072, 4096 and 6144; the model plain and under HF
checkpointing (non-reentrant), with ``offload.layers.attention_graphs`` off and on, one process
per case (cuDNN's plans are cached per process), ``--rounds`` times. Writes ``first_step_new_lengths.json``. With ``--where``, where the extra time of a new
length's first step goes instead (the copy off): forward and backward apart, and the ops whose
host time grew most under torch's profiler (``first_step_new_length_where.json``).

Usage: ``python benchmarks/first_step.py [--steps N] [--models gpt_a,llama_1b]``; ``--cpu-smoke``
for a tiny CPU check. Writes ``benchmarks/results/first_step.json``. About 1 to 2 minutes of GPU
time with the defaults (LLAMA-1B's first offload step took 19 s before issue 12). Not in
``run_all.sh``: it is slow, and it wants a fresh process.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Optional

import torch

import common
import measure
import new_lengths
import workers
import workloads

T14_RATIO = 1.5
STEADY_FROM = 5  # the steady step is the median of steps 5..N (1-based)
MIN_STEPS = 3    # fewer steps (CPU smoke runs) take the median of steps min(5, N)..N
MODELS = ("gpt_a", "llama_1b")


def steady_from(steps: int) -> int:
    """The first step (1-based) of the steady median."""
    return min(STEADY_FROM, steps)


def empty_host_cache() -> Optional[str]:
    """Give PyTorch's cached pinned host blocks back to the OS; the function used, or None.

    The engine before issue 12 pins with ``torch.empty(pin_memory=True)``, whose blocks go back to
    PyTorch's host cache when freed: without this, a fresh context would reuse the previous
    variant's pinned memory and its step 1 would look cheap.
    """
    candidates: list[tuple[str, Callable[[], Any]]] = []
    memory = getattr(getattr(torch, "accelerator", None), "memory", None)
    for owner, name, label in (
        (memory, "empty_host_cache", "torch.accelerator.memory.empty_host_cache"),
        (getattr(torch, "accelerator", None), "empty_host_cache", "torch.accelerator.empty_host_cache"),
        (torch._C, "_host_emptyCache", "torch._C._host_emptyCache"),
    ):
        fn = getattr(owner, name, None) if owner is not None else None
        if callable(fn):
            candidates.append((label, fn))
    for label, fn in candidates:
        try:
            fn()
            return label
        except Exception:  # noqa: BLE001 - try the next spelling
            continue
    return None


def host_cache_figures(env: common.Env) -> dict[str, Optional[int]]:
    """Bytes PyTorch's pinned host allocator owns (in use + cached) and has handed out (in use).

    Read from ``torch.cuda.host_memory_stats`` where it exists; None where it cannot tell.
    """
    out: dict[str, Optional[int]] = {"owned_bytes": None, "active_bytes": None}
    if not env.cuda:
        return out
    try:
        stats = torch.cuda.host_memory_stats()
    except Exception:  # noqa: BLE001 - absent on some versions
        return out
    for key, name in (("owned_bytes", "allocated_bytes.current"), ("active_bytes", "active_bytes.current")):
        if name in stats:
            out[key] = int(stats[name])
    return out


def reset_memory(env: common.Env) -> dict[str, Any]:
    """Empty the device and pinned host caches between variants (see the module notes)."""
    common.free_memory(env)
    used = empty_host_cache() if env.cuda else None
    return {"host_cache_emptied_with": used, "pinned_host_allocator_after": host_cache_figures(env)}


def pinned_figures(ctx: Any) -> dict[str, Any]:
    """The context's pinned-memory figures of its last finished step."""
    try:
        stats = dict(ctx.stats)
    except Exception as exc:  # noqa: BLE001 - figures only
        return {"error": repr(exc)}
    return {key: stats.get(key) for key in ("pinned_allocations", "pinned_bytes_held", "offloaded_bytes", "offloaded_tensors", "groups_offloaded")}


def find_reserve(ctx: Any) -> tuple[Optional[Callable[[int], Any]], Optional[str]]:
    """The context's ``reserve`` (issue 12), or its engine's; (None, None) on older engines.

    Never the arena's ``reserve``: that one is the host-budget promise made at pack time, not a
    pre-allocation.
    """
    for owner, label in ((ctx, "ctx.reserve"), (getattr(ctx, "engine", None), "ctx.engine.reserve")):
        fn = getattr(owner, "reserve", None) if owner is not None else None
        if callable(fn):
            return fn, label
    return None, None


def run_steps(
    env: common.Env,
    label: str,
    step: Callable[[], None],
    steps: int,
    *,
    ctx: Any = None,
    reserve_bytes: Optional[int] = None,
) -> dict[str, Any]:
    """Time ``steps`` steps one by one (wall clock, synchronised at both ends) and return the row.

    ``ctx``: the offload context (its stats are read after steps 1 and 2 and at the end, outside
    the timed spans). ``reserve_bytes``: call the context's ``reserve`` with it before step 1.
    """
    row: dict[str, Any] = {"variant": label}
    try:
        if reserve_bytes is not None:
            reserve, how = find_reserve(ctx)
            if reserve is None:
                row["skipped"] = "this engine has no reserve()"
                print(f"  {label:<20} skipped: {row['skipped']}", flush=True)
                return row
            env.sync()
            t0 = time.perf_counter()
            result = reserve(int(reserve_bytes))
            env.sync()
            row.update(reserve_ms=(time.perf_counter() - t0) * 1e3, reserve_bytes=int(reserve_bytes),
                       reserve_call=how, reserve_result=result if isinstance(result, (bool, int, float, type(None))) else repr(result))
            if ctx is not None:
                row["pinned_after_reserve"] = pinned_figures(ctx)
        times: list[float] = []
        peaks: list[Optional[float]] = []
        for i in range(steps):
            env.sync()
            if env.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(env.device)
            t0 = time.perf_counter()
            step()
            env.sync()
            times.append((time.perf_counter() - t0) * 1e3)
            peaks.append(torch.cuda.max_memory_allocated(env.device) / common.GiB if env.device.type == "cuda" else None)
            if ctx is not None and i < 2:
                row[f"pinned_after_step{i + 1}"] = pinned_figures(ctx)
        if ctx is not None:
            row["pinned_final"] = pinned_figures(ctx)
        steady = statistics.median(times[steady_from(steps) - 1:])
        row.update(step_ms=times, peak_gib=peaks, step1_ms=times[0], step2_ms=times[1], steady_ms=steady,
                   step1_ratio=times[0] / steady, step2_ratio=times[1] / steady)
        if ctx is not None:
            row["t14_ok"] = row["step1_ratio"] <= T14_RATIO
        if "reserve_ms" in row:
            row["reserve_plus_step1_ratio"] = (row["reserve_ms"] + times[0]) / steady
        held = [row.get(f"pinned_after_step{i}", {}).get(key) for i in (1, 2) for key in ("pinned_allocations", "pinned_bytes_held")]
        row["allocs1"], row["held1"], row["allocs2"], row["held2"] = held
    except Exception as exc:  # noqa: BLE001 - one failing variant must not hide the others
        traceback.print_exc()
        row["error"] = f"{type(exc).__name__}: {exc}"
    shown = row.get("error") or row.get("skipped") or (
        f"step 1 {row['step1_ms']:.0f} ms, step 2 {row['step2_ms']:.0f} ms, steady {row['steady_ms']:.1f} ms "
        f"({row['step1_ratio']:.2f}x / {row['step2_ratio']:.2f}x)"
        + (f"; reserve {row['reserve_ms']:.0f} ms" if "reserve_ms" in row else ""))
    print(f"  {label:<20} {shown}", flush=True)
    return row


def reserve_estimate(row: dict[str, Any]) -> Optional[int]:
    """Bytes to reserve: the most pinned memory the default run held, else what it offloaded."""
    figures = [row.get(k) or {} for k in ("pinned_after_step1", "pinned_after_step2", "pinned_final")]
    held = [f.get("pinned_bytes_held") for f in figures if f.get("pinned_bytes_held")]
    if held:
        return max(held)
    offloaded = [f.get("offloaded_bytes") for f in figures if f.get("offloaded_bytes")]
    return max(offloaded) if offloaded else None


class Workload:
    """One model: how to build it, its plain step, and a step with a fresh offload context."""

    def __init__(self, env: common.Env, name: str, scale: float) -> None:
        self.env = env
        self.name = name
        self.spec = workloads.WORKLOADS[name](scale)
        self.model: Any = None
        self.layers: Any = None
        self.x: Any = None

    def build(self) -> None:
        if isinstance(self.spec, workloads.LlamaSpec):
            self.model, self.x = self.spec.build(self.env.device)
            self.layers = self.model.model.layers
        else:
            self.layers, make_input = self.spec.build(self.env.device)
            self.x = make_input()

    def plain_step(self) -> Callable[[], None]:
        if self.model is not None:
            return workloads.llama_step(self.model, self.x)
        return measure.make_step(self.layers, self.x)

    @contextlib.contextmanager
    def offload_step(self, **options: Any) -> Any:
        """A fresh context (with ``options``) and its step: yields ``(context, step)``; the
        context is closed after."""
        if self.model is not None:
            import offload

            options.setdefault("num_offload_layers", len(self.layers) - 1)  # the fixed schedule's first step
            oa = offload.OffloadActivations(self.layers, device=self.env.offload_device, **options)
            try:
                yield oa, workloads.llama_step(self.model, self.x, lambda: oa)
            finally:
                oa.close()
        else:
            n = len(self.layers)
            ctx, sync = measure.offload_context(self.env, n - 1, n, **options)
            yield ctx, measure.make_step(self.layers, self.x, context=ctx, sync=sync)

    def drop(self) -> None:
        self.model = self.layers = self.x = None


def run_workload(env: common.Env, name: str, scale: float, steps: int) -> dict[str, Any]:
    work = Workload(env, name, scale)
    print(f"\n{work.spec.describe()}", flush=True)
    rows: list[dict[str, Any]] = []
    resets: list[dict[str, Any]] = []
    try:
        work.build()
        plain = work.plain_step()
        for _ in range(env.args.warmup):
            plain()
        rows.append(run_steps(env, "plain (cold)", plain, steps))
        resets.append(reset_memory(env))
        with work.offload_step() as (ctx, step):
            rows.append(run_steps(env, "offload", step, steps, ctx=ctx))
        del ctx, step
        resets.append(reset_memory(env))
        nbytes = reserve_estimate(rows[-1])
        try:
            with work.offload_step(wait_for_pinning=False) as (ctx, step):
                rows.append(run_steps(env, "offload, no wait", step, steps, ctx=ctx))
            del ctx, step
        except TypeError as exc:  # an engine before the option
            rows.append({"variant": "offload, no wait", "skipped": str(exc)})
        resets.append(reset_memory(env))
        with work.offload_step() as (ctx, step):
            if nbytes is None:
                rows.append({"variant": "offload + reserve", "skipped": "no byte figure from the offload run"})
            else:
                rows.append(run_steps(env, "offload + reserve", step, steps, ctx=ctx, reserve_bytes=nbytes))
        del ctx, step
        resets.append(reset_memory(env))
        rows.append(run_steps(env, "plain (warm)", plain, steps))
        del plain
    except Exception as exc:  # noqa: BLE001 - e.g. transformers missing: the other workload still runs
        traceback.print_exc()
        rows.append({"variant": "(workload)", "error": f"{type(exc).__name__}: {exc}"})
    finally:
        work.drop()
        resets.append(reset_memory(env))
    return {"workload": work.spec.describe(), "rows": rows, "memory_resets": resets}


def stall_figures(loop_ms: list[float], quiet_ms: float, pin_s: float) -> dict[str, float]:
    """The loop's time beyond its quiet median while pinning ran (seconds), and that against the
    pinning's wall time (1.0: the loop made no progress while blocks were pinned)."""
    stall = max(0.0, sum(loop_ms) - len(loop_ms) * quiet_ms) / 1e3
    return {"iterations": len(loop_ms), "stall_s": stall, "pin_s": pin_s,
            "stall_share": stall / pin_s if pin_s > 0 else 0.0}


def registration_stall(gib: int, block_mib: int, method: str = "register_huge",
                       workers: int = 0) -> list[dict[str, Any]]:
    """Each loop's stall while the arena's background pinner pins ``gib`` GiB (see the module
    notes, ``--registration``)."""
    import concurrent.futures
    import statistics

    from offload.host import native
    from offload.host.pinning import PINNER_WORKERS

    workers = workers or PINNER_WORKERS

    if not torch.cuda.is_available() or native.extension() is None:
        raise SystemExit(f"--registration needs CUDA and the native extension ({native.native_reason()})")
    device = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    small = torch.zeros(1024, device=device)

    def kernels() -> None:
        for _ in range(8):
            a @ a

    def launches() -> None:
        for _ in range(400):
            small.add_(1)

    def queued() -> None:
        for _ in range(400):
            a @ a

    def timed(fn: Callable[[], None]) -> float:
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - started) * 1e3

    # "staged": register_huge's two halves, each measured on its own: every block faulted in (no
    # driver call), then every block locked (cuMemHostRegister).
    halves = ("fault", "lock") if method == "staged" else (method,)

    def pin(part: str, block: Any) -> Any:
        # ``block``: a size, or (locking) the faulted-in buffer.
        ext = native.extension()
        if part == "fault":
            return ext.PinnedBuffer(block, "register_huge", numa_node=-1, lock_now=False)
        torch.cuda.set_device(device)  # the driver pins in the thread's current context
        if part == "lock":
            block.lock_pages()
            return block
        return ext.PinnedBuffer(block, part, numa_node=-1)

    rows = []
    for name, fn in (("kernels", kernels), ("launches", launches), ("queued", queued)):
        for _ in range(3):
            timed(fn)
        quiet = statistics.median(timed(fn) for _ in range(15))
        blocks: list[Any] = [block_mib << 20] * ((gib << 10) // block_mib)
        for part in halves:
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                started = time.perf_counter()
                futures = [pool.submit(pin, part, b) for b in blocks]
                loop = []
                while not all(f.done() for f in futures):
                    loop.append(timed(fn))
                pin_s = time.perf_counter() - started
                blocks = [f.result() for f in futures]
            rows.append({"loop": name, "quiet_ms": quiet, "gib": gib, "block_mib": block_mib, "method": part,
                         "workers": workers, **stall_figures(loop, quiet, pin_s)})
        del blocks
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = common.make_parser(__doc__, warmup=0, steps=8, smoke_warmup=0, smoke_steps=MIN_STEPS)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)} (default: both)")
    parser.add_argument("--registration", type=int, default=0, metavar="GIB",
                        help="measure what pinning GIB GiB in the background costs this thread's GPU work instead")
    parser.add_argument("--block-mib", type=int, default=1024, help="--registration's block size (MiB)")
    parser.add_argument("--pin-method", default="register_huge",
                        choices=("register_huge", "register", "host_alloc", "staged"),
                        help="--registration's way to pin (offload.host.pinning; staged: register_huge's "
                             "two halves, faulting in then locking, each measured)")
    parser.add_argument("--pinner-workers", type=int, default=0,
                        help="--registration's pinning threads (default: offload.host.pinning.PINNER_WORKERS)")
    parser.add_argument("--new-lengths", action="store_true",
                        help="measure a new length's first step, attention backward built ahead off and on, instead")
    parser.add_argument("--rounds", type=int, default=2, help="--new-lengths' rounds of its four cases")
    parser.add_argument("--where", action="store_true",
                        help="with --new-lengths: where a new length's first step spends its extra time (profiled)")
    workers.add_worker_options(parser)  # (--new-lengths' cases run as workers)
    env = common.setup(parser, argv)
    args = env.args
    if args.worker:
        workers.write_worker_result(args.worker_out, new_lengths.run_worker(env, args.worker))
        return 0
    if args.new_lengths and args.where:
        rows = new_lengths.wheres(env, __file__)
        common.write_json("first_step_new_length_where", env, {"rows": rows})
        for row in rows:
            print(json.dumps(row, indent=1))
        return common.exit_status([r["spec"] for r in rows if "error" in r])
    if args.new_lengths:
        rows = new_lengths.cases(env, __file__, args.rounds)
        common.write_json("first_step_new_lengths", env, {"rows": rows})
        common.print_table(f"a new length's first step, ms and x its later steps ({common.device_name(env)})", rows, [
            ("round", "round", ""), ("case", "case", ""), ("copies", "copies", "")] +
            [(f"{n}_{k}", f"{n} {k}", f) for n in new_lengths.LENGTHS for k, f in (("first", ".0f"), ("x", ".2f"))])
        return common.exit_status([r["spec"] for r in rows if "error" in r])
    if args.registration:
        rows = registration_stall(args.registration, args.block_mib, args.pin_method, args.pinner_workers)
        common.write_json("first_step_registration", env, {"rows": rows})
        common.print_table(f"pinning in the background against this thread's GPU work ({common.device_name(env)})", rows, [
            ("loop", "loop", ""), ("method", "pinned by", ""), ("workers", "threads", ""), ("quiet_ms", "quiet ms", ".1f"), ("iterations", "iterations", ""),
            ("pin_s", "pinning s", ".2f"), ("stall_s", "stall s", ".2f"), ("stall_share", "stall / pinning", ".2f")])
        return 0
    if args.steps < MIN_STEPS:
        parser.error(f"--steps must be >= {MIN_STEPS} (step 1, step 2 and a steady step; 8 or more on the GPU)")
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        parser.error(f"unknown --models {unknown}; choose from {', '.join(MODELS)}")
    scale = workloads.scale_for(env.smoke)
    print(f"device: {common.device_name(env)}; torch {torch.__version__}; {args.steps} steps per variant, "
          f"steady = median of steps {steady_from(args.steps)}..{args.steps}; wall clock per step, synchronised")
    t_start = time.perf_counter()
    results = {name: run_workload(env, name, scale, args.steps) for name in names}

    lines = []
    targets: dict[str, Any] = {}
    for name, res in results.items():
        for r in res["rows"]:
            if r.get("t14_ok") is None:
                continue
            main_row = r["variant"] == "offload"
            key = f"T14 {name}" + ("" if main_row else f" ({r['variant']})")
            targets[key] = {"ok": r["t14_ok"], "step1_ratio": r["step1_ratio"], "step2_ratio": r["step2_ratio"],
                            "reserve_plus_step1_ratio": r.get("reserve_plus_step1_ratio")}
            extra = "" if "reserve_ms" not in r else (f"; with the reserve call ({r['reserve_ms']:.0f} ms) "
                                                   f"{r['reserve_plus_step1_ratio']:.2f}x")
            peaks = r.get("peak_gib") or []
            if peaks and peaks[0] is not None:
                extra += f"; peak step 1 {peaks[0]:.2f} GiB, steady {peaks[-1]:.2f} GiB"
            lines.append(
                f"{'T14' if main_row else '   '} {common.verdict(r['t14_ok'])}  {name} {r['variant']}: step 1 "
                f"{r['step1_ms']:.0f} ms = {r['step1_ratio']:.2f}x steady {r['steady_ms']:.1f} ms (need <= {T14_RATIO}x); "
                f"step 2 {r['step2_ratio']:.2f}x{extra}")
    failed = [f"{name}: {r['variant']}" for name, res in results.items() for r in res["rows"] if "error" in r]
    common.write_json("first_step", env, {
        "features": {"reserve": {name: next((r.get("reserve_call") for r in res["rows"] if r.get("reserve_call")), None)
                                 for name, res in results.items()}},
        "steady_from_step": steady_from(args.steps),
        "targets": targets,
        "workloads": results,
        "failed": failed,
        "seconds": time.perf_counter() - t_start,
    })
    for name, res in results.items():
        for r in res["rows"]:
            for key in ("held1", "held2"):
                r[key.replace("held", "gib")] = common.gib(r.get(key))
            if "error" in r:
                r["variant"] += " (FAILED)"
            elif "skipped" in r:
                r["variant"] += " (skipped)"
        common.print_table(f"{name}: wall ms per step, synchronised ({common.device_name(env)})", res["rows"], [
            ("variant", "variant", ""),
            ("step1_ms", "step 1", ".1f"),
            ("step2_ms", "step 2", ".1f"),
            ("steady_ms", "steady", ".1f"),
            ("step1_ratio", "1/steady", ".2f"),
            ("step2_ratio", "2/steady", ".2f"),
            ("reserve_ms", "reserve ms", ".1f"),
            ("allocs1", "pin allocs 1", ""),
            ("allocs2", "pin allocs 2", ""),
            ("gib1", "pinned GiB 1", ".2f"),
            ("gib2", "pinned GiB 2", ".2f"),
        ])
    print(f"\nplain (cold) ran first and warmed CUDA up for the offload variants; every variant starts with empty "
          f"device and pinned caches ({time.perf_counter() - t_start:.0f} s in all)")
    print("targets (measured in this run):")
    for line in lines:
        print("  " + line)
    return common.exit_status(failed)


if __name__ == "__main__":
    sys.exit(main())
