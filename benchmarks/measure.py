"""What the benchmarks measure, and how: the suite's measuring helpers (the scripts bring the
questions, ``workloads.py`` the models, ``common.py`` the setup and the reporting).

* One training step and its timing: :func:`make_step` (forward in TransformerEngine's call shape,
  backward, gradients dropped), :func:`time_steps` / :class:`Timing`, :func:`timed_row` (one
  contender, a failure recorded), :func:`run_variant` / :func:`variant_step` (one offload variant
  of a layer stack, with the context's stats), :func:`offload_context`, :func:`save_on_cpu_wrapper`,
  and :class:`HooksFloor` (the least any saved-tensor-hooks engine adds: the floor under ours and
  ``save_on_cpu``).
* The link and memory: :func:`pinned_bandwidth`, :func:`copy_floor_ms` (the measured pinned-host
  link and the copy floor of a step that moves given bytes each way, ``gpt_a.py``'s T2),
  :func:`layer_activation_bytes` (GPU memory each layer's forward leaves allocated),
  :class:`Census` / :func:`saved_tensor_census` (which tensors autograd saves, by module and dtype).

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

import contextlib
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch

from common import OUT_OF_MEMORY, Env, failure, fmt_gib, free_memory, gib

MB = 1e6  # GB/s figures are decimal (bytes / ms / 1e6), as in offload's stats


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


# -- one contender timed --------------------------------------------------------------------------
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
    ``host_parts.py``), no stats read. A failure is caught, printed and recorded in the row
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
    free_memory(env)
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
    free_memory(env)
    out: list[int] = []
    prev = torch.cuda.memory_allocated(env.device)
    h = x
    for layer in layers:
        h = layer(h)
        now = torch.cuda.memory_allocated(env.device)
        out.append(now - prev)
        prev = now
    del h
    free_memory(env)
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


class HooksFloor:
    """The least any engine built on saved-tensor hooks adds in TransformerEngine's call shape
    (Python hooks, or with ``native=True`` C ones): each layer's ``with`` pushes pack and unpack
    hooks that hand the tensor back (detached), and the sync function puts a gradient pre-hook that does nothing on the layer's
    output. No copies, no bookkeeping: the floor under our engine and ``save_on_cpu`` alike."""

    def __init__(self, *, native: bool = False) -> None:
        # ``native``: the hooks are ``Tensor.detach`` itself, a C function, as our native hooks
        # are: what autograd's hook machinery costs without any Python frame (the floor under
        # the default engine, whose hooks are C functions too).
        same = torch.Tensor.detach if native else self._same
        self._hooks = torch.autograd.graph.saved_tensors_hooks(same, same)

    @staticmethod
    def _same(t: torch.Tensor) -> torch.Tensor:
        # Detached, as any engine must: a layer's output handed back as itself would hold its
        # own grad_fn, a reference cycle that keeps every step's activations until a GC pass.
        return t.detach()

    @staticmethod
    def _reached(grad: Any) -> None:
        return None

    def __enter__(self) -> "HooksFloor":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)

    def sync(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mark ``tensor`` as the engine's sync function does, with a hook that does nothing."""
        if tensor.grad_fn is not None:
            tensor.grad_fn.register_prehook(self._reached)
        return tensor
