"""Memory and bandwidth probes of the benchmark suite (split out of ``common.py``, which
re-exports every name here, so ``common.pinned_bandwidth`` and friends keep working).

* :func:`pinned_bandwidth`, :func:`copy_floor_ms`: the measured pinned-host link and the copy
  floor of a step that moves given bytes each way (``gpt_a.py``'s T2).
* :func:`layer_activation_bytes`: GPU memory each layer's forward leaves allocated.
* :class:`Census`, :func:`saved_tensor_census`: which tensors autograd saves, by module and dtype.

No import of ``common`` at module level: ``common`` imports this module, and either may be
imported first (the helpers that need :func:`common.free_memory` import it when called).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import torch

if TYPE_CHECKING:  # only for the annotations: a module-level import would be circular
    from common import Env

MB = 1e6  # GB/s figures are decimal (bytes / ms / 1e6), as in offload's stats


def _free_memory(env: "Env") -> None:
    from common import free_memory  # noqa: PLC0415 - see the module docstring

    free_memory(env)


# -- bandwidth ------------------------------------------------------------------------------------
def pinned_bandwidth(env: Env, nbytes: int = 256 << 20, reps: int = 5) -> Optional[dict[str, float]]:
    """Measured pinned-host copy bandwidth (GB/s, decimal) of one large copy each way, and both
    directions at once on two streams. None in CPU smoke runs (there is no PCIe to measure)."""
    if not env.cuda:
        return None
    dev = env.device
    host_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_src.fill_(1)
    gpu_src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    gpu_dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    s_d2h, s_h2d = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def timed(stream: Any, fn: Callable[[], None]) -> tuple[Any, Any]:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            a.record()
            fn()
            b.record()
        return a, b

    d2h = lambda: host_dst.copy_(gpu_src, non_blocking=True)  # noqa: E731
    h2d = lambda: gpu_dst.copy_(host_src, non_blocking=True)  # noqa: E731
    torch.cuda.synchronize(dev)
    for _ in range(2):  # warm-up
        d2h(); h2d()
    torch.cuda.synchronize(dev)
    out: dict[str, list[float]] = {"d2h": [], "h2d": [], "both": []}
    for _ in range(reps):
        a, b = timed(s_d2h, d2h)
        torch.cuda.synchronize(dev)
        out["d2h"].append(nbytes / a.elapsed_time(b) / MB)
        a, b = timed(s_h2d, h2d)
        torch.cuda.synchronize(dev)
        out["h2d"].append(nbytes / a.elapsed_time(b) / MB)
        # Both at once: span from the earlier start to the later end, over the bytes moved.
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        s_d2h.wait_stream(torch.cuda.current_stream(dev))
        s_h2d.wait_stream(torch.cuda.current_stream(dev))
        _, e1 = timed(s_d2h, d2h)
        _, e2 = timed(s_h2d, h2d)
        torch.cuda.synchronize(dev)
        out["both"].append(2 * nbytes / max(start.elapsed_time(e1), start.elapsed_time(e2)) / MB)
    del host_src, host_dst, gpu_src, gpu_dst
    _free_memory(env)
    result = {f"{k}_gbps": statistics.median(v) for k, v in out.items()}
    result["copy_bytes"] = nbytes
    return result


def copy_floor_ms(bytes_d2h: int, bytes_h2d: int, bw: Optional[dict[str, float]]) -> tuple[Optional[float], Optional[float]]:
    """(serial floor, one-direction floor) in ms for a step that moves these bytes each way.

    Serial: D2H then H2D at the measured per-direction rates (forward copies out, backward copies
    back: a step cannot be shorter than both added). One-direction: the slower direction alone
    (the floor if the two directions overlapped completely).
    """
    if bw is None:
        return None, None
    d = bytes_d2h / (bw["d2h_gbps"] * MB)
    h = bytes_h2d / (bw["h2d_gbps"] * MB)
    return d + h, max(d, h)


# -- memory probes --------------------------------------------------------------------------------
def layer_activation_bytes(layers: Iterable[torch.nn.Module], x: torch.Tensor, env: Env) -> Optional[list[int]]:
    """GPU memory that each layer's forward leaves allocated (its saved activations and output).

    Measured with ``memory_allocated`` around each layer of a plain forward with grad enabled; the
    graph is dropped afterwards. None in CPU smoke runs.
    """
    if not env.cuda:
        return None
    _free_memory(env)
    out: list[int] = []
    prev = torch.cuda.memory_allocated(env.device)
    h = x
    for layer in layers:
        h = layer(h)
        now = torch.cuda.memory_allocated(env.device)
        out.append(now - prev)
        prev = now
    del h
    _free_memory(env)
    return out


@dataclass
class Census:
    """Saved tensors of a forward, deduplicated by storage, by module and by dtype."""

    by_module: dict[str, int] = field(default_factory=dict)
    by_dtype: dict[str, int] = field(default_factory=dict)
    total: int = 0
    tensors: int = 0


def saved_tensor_census(module: torch.nn.Module, x: torch.Tensor, *, min_bytes: int = 0) -> Census:
    """Which tensors autograd saves when ``module`` runs on ``x``, attributed to the innermost
    named submodule running at the time ('<self>' for functional ops in the module's own forward).
    Parameters are left out. Each storage is counted once (its bytes as a whole)."""
    census = Census()
    stack: list[str] = ["<self>"]
    seen: set[int] = set()
    handles = []

    def enter(name: str) -> Callable[..., None]:
        def hook(module: Any, args: Any) -> None:  # must return None: a value would replace the input
            stack.append(name)

        return hook

    def leave(module: Any, args: Any, output: Any) -> None:  # must return None (would replace the output)
        stack.pop()

    for name, sub in module.named_modules():
        if not name:
            continue
        handles.append(sub.register_forward_pre_hook(enter(name)))
        handles.append(sub.register_forward_hook(leave))

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if isinstance(t, torch.nn.Parameter) or (t.requires_grad and t.is_leaf) or (base.requires_grad and base.is_leaf):
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() < min_bytes:
            return t
        seen.add(key)
        n = storage.nbytes()
        census.by_module[stack[-1]] = census.by_module.get(stack[-1], 0) + n
        dt = str(t.dtype).replace("torch.", "")
        census.by_dtype[dt] = census.by_dtype.get(dt, 0) + n
        census.total += n
        census.tensors += 1
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = module(x)
        del y
    finally:
        for h in handles:
            h.remove()
    return census
