"""The main job: a short training run of a small GPT with activation offload, then the report.

    python -m offload.demo            # on the current CUDA device, or on the CPU without one
    python -m offload.demo --device cpu --steps 3

It trains for a few steps with and without offload from the same weights, checks that the
gradients are bitwise equal, and prints step times, peak memory (on CUDA) and the stats report.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
import warnings

import torch

import offload
from offload.models import GPT, run_layers


def _sdpa_repeatable() -> contextlib.AbstractContextManager:
    # The FLASH backward is not bit-for-bit repeatable, and the efficient one warns that it may
    # not be under deterministic mode; the math backend is, and the demo is small enough for it.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the process exit code (1 if gradients differ)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--offload-layers", type=int, default=None, help="default: all but the last")
    parser.add_argument("--mode", choices=["v1", "v2"], default=None, help="default: NVTE_CPU_OFFLOAD_V1, else v2")
    args = parser.parse_args(argv)

    # The embedding backward accumulates with atomics on CUDA unless deterministic algorithms are
    # on; without this the plain run would not repeat itself and the bitwise check would be void.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    warnings.filterwarnings("ignore", message=".*does not have a deterministic implementation.*")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    hidden, heads, seq, batch = (1024, 16, 1024, 4) if cuda else (128, 4, 128, 2)
    torch.manual_seed(0)
    model = GPT(vocab=1000, hidden=hidden, heads=heads, layers=args.layers, max_seq=seq, device=device, dtype=dtype)
    idx = torch.randint(0, 1000, (batch, seq), device=device)
    target = torch.randint(0, 1000, (batch, seq), device=device)
    k = args.layers - 1 if args.offload_layers is None else args.offload_layers
    ctx, sync = offload.get_cpu_offload_context(
        True, num_layers=k, model_layers=args.layers, mode=args.mode, device=device,
        selection="auto", min_offload_bytes=0 if not cuda else offload.DEFAULT_MIN_OFFLOAD_BYTES,
    )

    def step(use_offload: bool) -> tuple[float, list[torch.Tensor], int]:
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        x = model.embed_tokens(idx)
        x = run_layers(model.layers, x, ctx if use_offload else None, sync if use_offload else None)
        loss = torch.nn.functional.cross_entropy(model.logits(x).float().flatten(0, 1), target.flatten())
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - start) * 1e3
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        return ms, [p.grad.clone() for p in model.parameters()], peak

    print(f"offload demo: GPT {args.layers} layers, hidden {hidden}, seq {seq}, batch {batch}, {dtype}, "
          f"device {device}, offloading {k} layers, native copies: {offload.native_available()}")
    with _sdpa_repeatable():
        ok = True
        for i in range(args.steps):
            plain_ms, plain_grads, plain_peak = step(False)
            off_ms, off_grads, off_peak = step(True)
            same = all(torch.equal(a, b) for a, b in zip(plain_grads, off_grads))
            ok &= same
            mem = f", peak {plain_peak / 2**30:.2f} -> {off_peak / 2**30:.2f} GiB" if cuda else ""
            print(f"step {i + 1}: plain {plain_ms:7.1f} ms, offload {off_ms:7.1f} ms{mem}, gradients bitwise equal: {same}")
    print()
    print(ctx.report())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
