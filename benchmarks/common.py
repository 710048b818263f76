"""Shared setup and reporting of the benchmark suite: the options every script takes, the device,
failures as results, JSON with the run's metadata, and tables. What is measured, and how a step is
timed, lives in ``measure.py``; the reference workloads in ``workloads.py``; the per-process
contender runs in ``workers.py``; the per-step records of a step stream in ``step_records.py``.
This module imports none of them (they import it).

Every benchmark is GPU-only. ``--cpu-smoke`` runs a tiny version on the CPU (the offload context
with ``device="cpu"``, the host transport) so the scripts can be checked on a machine without a
GPU; its numbers mean nothing and its JSON goes to ``benchmarks/results/smoke/`` so that it never
overwrites a GPU result.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

BENCH_DIR = Path(__file__).resolve().parent
try:  # the package is normally installed (pip install -e .); else use this checkout
    import offload  # noqa: F401
except ImportError:
    sys.path.append(str(BENCH_DIR.parent))
if str(BENCH_DIR) not in sys.path:  # the sibling helper modules, however common was found
    sys.path.append(str(BENCH_DIR))
RESULTS_DIR = BENCH_DIR / "results"
GiB = float(1 << 30)


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


# -- failures and figures -------------------------------------------------------------------------
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
