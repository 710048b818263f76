"""MANY-SMALL: how fast one group of many small GPU tensors reaches one pinned host buffer.

One group of N tensors (default 256) per tensor size (default 4 KB, 64 KB, 1 MB) is copied device
to host into one pinned buffer, at the offsets ``offload.host.native.plan_layout`` gives, on a side
stream (as the engine's offload stream does). Contenders, all in this one process:

  (a) copy_ loop       one ``copy_(non_blocking=True)`` per tensor into precomputed pinned views
  (b) fallback loop    what the transport's torch fallback does: narrow the pinned buffer, view it
                       as the tensor, ``copy_`` (the views are built inside the timed loop)
  (c) native batch     ``offload.host.native.copy_batch``: one ``cuMemcpyBatchAsync`` for the group
  (d) native loop      ``copy_batch(force_loop=True)``: a C++ loop of ``cuMemcpyAsync``
  (e) gather + 1 D2H   ``torch.cat`` of the flattened bytes into a bounded GPU staging buffer
                       (``out=``), then one large D2H per staging fill
  (ref) one D2H        the same bytes as one contiguous tensor, one copy: the ceiling

Two timings per contender, both with CUDA events on the side stream, median over the reps after
warm-up:
  eff      from an idle stream: start event, submission, end event. What the engine sees: CPU
           submission that cannot keep up with the copy engine shows up here.
  device   the stream is first held by a spin kernel long enough for the whole submission to be
           queued, so the events bracket the copies alone (copy-engine efficiency).
plus the host CPU time of the submission alone (``time.perf_counter`` around it), per tensor.

Run from the repository root on a GPU machine, after ``pip install --no-build-isolation --no-deps
-e .``:  ``python benchmarks/many_small.py``. Prints a table and writes
``benchmarks/results/many_small.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "many_small.json"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=256, help="tensors per group")
    p.add_argument(
        "--sizes", default="4096,65536,1048576", help="bytes per tensor, comma separated"
    )
    p.add_argument("--reps", type=int, default=40, help="timed repetitions per contender")
    p.add_argument("--warmup", type=int, default=5, help="untimed repetitions first")
    p.add_argument("--staging-mb", type=int, default=32, help="bound of the gather staging buffer")
    p.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    return p.parse_args()


def human(nbytes: int) -> str:
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def sleep_cycles_per_ms() -> float:
    """Calibrate ``torch.cuda._sleep`` (a spin kernel counted in GPU clock cycles)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rate = 0.0
    for _ in range(3):  # the first run pays for module load and clock ramp-up
        start.record()
        torch.cuda._sleep(2_000_000)
        end.record()
        end.synchronize()
        rate = 2_000_000 / max(start.elapsed_time(end), 1e-3)
    return rate


