"""Where the engine's host time goes, function by function, inside real training steps.

Two profilers, one question; the step-time ratio itself comes from ``host_cost.py``, the engine's
calls timed one by one from ``host_parts.py``.

By cProfile (the default): ``cProfile`` around SMALL's (or MOE's) offloaded steps in
TransformerEngine's call shape, in one process. Printed per step: the calls and the time of each
function of ``offload`` and of each builtin called from it, sorted by own time, and the count of
Python calls the engine makes per group. The profiler inflates every Python call (roughly 0.3-1 us
a call), so read the ranking and the call counts, not the absolute figures. It cannot split the
native saved-tensor hooks (C functions): run it with ``OFFLOAD_NATIVE_HOOKS=0`` to see the Python
ones. Usage: ``python benchmarks/host_profile.py [--workload small|moe] [--steps N] [--top N]``;
``--cpu-smoke`` runs a tiny CPU version.

By sampling (``--py-spy``): a sampling profiler sees the native saved-tensor hooks and the driver
and allocator calls below our Python, and it does not inflate small Python calls. For each variant
(plain, the defaults with the native hooks, the Python hooks, a host budget of 0 so that nothing is
copied) a worker process runs ``--steps`` steps under ``py-spy record --native`` and this script
splits the samples: the engine's share (any frame of ``offload/`` or of the extension's sources), by
the engine's entry point (the outermost such frame) and by the innermost frame. py-spy pauses the
process to unwind native stacks (a SMALL step took 61 ms under it against 4), and the shares count
the whole run, start-up included: read them as ranks and as a comparison between variants, not as
times. Each later variant is compared with the first, frame by frame (samples a step in which the
frame is on the stack): where the second variant spends what the first does not, inside the
engine or outside it. Needs ``py-spy`` on the PATH (``pip install py-spy``; on a machine without
a registry, install a wheel downloaded elsewhere). Usage: ``python benchmarks/host_profile.py
--py-spy [--workload small|moe] [--steps N] [--rate HZ] [--variants plain,native,python,nothing_fits]``;
``--cpu-smoke`` samples a tiny CPU version. Writes ``benchmarks/results/host_profile_<workload>.json``.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import measure  # noqa: E402
import workloads  # noqa: E402


def _model(name: str, device: torch.device, smoke: bool) -> tuple[torch.nn.ModuleList, torch.Tensor]:
    if smoke:
        torch.manual_seed(0)
        layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(16))
        return layers, torch.randn(16, 64, requires_grad=True)
    spec = workloads.small(1.0) if name == "small" else workloads.moe(1.0)
    layers, make_input = spec.build(device)
    return layers, make_input()


def package_path(path: str, package: Path) -> Optional[str]:
    """``path`` (a code object's file) relative to ``package`` (the ``offload`` package's own
    directory), or None when it is not one of the package's files. Read against the package's
    directory, not a "/offload/" in the path: ``git clone`` names the checkout ``offload``, so
    the benchmarks' own files are under an "/offload/" too (and the package's under two)."""
    try:
        return Path(path).resolve().relative_to(package).as_posix()
    except ValueError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("small", "moe"), default="small")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--cpu-smoke", action="store_true")
    args = parser.parse_args()
    import offload

    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    layers, x = _model(args.workload, device, args.cpu_smoke)
    n = len(layers)
    ctx, sync = offload.get_cpu_offload_context(enabled=True, num_layers=n - 1, model_layers=n, min_offload_bytes=0)

    def step() -> None:
        h = x
        for layer in layers:
            with ctx:
                h = layer(h)
            h = sync(h)
        h.float().sum().backward()
        for p in layers.parameters():
            p.grad = None

    for _ in range(10):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps):
        step()
    profile.disable()
    stats = ctx.stats
    groups = stats["groups_offloaded"] or 1
    rows = []
    engine_calls = 0.0
    package = Path(offload.__file__).resolve().parent
    for (path, line, name), (_, calls, own, _, _) in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        ours = package_path(path, package) if path != "~" else None
        if ours is not None:
            engine_calls += calls / args.steps
        if ours is not None or path == "~":
            where = f"{ours}:{line}" if ours is not None else "builtin"
            rows.append((own / args.steps * 1e6, calls / args.steps, f"{where} {name}"))
    rows.sort(reverse=True)
    print(f"{args.workload}: {n} layers, {groups} groups and {stats['offloaded_tensors']} tensors offloaded a step; "
          f"the engine's Python functions run {engine_calls:.0f} calls a step ({engine_calls / groups:.0f} a group)")
    print(f"{'us/step':>9} {'calls':>7}  function (own time, profiled)")
    for own, calls, where in rows[: args.top]:
        print(f"{own:9.1f} {calls:7.1f}  {where}")


# -- by sampling (--py-spy) -----------------------------------------------------------------------
# A frame of ours: a Python frame of the package, or a native frame of the extension's sources.
OURS = re.compile(r"\(offload/|saved_hooks\.cpp|entry_table\.|host_memory\.cpp|cuda_driver\.cpp|offload_native\.cpp|_entries\.cpython")
# The model code the benchmarks import from the package is not the engine.
NOT_ENGINE = re.compile(r"\(offload/models\.py")
UNRESOLVED = re.compile(r"0x[0-9a-fA-F]+$")
VARIANTS = ("plain", "native", "python", "nothing_fits")


def frame_name(frame: str) -> str:
    """A py-spy frame without its ``(file:line)`` part."""
    return frame.rsplit(" (", 1)[0]


def split_samples(lines: Iterable[str], top: int = 12) -> dict[str, Any]:
    """Split py-spy's raw (collapsed) stacks, one ``frame;frame;... count`` a line: the samples
    in all, the engine's (a stack with a frame of ours that is not model code), and the engine's
    samples by its outermost frame (the entry point) and by the innermost one."""
    total = ours = 0
    entry: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()  # every sample, each frame once
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        for name in {frame_name(f) for f in frames}:
            if not UNRESOLVED.match(name):  # a bare address: another one in every process
                inclusive[name] += n
        first = next((i for i, f in enumerate(frames) if OURS.search(f) and not NOT_ENGINE.search(f)), None)
        if first is None:
            continue
        ours += n
        name = frame_name(frames[first])
        entry["import offload (start-up)" if name == "<module>" else name] += n
        leaf[frame_name(frames[-1])] += n

    def shares(counter: collections.Counter[str]) -> list[tuple[str, float]]:
        return [(name, n / total) for name, n in counter.most_common(top)]

    return {"samples": total, "engine_samples": ours, "engine_share": ours / total if total else 0.0,
            "by_entry": shares(entry), "by_leaf": shares(leaf),
            # Raw counts of the frames in at least 0.1% of the samples: what :func:`differences`
            # compares between variants (the engine's code is not the only thing offloading
            # changes: the allocator's frees, autograd's unpacking...).
            "inclusive": {name: n for name, n in inclusive.most_common() if n * 1000 >= total}}


def differences(a: dict[str, Any], b: dict[str, Any], steps: int, top: int = 25) -> list[tuple[str, float]]:
    """The frames whose inclusive samples a step differ most between two variants' splits
    (``a`` minus ``b``, samples a step; a frame under the 0.1% cut in one counts as 0 there)."""
    names = set(a["inclusive"]) | set(b["inclusive"])
    diff = {name: (a["inclusive"].get(name, 0) - b["inclusive"].get(name, 0)) / steps for name in names}
    return sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]


def worker(workload: str, variant: str, steps: int, smoke: bool) -> None:
    """Run ``steps`` steps of one variant (after 5 untimed ones) and print the step time."""
    import torch

    import offload

    os.environ["OFFLOAD_NATIVE_HOOKS"] = "0" if variant == "python" else "1"
    # nothing_fits: a host budget of 0, so every decision is made and nothing is copied.
    options = {"host_budget_bytes": 0} if variant == "nothing_fits" else {}
    device = torch.device("cpu" if smoke else "cuda")
    spec = workloads.WORKLOADS[workload](workloads.scale_for(smoke))
    layers, make_input = spec.build(device)
    x = make_input()
    n = len(layers)
    ctx = sync = None
    if variant != "plain":
        ctx, sync = offload.get_cpu_offload_context(True, num_layers=n - 1, model_layers=n, min_offload_bytes=0,
                                                    device="cpu" if smoke else None, **options)
    step = measure.make_step(layers, x, context=ctx, sync=sync)
    for _ in range(5):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"{workload} {variant}: {(time.perf_counter() - t0) / steps * 1e3:.2f} ms a step under the sampler", flush=True)


def sample(py_spy: str, workload: str, variant: str, steps: int, rate: int, smoke: bool, folder: Path) -> dict[str, Any]:
    """One variant's worker under ``py-spy record --native``; its samples split."""
    raw = folder / f"{workload}_{variant}.txt"
    cmd = [py_spy, "record", "--native", "-r", str(rate), "-f", "raw", "-o", str(raw), "--",
           sys.executable, __file__, "--py-spy", "--worker", workload, variant, "--steps", str(steps)] + (["--cpu-smoke"] if smoke else [])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not raw.exists():
        raise RuntimeError(f"py-spy failed on {workload}/{variant} (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    print(done.stdout.strip(), flush=True)
    return split_samples(raw.read_text().splitlines())


def sample_main(argv: Optional[list[str]] = None) -> int:
    """The ``--py-spy`` mode: each variant sampled in a worker of its own, split and compared."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] + " (--py-spy: by sampling)")
    parser.add_argument("--workload", choices=("small", "moe"), default="moe")
    parser.add_argument("--steps", type=int, default=None, help="steps a variant (default: MOE 10, SMALL 400; smoke 3)")
    parser.add_argument("--rate", type=int, default=250, help="samples a second")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--name", default=None)
    parser.add_argument("--worker", nargs=2, metavar=("WORKLOAD", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps = args.steps or (3 if args.cpu_smoke else 10 if args.workload == "moe" else 400)
    if args.worker:
        worker(args.worker[0], args.worker[1], steps, args.cpu_smoke)
        return 0
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not set(variants) <= set(VARIANTS):
        parser.error(f"--variants: {sorted(set(variants) - set(VARIANTS))} unknown; choose from {list(VARIANTS)}")
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        print("host_profile.py --py-spy needs py-spy on the PATH: pip install py-spy (offline: a wheel downloaded elsewhere)", file=sys.stderr)
        return 2
    env = common.Env(device=None, smoke=args.cpu_smoke, offload_device=None, args=argparse.Namespace(no_json=False, name=args.name))  # type: ignore[arg-type]
    meta = {"py_spy": subprocess.run([py_spy, "--version"], capture_output=True, text=True).stdout.strip(), "argv": sys.argv[1:]}
    results: dict[str, Any] = {}
    first = variants[0]
    with tempfile.TemporaryDirectory() as tmp:
        for variant in variants:
            try:
                results[variant] = split = sample(py_spy, args.workload, variant, steps, args.rate, args.cpu_smoke, Path(tmp))
            except RuntimeError as e:  # a failed worker: say so, and go on with the others
                print(f"== {args.workload} {variant}: {e}", file=sys.stderr)
                results[variant] = {"error": str(e)[-2000:]}
                continue
            print(f"== {args.workload} {variant}: {split['samples']} samples, the engine's {100 * split['engine_share']:.1f}%")
            for title, key in (("by entry into the engine", "by_entry"), ("by innermost frame", "by_leaf")):
                print(f"  {title}:")
                for name, share in split[key]:
                    print(f"    {100 * share:5.1f}%  {name[:100]}")
            if variant != first and "inclusive" in results[first]:
                diff = differences(split, results[first], steps)
                split[f"minus_{first}"] = diff
                print(f"== {variant} minus {first}: samples a step, by frame (inclusive)")
                for name, n in diff:
                    print(f"    {n:+8.2f}  {name[:100]}")
            # After every variant: a run cut short (a device call's time limit) keeps what it has.
            common.write_json(f"host_profile_{args.workload}", env, {"steps": steps, "rate": args.rate, "variants": results}, meta=meta)
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    if "--py-spy" in sys.argv[1:]:
        raise SystemExit(sample_main([a for a in sys.argv[1:] if a != "--py-spy"]))
    main()
