"""Shared helpers of the benchmark suite: setup, step timing, memory, JSON, tables. The
bandwidth and memory probes live in ``memory_probes.py`` (re-exported here), the per-process
contender runs in ``workers.py`` and the per-step records of a step stream in ``step_records.py``.

Every benchmark is GPU-only. ``--cpu-smoke`` runs a tiny version on the CPU (the offload context
with ``device="cpu"``, the host transport) so the scripts can be checked on a machine without a
GPU; its numbers mean nothing and its JSON goes to ``benchmarks/results/smoke/`` so that it never
overwrites a GPU result.

Timing of one training step (forward + backward + dropping the gradients; no optimizer):

* ``gpu_ms``: CUDA events recorded on the current stream before and after the step. They measure
  the GPU timeline of the step, including any idle time when the host cannot keep up (a host-bound
  step such as SMALL is timed correctly too).
* ``host_ms``: ``time.perf_counter`` around the Python call of the step, without synchronising:
  the host (main thread) time the step costs when the GPU keeps up.
* ``cpu_ms``: ``time.process_time`` around the same call: CPU time of all the process's threads
  (autograd runs CUDA backward on its own device thread, which the main thread waits for).
* ``wall_ms``: wall time of all timed steps plus one final synchronize, divided by their count
  (the throughput view).

Medians are quoted; min/max/quartiles give the spread. Warm-up steps (which allocate the pinned
arena, cuBLAS workspaces, autotuning) are never timed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

BENCH_DIR = Path(__file__).resolve().parent
try:  # the package is normally installed (pip install -e .); else use this checkout
    import offload  # noqa: F401
except ImportError:
    sys.path.append(str(BENCH_DIR.parent))
if str(BENCH_DIR) not in sys.path:  # the sibling helper modules below, however common was found
    sys.path.append(str(BENCH_DIR))
RESULTS_DIR = BENCH_DIR / "results"
GiB = float(1 << 30)

# Split out to keep this file readable (and under the suite's 600 lines); re-exported so that
# ``common.pinned_bandwidth`` etc. keep working for every script and for older checkouts' tests.
from memory_probes import (  # noqa: E402,F401
    MB, Census, copy_floor_ms, layer_activation_bytes, pinned_bandwidth, saved_tensor_census,
)


# -- setup ----------------------------------------------------------------------------------------
@dataclass
class Env:
    """Where a benchmark runs. ``offload_device`` is what to pass as ``device=`` to the context."""

    device: torch.device
    smoke: bool
    offload_device: Optional[str]
    args: argparse.Namespace

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def make_parser(description: str, *, warmup: int, steps: int, smoke_warmup: int = 1, smoke_steps: int = 2) -> argparse.ArgumentParser:
    """The options every benchmark takes (add your own, then call :func:`setup`)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny run on the CPU to check the script (numbers meaningless)")
    parser.add_argument("--warmup", type=int, default=None, help=f"untimed warm-up steps per variant (default {warmup}; {smoke_warmup} with --cpu-smoke)")
    parser.add_argument("--steps", type=int, default=None, help=f"timed steps per variant (default {steps}; {smoke_steps} with --cpu-smoke)")
    parser.add_argument("--name", default=None, help="results file name (benchmarks/results/<name>.json)")
    parser.add_argument("--no-json", action="store_true", help="do not write the results file")
    parser.set_defaults(_defaults=(warmup, steps, smoke_warmup, smoke_steps))
    return parser


