"""The host link's speed, measured once before a plan is made (:class:`~offload.planner.types.LinkProfile`)."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ..host.pinning import allocate_host_block
from .types import LinkProfile


def measure_link(device: torch.device, nbytes: int = 32 << 20, repeats: int = 4) -> LinkProfile:
    """The host link's GB/s each way and both ways at once, on pinned memory (host memcpy on CPU).

    Costs one pinned block of ``2 * nbytes`` and a few copies, on the measured probe step's
    critical path: pinned as the arena pins (huge pages registered: 64 MiB in ~10 ms, where two
    64 MiB blocks from torch's pinned allocator took most of the 102 ms this measurement cost
    T22's measured step on the H200), and 32 MiB copies, at ~0.6 ms each long enough that a
    launch's microseconds do not show in the figure.
    """
    if device.type != "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)
        start = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src)
        gbps = nbytes * repeats / (time.perf_counter() - start) / 1e9
        return LinkProfile(d2h_gbps=gbps, h2d_gbps=gbps, duplex_gbps=gbps, slowdown_one_way=0.0, slowdown_duplex=0.0)
    host, _ = allocate_host_block(2 * nbytes, pinned=True)
    host_a, host_b = host[:nbytes], host[nbytes:]
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device=device)
    d2h, h2d = torch.cuda.Stream(device), torch.cuda.Stream(device)
    torch.cuda.synchronize(device)

    def timed(run: Callable[[], None]) -> float:
        run()  # warm-up
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        torch.cuda.synchronize(device)
        return (time.perf_counter() - start) * 1e3 / repeats

    def out() -> None:
        with torch.cuda.stream(d2h):
            host_a.copy_(dev_a, non_blocking=True)

    def back() -> None:
        with torch.cuda.stream(h2d):
            dev_b.copy_(host_b, non_blocking=True)

    def both() -> None:
        out()
        back()

    d2h_ms, h2d_ms, both_ms = timed(out), timed(back), timed(both)
    return LinkProfile(
        d2h_gbps=nbytes / d2h_ms / 1e6,
        h2d_gbps=nbytes / h2d_ms / 1e6,
        duplex_gbps=2 * nbytes / both_ms / 1e6,
    )


class Once:
    """A callable that calls ``fn`` the first time and returns that result ever after (the host
    link is measured once, for the pin-ahead plan and the profile alike)."""

    __slots__ = ("fn", "value")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn, self.value = fn, None

    def __call__(self) -> Any:
        if self.value is None:
            self.value = self.fn()
        return self.value
