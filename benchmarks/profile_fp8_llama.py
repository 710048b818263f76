"""Where an FP8 LLAMA-2B step spends its time: wall and GPU kernel time per variant and the
kernels that take it (torch.profiler), bf16 against FP8; with ``--linear``, the host time of one
``fp8.Linear`` call against ``nn.Linear``'s and a cProfile of it.

    python benchmarks/profile_fp8_llama.py [--variants bf16,fp8_linears,fp8_linears_both,fp8] [--top 25]
    python benchmarks/profile_fp8_llama.py --linear

(The Llama step's host time is not reported: HF's loss syncs with the GPU inside the step.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import llama_2b, llama_step  # noqa: E402

from offload import fp8  # noqa: E402


def host_ms(step: Callable[[], None], reps: int = 3) -> float:
    """Host time of ``step``: the GPU is held busy by a long sleep first, so the launches queue
    behind it and the host never waits on the GPU (unless ``step`` syncs; keep it under about a
    thousand launches, the depth of the launch queue)."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # about a second on an H100
        t0 = time.perf_counter()
        step()
        out.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(out)


def wall_ms(step: Callable[[], None], reps: int = 5) -> float:
    """Median wall time of ``step``, synchronized before and after."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def kernels(step: Callable[[], None], top: int, steps: int = 2) -> None:
    """Print the GPU kernel time per step and the ``top`` kernels by self time."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = []
    total = 0.0
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = e.self_cuda_time_total
        if t <= 0:
            continue
        total += t
        rows.append((t, e.count, e.key))
    rows.sort(reverse=True)
    print(f"  GPU kernel time per step: {total / steps / 1e3:.1f} ms")
    for t, n, key in rows[:top]:
        print(f"    {t / steps / 1e3:8.2f} ms  {n // steps:5d}x  {key[:110]}")


def main() -> None:
    """Parse the options and profile each variant (or one Linear)."""
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="bf16,fp8_linears,fp8_linears_both,fp8")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--linear", action="store_true", help="host profile of one fp8.Linear instead")
    args = p.parse_args()
    if args.linear:
        for shape in ((16, 1024, 1024), (4096, 4096, 4096)):
            linear_host(shape)
        return
    spec = llama_2b()
    model, ids = spec.build(torch.device("cuda"))
    step = llama_step(model, ids)
    warnings.simplefilter("ignore")
    for v in args.variants.split(","):
        if v != "bf16":
            fp8.unconvert(model)  # back to bf16 (the same Parameters) before the next conversion
        if v == "fp8_linears":
            fp8.convert(model, module_filter_fn=lambda m, n: n != "lm_head", llama_ops=False)
        elif v == "fp8_linears_both":
            fp8.convert(model, module_filter_fn=lambda m, n: n != "lm_head", llama_ops=False, weight_layouts="both")
        elif v == "fp8":
            fp8.convert(model, module_filter_fn=lambda m, n: n != "lm_head")
        for _ in range(3):
            step()
        torch.cuda.reset_peak_memory_stats()
        w = wall_ms(step)
        peak = torch.cuda.max_memory_allocated() / 2**30
        print(f"\n== {v}: wall {w:.1f} ms, peak {peak:.2f} GiB", flush=True)
        kernels(step, args.top)
        sys.stdout.flush()




def linear_host(shape: tuple[int, int, int], calls: int = 20) -> None:
    """Host time per fwd+bwd call of fp8.Linear and nn.Linear at ``shape``, and a cProfile of the
    FP8 one (GPU held busy by a sleep so no call waits)."""
    import cProfile
    import pstats

    m, k, n = shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    # The floor: one GEMM launch alone, bf16 torch.mm against torch._scaled_mm.
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x8, w8 = x.detach().to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    reps = 100
    mm = host_ms(lambda: [torch.mm(x.detach(), w.t()) for _ in range(reps)]) / reps
    smm = host_ms(lambda: [torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
                           for _ in range(reps)]) / reps
    print(f"  {shape} one GEMM's host time: torch.mm {mm * 1e3:.0f} us, torch._scaled_mm {smm * 1e3:.0f} us", flush=True)
    for name, mod in (("bf16", torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)),
                      ("fp8", fp8.Linear(k, n, device="cuda", dtype=torch.bfloat16))):
        def call() -> None:
            mod(x).sum().backward()
        for _ in range(5):
            call()
        def many() -> None:
            for _ in range(calls):
                call()
        h = host_ms(many) / calls
        print(f"  {shape} {name}: host {h * 1e3:.0f} us/call", flush=True)
        if name == "fp8":
            torch.cuda.synchronize()
            torch.cuda._sleep(4_000_000_000)
            pr = cProfile.Profile()
            pr.enable()
            many()
            pr.disable()
            torch.cuda.synchronize()
            pstats.Stats(pr).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