def apply_defaults(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Fill ``--warmup``/``--steps`` with :func:`make_parser`'s defaults (their smoke ones with
    ``--cpu-smoke``) and check them. :func:`setup` calls it; a parent process that spawns the
    workers and must not start CUDA calls it alone."""
    warmup, steps, smoke_warmup, smoke_steps = args._defaults
    del args._defaults
    if args.warmup is None:
        args.warmup = smoke_warmup if args.cpu_smoke else warmup
    if args.steps is None:
        args.steps = smoke_steps if args.cpu_smoke else steps
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    return args


def setup(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None) -> Env:
    """Parse arguments, refuse to run without CUDA (unless ``--cpu-smoke``), seed everything."""
    args = apply_defaults(parser, parser.parse_args(argv))
    if args.cpu_smoke:
        env = Env(device=torch.device("cpu"), smoke=True, offload_device="cpu", args=args)
        print("*** --cpu-smoke: tiny sizes on the CPU (host transport); the numbers mean nothing ***")
    else:
        if not torch.cuda.is_available():
            sys.exit(
                f"{Path(sys.argv[0]).name}: this benchmark needs a CUDA GPU, and CUDA is not available "
                f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}). Run it on the GPU machine, "
                "or pass --cpu-smoke for a tiny CPU run that only checks the script."
            )
        env = Env(device=torch.device("cuda", torch.cuda.current_device()), smoke=False, offload_device=None, args=args)
    torch.manual_seed(0)
    return env


def device_name(env: Env) -> str:
    if env.cuda:
        return torch.cuda.get_device_name(env.device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def free_memory(env: Env) -> None:
    """Drop garbage (contexts, graphs, arenas) and give cached GPU blocks back between variants."""
    gc.collect()
    if env.cuda:
        torch.cuda.synchronize(env.device)
        torch.cuda.empty_cache()


# -- one training step ----------------------------------------------------------------------------
def make_step(
    layers: torch.nn.Module,
    x: torch.Tensor,
    *,
    context: Any = None,
    sync: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    forward_wrapper: Optional[Callable[[], Any]] = None,
    grad_out: Optional[torch.Tensor] = None,
    on_forward: Optional[Callable[[], None]] = None,
) -> Callable[[], None]:
    """One training step: forward in TransformerEngine's call shape, backward, grads set to None.

    ``context``/``sync``: the offload context and sync function (None: plain run).
    ``forward_wrapper``: a context manager factory put around the whole forward (``save_on_cpu``).
    ``on_forward``: called between the forward's return and the backward (to time the two apart).
    The backward is seeded with a fixed random gradient (no loss kernel in the timing).
    """
    from offload.models import run_layers

    params = [p for p in layers.parameters() if p.requires_grad]
    dy = grad_out
    if dy is None:
        g = torch.Generator(device=x.device).manual_seed(1234)
        dy = torch.randn(x.shape, generator=g, device=x.device, dtype=x.dtype)

    def step() -> None:
        with forward_wrapper() if forward_wrapper is not None else contextlib.nullcontext():
            y = run_layers(layers, x, context, sync)
        if on_forward is not None:
            on_forward()
        y.backward(dy)
        del y
        for p in params:
            p.grad = None
        x.grad = None

    return step


@dataclass
class Timing:
    """Per-step times of the timed steps (ms) and the peak memory over them."""

    gpu_ms: list[float]
    host_ms: list[float]
    cpu_ms: list[float]
    wall_ms: float
    peak_bytes: Optional[int] = None
    base_bytes: Optional[int] = None  # memory allocated before the timed steps (weights, input)

    @property
    def median_ms(self) -> float:
        """The step time quoted everywhere: GPU-event median (host median in CPU smoke runs)."""
        return statistics.median(self.gpu_ms)

    def summary(self) -> dict[str, Any]:
        def spread(v: list[float]) -> dict[str, float]:
            q = statistics.quantiles(v, n=4) if len(v) >= 2 else [v[0], v[0], v[0]]
            return {"median": statistics.median(v), "min": min(v), "max": max(v), "p25": q[0], "p75": q[2], "mean": statistics.fmean(v)}

        return {
            "step_ms": spread(self.gpu_ms),
            "host_ms": spread(self.host_ms),
            "cpu_ms": spread(self.cpu_ms),
            "wall_ms_per_step": self.wall_ms,
            "peak_bytes": self.peak_bytes,
            "base_bytes": self.base_bytes,
            "steps": len(self.gpu_ms),
        }


def time_steps(step: Callable[[], None], env: Env, *, warmup: Optional[int] = None, steps: Optional[int] = None) -> Timing:
    """Run ``warmup`` untimed steps, then ``steps`` timed ones; peak memory over the timed steps."""
    warmup = env.args.warmup if warmup is None else warmup
    steps = env.args.steps if steps is None else steps
    for _ in range(warmup):
        step()
    env.sync()
    base = peak = None
    if env.cuda:
        torch.cuda.reset_peak_memory_stats(env.device)
        base = torch.cuda.memory_allocated(env.device)
    events: list[tuple[Any, Any]] = []
    host: list[float] = []
    cpu: list[float] = []
    t_wall = time.perf_counter()
    for _ in range(steps):
        if env.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        c0 = time.process_time()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        c1 = time.process_time()
        if env.cuda:
            end.record()
            events.append((start, end))
        host.append((t1 - t0) * 1e3)
        cpu.append((c1 - c0) * 1e3)
    env.sync()
    wall = (time.perf_counter() - t_wall) * 1e3 / steps
    if env.cuda:
        gpu = [s.elapsed_time(e) for s, e in events]
        peak = torch.cuda.max_memory_allocated(env.device)
    else:
        gpu = list(host)
    return Timing(gpu_ms=gpu, host_ms=host, cpu_ms=cpu, wall_ms=wall, peak_bytes=peak, base_bytes=base)


OUT_OF_MEMORY = "out of memory"


def failure(exc: BaseException) -> str:
    """How a failed contender is recorded: ``"out of memory"`` for a CUDA out-of-memory error (the
    expected end of a step that does not fit), else the exception's type and message."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return OUT_OF_MEMORY
    return f"{type(exc).__name__}: {exc}"


