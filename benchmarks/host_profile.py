"""Where the engine's host time goes, function by function, inside real training steps.

The complement of ``cpu_overhead.py`` (which times the engine's entry points): ``cProfile``
around SMALL's (or MOE's) offloaded steps in TransformerEngine's call shape, and the same steps
plain, in one process. Printed per step: the calls and the time of each function of ``offload``
and of each builtin called from it, sorted by own time, and the count of Python calls the
engine makes per group. The profiler inflates every Python call (roughly 0.3-1 us a call), so
read the ranking and the call counts, not the absolute figures: the step-time ratio comes from
``small.py`` and ``ab_engine.py``.

Usage: ``python benchmarks/host_profile.py [--workload small|moe] [--steps N] [--top N]``;
``--cpu-smoke`` runs a tiny CPU version.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
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


if __name__ == "__main__":
    main()
