"""The main job: what activation offload buys on a GPT-like model, checked bit for bit.

    python -m offload.demo                 # on the current CUDA device, or on the CPU without one
    python -m offload.demo --device cpu

On a GPU (default: hidden 4096, seq 4096, batch 2, 8 layers, bf16, about 15 GiB at its peak) it
times plain training steps against per-layer checkpointing, ``OffloadActivations`` with the few
layers whose copies hide under the compute of the rest, the same with all layers but the last,
and the planner at a memory budget; it prints step time and peak memory
(``torch.cuda.max_memory_allocated``) for each, checks every contender's gradients bit for bit
against plain, and with matplotlib saves a timeline of one offloaded step (copies against layer
compute) and its memory curve.

On the CPU there is no GPU memory to save: it shows that the gradients are exactly those of the
plain step and how many bytes went to the host arena, with the stats report.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

import offload
from offload.models import GPTBlock
from offload.repeatable import repeatable_attention
from offload.engine.stats import format_bytes

Forward = Callable[[torch.nn.ModuleList, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class DemoModel:
    """The size of the demo's GPT stack (pre-LN blocks fed a random hidden-state input)."""

    hidden: int
    heads: int
    layers: int
    batch: int
    seq: int
    dtype: torch.dtype

    def describe(self) -> str:
        """One line: the model's shape."""
        return (f"GPT stack: {self.layers} layers, hidden {self.hidden}, {self.heads} heads, "
                f"batch {self.batch} x seq {self.seq}, {str(self.dtype).replace('torch.', '')}")


# GPT-A of the benchmarks: at hidden 4096 and seq 4096 a layer's compute is long enough to hide
# the copies of a couple of layers (offloading 2 of 8 costs about 4% on our H100).
GPU_MODEL = DemoModel(hidden=4096, heads=32, layers=8, batch=2, seq=4096, dtype=torch.bfloat16)
CPU_MODEL = DemoModel(hidden=128, heads=4, layers=4, batch=2, seq=64, dtype=torch.float32)


@dataclass
class Row:
    """One contender's figures."""

    name: str
    step_ms: float
    peak_bytes: Optional[int]
    same_gradients: bool
    stats: Optional[dict[str, Any]] = None