def fmt_gib(v: Optional[float]) -> str:
    """GiB with two decimals, or '-' when not measured."""
    return "-" if v is None else f"{v:.2f} GiB"


def timed_row(env: Env, label: str, step: Callable[[], None], *,
              before: Optional[Callable[[dict[str, Any]], None]] = None, **extra: Any) -> dict[str, Any]:
    """One contender's row: ``step`` timed by :func:`time_steps` (median step ms, host ms, peak).

    ``before(row)`` runs first under the same error handling (e.g. a planner's probe steps; it may
    add its figures to the row). A failure is printed with its traceback and recorded as the row's
    ``error`` (see :func:`failure`), so that the other contenders still run; memory is freed after,
    once the exception (whose frames hold the failed step's tensors) is gone.
    """
    row: dict[str, Any] = {"variant": label, **extra}
    try:
        if before is not None:
            before(row)
        timing = time_steps(step, env)
        row.update(step_ms=timing.median_ms, peak_bytes=timing.peak_bytes, peak_gib=gib(timing.peak_bytes),
                   host_ms=timing.summary()["host_ms"]["median"])
    except Exception as exc:  # noqa: BLE001 - one failing contender must not hide the others
        traceback.print_exc()
        row["error"] = failure(exc)
        if row["error"] == OUT_OF_MEMORY:
            row["detail"] = str(exc).splitlines()[0] if str(exc) else ""
    free_memory(env)
    shown = row.get("error") or f"{row['step_ms']:.1f} ms, {fmt_gib(row.get('peak_gib'))}"
    print(f"  {label:<34} {shown}", flush=True)
    return row


# -- offload helpers ------------------------------------------------------------------------------
def plot_rows(panels: dict[str, Sequence[dict[str, Any]]], path: Path, *, ratio: str = "x_plain",
              baseline: str = "plain") -> Optional[Path]:
    """Step time (each row's ``ratio``: its step over ``baseline``'s) against peak, one panel per
    model (``offload.plot.plot_pareto``); a row's ``kind`` (else its first word) picks the marker.
    Returns the path written, or None with the reason printed (no matplotlib, nothing measured)."""
    from offload.plot import ParetoPoint, plot_pareto

    points = {
        name: [ParetoPoint(r["variant"], r["peak_bytes"], r[ratio], kind=r.get("kind") or r["variant"].split()[0])
               for r in rows if r.get(ratio) is not None and r.get("peak_bytes") is not None]
        for name, rows in panels.items()
    }
    try:
        written = plot_pareto(points, path, baseline=baseline)
    except (ImportError, ValueError) as exc:  # ValueError: every contender failed
        print(f"no plot: {exc}")
        return None
    print(f"wrote {written}")
    return written


def offload_context(env: Env, num_layers: int, model_layers: int, **kw: Any) -> tuple[Any, Any]:
    """``get_cpu_offload_context(enabled=True, ...)`` on the benchmark's device."""
    from offload import get_cpu_offload_context

    kw.setdefault("device", env.offload_device)
    return get_cpu_offload_context(True, num_layers=num_layers, model_layers=model_layers, **kw)


STAT_KEYS = (
    "offloaded_tensors", "offloaded_bytes", "kept", "bytes_d2h", "bytes_h2d",
    "d2h_ms", "h2d_ms", "d2h_gbps", "h2d_gbps", "wait_ms",
)


def offload_stats(ctx: Any) -> dict[str, Any]:
    """The context's stats of its last finished step: every key it reports (the ones the
    benchmarks read are checked, so a renamed key fails loudly instead of printing '-')."""
    stats = dict(ctx.stats)
    missing = [k for k in STAT_KEYS if k not in stats]
    if missing:
        raise KeyError(f"offload stats lack {missing}; present: {sorted(stats)}")
    return stats