class Case:
    """One tensor size: the source tensors, the pinned destination and the contenders."""

    def __init__(self, count: int, size: int, staging_bytes: int, native) -> None:
        assert size % 2 == 0, "tensors are bf16"
        self.count, self.size, self.native = count, size, native
        self.side = torch.cuda.Stream()
        gen = torch.Generator(device="cuda").manual_seed(size)
        cols = 128 if size % 256 == 0 else size // 2
        shape = (size // 2 // cols, cols)
        # Separate allocations, as activations are; bf16 2-D, as activations are.
        self.srcs = [
            torch.randint(-1000, 1000, shape, device="cuda", generator=gen).to(torch.bfloat16)
            for _ in range(count)
        ]
        self.offsets, self.total = native.plan_layout([size] * count)
        self.pinned = torch.empty(self.total, dtype=torch.uint8, pin_memory=True)
        # What the pinned buffer must hold afterwards (layout is packed: sizes are aligned).
        self.expected = torch.zeros(self.total, dtype=torch.uint8)
        for t, off in zip(self.srcs, self.offsets):
            self.expected[off : off + size] = t.view(-1).view(torch.uint8).cpu()
        # (a): destination views made once, outside the timing.
        self.views = [
            self.pinned[off : off + size].view(torch.bfloat16).view(shape) for off in self.offsets
        ]
        # (e): a bounded staging buffer; whole tensors per fill.
        self.per_fill = max(1, min(count, staging_bytes // size))
        self.staging = torch.empty(self.per_fill * size, dtype=torch.uint8, device="cuda")
        # (ref): the same bytes, one contiguous tensor.
        self.contig = torch.cat([t.view(-1).view(torch.uint8) for t in self.srcs])
        self.base = self.pinned.data_ptr()
        torch.cuda.synchronize()
        self.side.wait_stream(torch.cuda.current_stream())

    # ---- contenders: each submits the whole group on the (current) side stream ----------------

    def copy_loop(self) -> None:
        for view, t in zip(self.views, self.srcs):
            view.copy_(t, non_blocking=True)

    def fallback_loop(self) -> None:
        pinned = self.pinned
        for t, off in zip(self.srcs, self.offsets):
            nbytes = t.numel() * t.element_size()
            pinned.narrow(0, off, nbytes).view(t.dtype).view(t.shape).copy_(t, non_blocking=True)

    def _native(self, force_loop: bool) -> None:
        base = self.base
        # Pointer lists are built here, inside the timing: the engine has to build them too.
        self.native.copy_batch(
            [base + off for off in self.offsets],
            [t.data_ptr() for t in self.srcs],
            [t.numel() * t.element_size() for t in self.srcs],
            self.side.cuda_stream,
            force_loop=force_loop,
        )

    def native_batch(self) -> None:
        self._native(False)

    def native_loop(self) -> None:
        self._native(True)

    def gather(self) -> None:
        size, per = self.size, self.per_fill
        for first in range(0, self.count, per):
            chunk = self.srcs[first : first + per]
            nbytes = len(chunk) * size
            staged = self.staging[:nbytes]
            torch.cat([t.view(-1).view(torch.uint8) for t in chunk], out=staged)
            # Stream order makes the next fill wait for this D2H; offsets are packed here.
            start = self.offsets[first]
            self.pinned[start : start + nbytes].copy_(staged, non_blocking=True)

    def one_copy(self) -> None:
        self.pinned.copy_(self.contig, non_blocking=True)


def counters(native) -> dict[str, int]:
    info = native.cuda_copy_info()
    return {k: int(info.get(k, 0)) for k in ("batch_calls", "loop_calls", "batch_fallbacks")}


def path_taken(before: dict[str, int], after: dict[str, int]) -> str:
    batch = after["batch_calls"] - before["batch_calls"]
    loop = after["loop_calls"] - before["loop_calls"]
    fell = after["batch_fallbacks"] - before["batch_fallbacks"]
    if batch and not loop:
        return "batch"
    if loop and not batch:
        return "loop (batch refused, retried)" if fell else "loop"
    return f"mixed ({batch} batch, {loop} loop, {fell} fallbacks)"


def measure(
    case: Case, submit: Callable[[], None], reps: int, warmup: int, cycles_per_ms: float | None
) -> dict:
    """Time one contender: eff (idle stream) and device (submission queued behind a spin)."""
    side = case.side
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    # Correctness first: the numbers mean nothing if the bytes are wrong.
    case.pinned.zero_()
    with torch.cuda.stream(side):
        submit()
    side.synchronize()
    if not torch.equal(case.pinned, case.expected):
        raise AssertionError("pinned buffer differs from the source tensors after the copy")

    eff_ms, cpu_s = [], []
    for i in range(warmup + reps):
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            start.record(side)
            t0 = time.perf_counter()
            submit()
            t1 = time.perf_counter()
            end.record(side)
        end.synchronize()
        if i >= warmup:
            eff_ms.append(start.elapsed_time(end))
            cpu_s.append(t1 - t0)

    dev_ms: list[float] = []
    queued_ok = True
    if cycles_per_ms is not None:
        # Hold the stream long enough (2x the slowest submission seen, plus 1 ms) that the
        # submission is fully queued before the start event fires.
        hold_ms = 2.0 * max(cpu_s) * 1e3 + 1.0
        for i in range(warmup + reps):
            torch.cuda.synchronize()
            with torch.cuda.stream(side):
                torch.cuda._sleep(int(hold_ms * cycles_per_ms))
                start.record(side)
                submit()
                end.record(side)
            if start.query():  # the spin ended before submission did: not a device-only timing
                queued_ok = False
            end.synchronize()
            if i >= warmup:
                dev_ms.append(start.elapsed_time(end))

    nbytes = case.count * case.size
    eff = statistics.median(eff_ms)
    dev = statistics.median(dev_ms) if dev_ms else None
    cpu = statistics.median(cpu_s)
    return {
        "eff_ms": eff,
        "eff_gbps": nbytes / (eff * 1e-3) / 1e9,
        "device_ms": dev,
        "device_gbps": nbytes / (dev * 1e-3) / 1e9 if dev else None,
        "device_timing_valid": queued_ok if dev_ms else None,
        "cpu_us_total": cpu * 1e6,
        "cpu_us_per_tensor": cpu * 1e6 / case.count,
        "eff_ms_all": eff_ms,
        "device_ms_all": dev_ms,
    }


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print(
            "many_small.py needs a CUDA GPU (torch.cuda.is_available() is False); "
            "nothing was measured.",
            file=sys.stderr,
        )
        return 2
    try:
        import offload.host.native as native
    except ImportError as exc:  # layout.py is plain Python: this means the package is not found
        print(f"cannot import offload.host.native ({exc}); run from the repository root "
              "after `pip install --no-build-isolation --no-deps -e .`", file=sys.stderr)
        return 2

    torch.cuda.init()
    torch.cuda.synchronize()
    native_live = native.native_available()
    info = native.cuda_copy_info()
    cycles_per_ms = sleep_cycles_per_ms() if hasattr(torch.cuda, "_sleep") else None
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if any(s <= 0 or s % 256 for s in sizes):
        # Keeps the layout packed, so the gather contender (e) and the others fill the pinned
        # buffer identically and one correctness check covers them all.
        print(f"--sizes must be positive multiples of 256 bytes, got {sizes}", file=sys.stderr)
        return 2
    staging_bytes = args.staging_mb << 20

    contenders: list[tuple[str, str, str | None]] = [
        ("a", "copy_ loop", None),
        ("b", "fallback loop (narrow+copy_)", None),
        ("c", "native copy_batch (batch)", "native_batch"),
        ("d", "native copy_batch (loop)", "native_loop"),
        ("e", "gather on GPU + 1 D2H", None),
        ("ref", "one contiguous D2H", None),
    ]
    methods = {
        "a": "copy_loop", "b": "fallback_loop", "c": "native_batch", "d": "native_loop",
        "e": "gather", "ref": "one_copy",
    }

    print(f"MANY-SMALL on {torch.cuda.get_device_name()} | torch {torch.__version__} "
          f"(CUDA {torch.version.cuda}) | native: {native.native_reason()} | "
          f"copy path: {info.get('path')} ({info.get('reason')})")
    print(f"{args.count} tensors per group, {args.reps} reps after {args.warmup} warm-up, "
          f"medians; staging bound {args.staging_mb} MB")

    results = []
    header = (f"{'size':>7} {'variant':<30} {'path':<12} {'eff GB/s':>9} {'dev GB/s':>9} "
              f"{'eff ms':>8} {'CPU us/t':>9} {'vs (a)':>7}")
    for size in sizes:
        case = Case(args.count, size, staging_bytes, native)
        print()
        print(header)
        print("-" * len(header))
        base_eff = None
        for key, label, needs_native in contenders:
            row = {"size_bytes": size, "count": args.count, "variant": key, "label": label}
            if needs_native and not native_live:
                row.update(skipped=f"native extension not live: {native.native_reason()}")
                print(f"{human(size):>7} {f'({key}) {label}':<30} skipped: {row['skipped']}")
                results.append(row)
                continue
            before = counters(native) if needs_native else None
            m = measure(case, getattr(case, methods[key]), args.reps, args.warmup, cycles_per_ms)
            path = path_taken(before, counters(native)) if needs_native else "torch"
            row.update(m, path=path)
            if key == "a":
                base_eff = m["eff_gbps"]
            row["eff_vs_a"] = m["eff_gbps"] / base_eff if base_eff else None
            results.append(row)
            flag = "?" if m["device_timing_valid"] is False else " "
            dev = (f"{m['device_gbps']:8.1f}" if m["device_gbps"] else f"{'n/a':>8}") + flag
            print(f"{human(size):>7} {f'({key}) {label}':<30} {path[:12]:<12} "
                  f"{m['eff_gbps']:9.1f} {dev} {m['eff_ms']:8.3f} "
                  f"{m['cpu_us_per_tensor']:9.2f} {row['eff_vs_a']:6.2f}x")
        del case
        torch.cuda.empty_cache()

    print("\neff: from an idle stream (submission included); dev: submission queued first, copies "
          "alone ('?' = spin too short, not device-only); CPU us/t: submission CPU per tensor.")

    out = {
        "benchmark": "many_small",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "native": {"live": native_live, "reason": native.native_reason(),
                   "cuda_copy_info": native.cuda_copy_info()},
        "args": {"count": args.count, "sizes": sizes, "reps": args.reps, "warmup": args.warmup,
                 "staging_mb": args.staging_mb},
        "sleep_cycles_per_ms": cycles_per_ms,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