def plain_forward(layers: torch.nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    """Every layer in order."""
    for layer in layers:
        x = layer(x)
    return x


def checkpointed_forward(layers: torch.nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    """Every layer under non-reentrant checkpointing: only the layer inputs are kept."""
    for layer in layers:
        x = checkpoint(layer, x, use_reentrant=False)
    return x


class Bench:
    """Runs training steps of one model and input on one device, and times them."""

    def __init__(self, spec: DemoModel, device: torch.device) -> None:
        torch.manual_seed(0)
        self.spec = spec
        self.device = device
        self.cuda = device.type == "cuda"
        self.layers = torch.nn.ModuleList(
            GPTBlock(spec.hidden, spec.heads, device=device, dtype=spec.dtype) for _ in range(spec.layers)
        )
        self.x = torch.randn(spec.batch, spec.seq, spec.hidden, device=device, dtype=spec.dtype)

    def step(self, forward: Forward = plain_forward, wrapper: Any = None) -> list[torch.Tensor]:
        """One training step (forward under ``wrapper``, backward); returns the gradients."""
        for p in self.layers.parameters():
            p.grad = None
        x = self.x.detach().requires_grad_(True)
        with wrapper if wrapper is not None else contextlib.nullcontext():
            out = forward(self.layers, x)
        out.float().square().mean().backward()
        return [p.grad for p in self.layers.parameters()] + [x.grad]

    def sync(self) -> None:
        """Wait for the GPU (nothing on the CPU)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def run(self, name: str, expected: list[torch.Tensor], *, forward: Forward = plain_forward,
            wrapper: Any = None, warmup: int = 1, steps: int = 3) -> Row:
        """``warmup`` untimed steps, then ``steps`` timed ones; gradients of the last compared
        bit for bit with ``expected`` (which may be held on the host)."""
        for _ in range(warmup):
            self.step(forward, wrapper)
        self.sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        for _ in range(steps):
            grads = self.step(forward, wrapper)
        self.sync()
        ms = (time.perf_counter() - start) * 1e3 / steps
        peak = torch.cuda.max_memory_allocated(self.device) if self.cuda else None
        same = all(torch.equal(a, b.to(a.device)) for a, b in zip(expected, grads))
        stats = dict(wrapper.stats) if isinstance(wrapper, offload.OffloadActivations) else None
        return Row(name, ms, peak, same, stats)


def _gpu_table(rows: list[Row]) -> str:
    base = rows[0].step_ms
    lines = [f"{'contender':<40} {'step ms':>9} {'x plain':>8} {'peak GiB':>9}  gradients"]
    for r in rows:
        peak = f"{r.peak_bytes / 2**30:9.2f}" if r.peak_bytes is not None else f"{'-':>9}"
        lines.append(f"{r.name:<40} {r.step_ms:9.1f} {r.step_ms / base:8.2f} {peak}  "
                     f"{'bitwise equal' if r.same_gradients else 'DIFFERENT'}")
    return "\n".join(lines)


def _cpu_table(rows: list[Row]) -> str:
    lines = [f"{'contender':<28} {'step ms':>8}  {'moved to the host arena':>24}  {'arena holds':>12}  gradients"]
    for r in rows:
        moved = format_bytes(r.stats["offloaded_bytes"]) if r.stats else "-"
        held = format_bytes(r.stats["pinned_bytes_held"]) if r.stats else "-"
        lines.append(f"{r.name:<28} {r.step_ms:8.1f}  {moved:>24}  {held:>12}  "
                     f"{'bitwise equal' if r.same_gradients else 'DIFFERENT'}")
    return "\n".join(lines)


def _save_plots(bench: Bench, oa: offload.OffloadActivations, out_dir: Path) -> None:
    from offload.plot import plot_memory, plot_timeline, record_step

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("\n(no plots: pip install matplotlib to save the step's timeline and memory curve)")
        return
    recording = record_step(lambda: bench.step(plain_forward, oa), offloader=oa, layers=bench.layers)
    out_dir.mkdir(parents=True, exist_ok=True)  # the demo's own folder (the renderers create none)
    timeline = plot_timeline(recording.timeline, out_dir / "timeline.png")
    memory = plot_memory(recording.memory, out_dir / "memory.png")
    print(f"\nsaved {timeline} (copies against layer compute) and {memory}")


def run_gpu(args: argparse.Namespace, device: torch.device) -> bool:
    """The GPU demo: the table of contenders; True when every gradient matched plain's."""
    spec = replace(GPU_MODEL, hidden=args.hidden, heads=max(1, args.hidden // 128), layers=args.layers,
                   batch=args.batch, seq=args.seq)
    bench = Bench(spec, device)
    n = spec.layers
    hidden_k = min(args.offload_layers, n - 1)
    print(f"offload demo on {torch.cuda.get_device_name(device)}: {spec.describe()}; native copies: {offload.native_available()}")
    with repeatable_attention():
        # Held on the host, so that they do not add to every contender's GPU peak.
        expected = [g.cpu() for g in bench.step()]
        if not all(torch.equal(a, b.cpu()) for a, b in zip(expected, bench.step())):
            print("the plain step does not repeat itself bit for bit here: the gradient check proves nothing")
        rows = [bench.run("plain", expected, steps=args.steps)]
        rows.append(bench.run("checkpointing (every layer)", expected, forward=checkpointed_forward, steps=args.steps))
        hidden_oa = offload.OffloadActivations(bench.layers, num_offload_layers=hidden_k)
        rows.append(bench.run(f"offload {hidden_k} of {n} layers", expected, wrapper=hidden_oa, steps=args.steps))
        all_oa = offload.OffloadActivations(bench.layers, num_offload_layers=n - 1)
        rows.append(bench.run(f"offload {n - 1} of {n} layers", expected, wrapper=all_oa, steps=args.steps))
        all_oa.close()
        budget = int(args.budget_fraction * rows[0].peak_bytes)
        planned = offload.OffloadActivations(bench.layers, memory_budget_bytes=budget)
        label = f"planner @ {args.budget_fraction:.0%} of plain's peak"
        try:
            # The probe steps (two or three) come first; the plan is followed from the next on.
            rows.append(bench.run(label, expected, wrapper=planned, warmup=4, steps=args.steps))
        except offload.planner.BudgetError as exc:
            print(f"{label}: {exc}")
        planned.close()
        print()
        print(_gpu_table(rows))
        if planned.plan is not None:
            print(f"\nthe planner's plan: {planned.plan.describe()}")
        print()
        print(hidden_oa.report())
        if not args.no_plot:
            _save_plots(bench, hidden_oa, Path(args.plot_dir))
        hidden_oa.close()
    return all(r.same_gradients for r in rows)


def run_cpu(args: argparse.Namespace) -> bool:
    """The CPU demo: exact gradients and bytes moved to the host arena; True when they match."""
    spec = CPU_MODEL
    bench = Bench(spec, torch.device("cpu"))
    k = spec.layers - 1
    print(f"offload demo on the CPU: {spec.describe()}; native copies: {offload.native_available()}")
    print("There is no GPU here, so no GPU memory to save and no copies to hide: this shows the\n"
          "engine at work through its host transport. The saved activations of the first\n"
          f"{k} layers are copied into the host arena after each layer's forward, their originals\n"
          "freed, and copied back for the backward; the gradients must be bit for bit those of\n"
          "the plain step. (Step times on the CPU say little: the host copies are synchronous.)\n")
    expected = [g.clone() for g in bench.step()]
    rows = [bench.run("plain", expected, steps=args.steps)]
    # min_offload_bytes=0: the demo's tensors are small, and every one of them should travel.
    oa = offload.OffloadActivations(bench.layers, num_offload_layers=k, device="cpu", min_offload_bytes=0)
    rows.append(bench.run(f"offload {k} of {spec.layers} layers", expected, wrapper=oa, steps=args.steps))
    print(_cpu_table(rows))
    s = rows[-1].stats or {}
    print(f"\nper step: {format_bytes(s.get('offloaded_bytes', 0))} of activations copied to the host arena "
          f"and back, {format_bytes(s.get('released_bytes', 0))} of originals freed until the backward; "
          f"the arena ({format_bytes(s.get('pinned_bytes_held', 0))}) is reused every step.\n")
    print(oa.report())
    if not args.no_plot:
        _save_plots(bench, oa, Path(args.plot_dir))
    oa.close()
    return all(r.same_gradients for r in rows)


def main(argv: Optional[list[str]] = None) -> int:
    """Run the demo; returns the process exit code (1 if any gradient differs from plain's)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per contender")
    parser.add_argument("--offload-layers", type=int, default=2, help="GPU: layers offloaded in the 'hidden' row")
    parser.add_argument("--budget-fraction", type=float, default=0.75, help="GPU: the planner's budget, of plain's peak")
    parser.add_argument("--hidden", type=int, default=GPU_MODEL.hidden, help="GPU model: hidden size (heads of 128)")
    parser.add_argument("--layers", type=int, default=GPU_MODEL.layers, help="GPU model: layers")
    parser.add_argument("--batch", type=int, default=GPU_MODEL.batch, help="GPU model: batch")
    parser.add_argument("--seq", type=int, default=GPU_MODEL.seq, help="GPU model: sequence length")
    parser.add_argument("--plot-dir", default="offload-demo", help="where the plots go (with matplotlib)")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    if args.steps < 1 or not 0 < args.budget_fraction <= 1:
        parser.error("--steps must be >= 1 and --budget-fraction in (0, 1]")
    # Deterministic cuBLAS needs this before its first use (the bitwise check relies on it).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ok = run_gpu(args, device) if device.type == "cuda" else run_cpu(args)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