def save_on_cpu_wrapper() -> Callable[[], Any]:
    """PyTorch's own reference: every saved tensor to pinned host memory, synchronously."""
    return lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)


def variant_step(
    env: Env,
    layers: torch.nn.ModuleList,
    x: torch.Tensor,
    *,
    offload: Optional[dict[str, Any]] = None,
    forward_wrapper: Optional[Callable[[], Any]] = None,
    layer_calls: Optional[tuple[Any, Callable[[torch.Tensor], torch.Tensor]]] = None,
    on_forward: Optional[Callable[[], None]] = None,
) -> tuple[Callable[[], None], Any]:
    """One variant's training step and its offload context (None where it has none); the
    arguments are :func:`run_variant`'s, and ``on_forward`` :func:`make_step`'s."""
    ctx = sync = None
    if offload is not None:
        kw = dict(offload)
        ctx, sync = offload_context(env, kw.pop("num_layers"), len(layers), **kw)
    calls = (ctx, sync) if layer_calls is None else layer_calls
    return make_step(layers, x, context=calls[0], sync=calls[1], forward_wrapper=forward_wrapper, on_forward=on_forward), ctx


def run_variant(
    env: Env,
    label: str,
    layers: torch.nn.ModuleList,
    x: torch.Tensor,
    *,
    offload: Optional[dict[str, Any]] = None,
    forward_wrapper: Optional[Callable[[], Any]] = None,
    layer_calls: Optional[tuple[Any, Callable[[torch.Tensor], torch.Tensor]]] = None,
    want_report: bool = False,
    warmup: Optional[int] = None,
    steps: Optional[int] = None,
) -> dict[str, Any]:
    """Time one variant of a workload and return its row.

    ``offload``: keyword arguments of the offload context (``num_layers`` at least; model_layers
    is ``len(layers)``); None for no offload. ``layer_calls``: a ``(context, sync_function)``
    pair called in the offload context's place (a stand-in, such as the hooks' floor in
    ``cpu_overhead.py``), no stats read. A failure is caught, printed and recorded in the row
    as ``error`` so that the other variants still run. The context is dropped and memory freed
    before returning.
    """
    row: dict[str, Any] = {"variant": label}
    if offload is not None:
        row["num_layers"] = offload.get("num_layers")
    ctx = step = None
    t0 = time.perf_counter()
    try:
        step, ctx = variant_step(env, layers, x, offload=offload, forward_wrapper=forward_wrapper, layer_calls=layer_calls)
        timing = time_steps(step, env, warmup=warmup, steps=steps)
        s = timing.summary()
        row.update(
            step_ms=timing.median_ms,
            step_min_ms=s["step_ms"]["min"],
            step_max_ms=s["step_ms"]["max"],
            host_ms=s["host_ms"]["median"],
            cpu_ms=s["cpu_ms"]["median"],
            wall_ms=s["wall_ms_per_step"],
            peak_bytes=timing.peak_bytes,
            peak_gib=gib(timing.peak_bytes),
            timing=s,
        )
        if ctx is not None:
            stats = offload_stats(ctx)
            row["stats"] = stats
            row["offloaded_bytes"] = stats.get("offloaded_bytes")
            row["offloaded_gib"] = gib(stats.get("offloaded_bytes"))
            row["offloaded_tensors"] = stats.get("offloaded_tensors")
            row["d2h_gbps"] = stats.get("d2h_gbps")
            row["h2d_gbps"] = stats.get("h2d_gbps")
            row["wait_ms"] = stats.get("wait_ms")
            if want_report:
                row["report"] = ctx.report()
    except Exception as exc:  # noqa: BLE001 - one broken variant must not hide the others
        traceback.print_exc()
        row["error"] = f"{type(exc).__name__}: {exc}"
        print(f"!! variant {label!r} failed: {row['error']}", file=sys.stderr)
    finally:
        del ctx, step, layer_calls
        x.grad = None
        for p in layers.parameters():
            p.grad = None
        free_memory(env)
    took = time.perf_counter() - t0
    shown = "FAILED" if "error" in row else f"{row['step_ms']:.2f} ms/step"
    print(f"  {label:<28} {shown}  ({took:.1f} s)", flush=True)
    return row


# -- results --------------------------------------------------------------------------------------
def _git_commit() -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=BENCH_DIR, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except Exception:  # noqa: BLE001 - metadata only
        return None


def source_digest(root: Path) -> Optional[str]:
    """The first 16 hex digits of a SHA-256 over ``root``'s ``offload/`` and ``csrc/`` sources
    (paths and contents, in path order): names the code that ran where git's state does not,
    such as the device machine's copy of the tree, whose ``git rev-parse`` is stale."""
    import hashlib

    files = sorted(
        path for folder in ("offload", "csrc") for path in (root / folder).rglob("*")
        if path.suffix in (".py", ".cpp", ".h") and "__pycache__" not in path.parts
    )
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _offload_package() -> Optional[str]:
    try:
        import offload as package

        return str(Path(package.__file__).resolve().parent)
    except Exception:  # noqa: BLE001 - metadata only
        return None


def _package_digest() -> Optional[str]:
    try:
        package = _offload_package()
        return None if package is None else source_digest(Path(package).parent)
    except Exception:  # noqa: BLE001 - metadata only
        return None


def metadata(env: Env) -> dict[str, Any]:
    """Device, versions, date and how the offload package was found."""
    try:
        from offload.host import native

        native_state = {"available": native.native_available(), "reason": native.native_reason()}
        if hasattr(native, "entries_reason"):  # offload._entries (older trees lack it)
            native_state["entries"] = native.entries_reason()
        if env.cuda:
            native_state["cuda_copy_path"] = native.cuda_copy_path()
    except Exception as exc:  # noqa: BLE001 - metadata only
        native_state = {"error": repr(exc)}
    return {
        "device": device_name(env),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "git_commit": _git_commit(),  # stale on the device machine's copy: see source_digest
        "source_digest": _package_digest(),
        "cpu_smoke": env.smoke,
        "native": native_state,
        # Which offload package ran: a script of this tree may run against another checkout's
        # package (PYTHONPATH), e.g. the engine before a change, for before/after tables.
        "offload_package": _offload_package(),
        "env": {k: os.environ[k] for k in ("OFFLOAD_NATIVE", "NVTE_CPU_OFFLOAD_V1", "CUDA_VISIBLE_DEVICES") if k in os.environ},
        "args": {k: v for k, v in vars(env.args).items()},
    }


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        return None
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if isinstance(obj, (torch.dtype, torch.device, Path)):
        return str(obj)
    return repr(obj)


def write_json(name: str, env: Env, payload: dict[str, Any], *, meta: Optional[dict[str, Any]] = None,
               path: Optional[Path] = None) -> Optional[Path]:
    """Write ``{"meta": ..., **payload}`` to benchmarks/results/<name>.json (smoke: results/smoke/).

    ``meta``: the metadata to write instead of :func:`metadata` (a parent process that must not
    start CUDA builds its own); ``path``: the file to write instead (``--out``)."""
    if env.args.no_json:
        return None
    if path is None:
        name = env.args.name or name
        folder = RESULTS_DIR / "smoke" if env.smoke else RESULTS_DIR
        path = folder / f"{name}.json"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"meta": metadata(env) if meta is None else meta, **payload}
    path.write_text(json.dumps(_jsonable(doc), indent=2) + "\n")
    try:
        shown = path.relative_to(Path.cwd())
    except ValueError:
        shown = path
    print(f"wrote {shown}")
    return path


# -- printing -------------------------------------------------------------------------------------
Column = tuple[str, str, str]  # (row key, header, format spec such as ".1f")


def fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if spec and isinstance(value, (int, float)):
        return format(value, spec)
    return str(value)


def print_table(title: str, rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> None:
    """A plain aligned table: first column left-aligned, the rest right-aligned."""
    header = [h for _, h, _ in columns]
    body = [[fmt(r.get(k), spec) for k, _, spec in columns] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    print()
    print(title)
    print(line(header))
    print("  ".join("-" * w for w in widths))
    for b in body:
        print(line(b))


def verdict(ok: Optional[bool]) -> str:
    """PASS / MISS, or n/a when the figure could not be measured (e.g. in a CPU smoke run)."""
    return "n/a " if ok is None else ("PASS" if ok else "MISS")


def gib(n: Optional[float]) -> Optional[float]:
    return None if n is None else n / GiB


def exit_status(failed: list[str]) -> int:
    """A benchmark's exit status: 0, or 1 after naming the variants that failed on stderr."""
    if failed:
        print(f"\nFAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
