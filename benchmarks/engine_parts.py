"""The engine's host cost part by part: its own methods called by hand, no autograd in the loop.

One rep is one training step of a synthetic model, driven the way TransformerEngine's call shape
drives the engine, every call timed with ``time.perf_counter``:

* forward, for each of ``model_layers`` layers: ``ctx.__enter__()`` (**entry**), ``engine.pack``
  of the layer's tensors if the layer is offloaded (**pack**), ``ctx.__exit__()`` (**exit**: group
  close, layout, D2H submission; at the last layer also the end of the forward);
* **release**: ``engine.release`` (the GPU originals dropped once the D2H is ordered before their
  reuse). The schedule calls it from inside entry and exit; it is timed through a wrapper put on
  the engine instance and subtracted from the span it ran in, so no time is counted twice. An
  engine that releases some other way shows 0 calls here, and its release cost stays in entry/exit;
* backward, last layer first: ``engine.on_backward_reach(step, layer)`` (**reach**: what the
  backward marker of ``sync_function`` calls; it submits the layer's reload and prefetches),
  then ``engine.unpack`` of the layer's handles (**unpack**: the compute stream's wait on the
  reload and the typed view). An engine without ``on_backward_reach`` reloads on the first unpack
  of a group, and reach is reported as missing.

In a real step the forward parts run on the main thread and the backward parts on autograd's
device thread; the sum of both is the CPU the engine adds to a step. Nothing synchronises the
host inside a rep; the GPU is drained between reps, outside the timed spans (otherwise the host
runs ahead, the stream queue fills and submissions start to block).

Figures are medians over the reps of each part's time per step, divided by the offloaded tensors
per step (per tensor) and by the offloaded groups per step (per group). Used by ``host_parts.py``
(every part, T5b) and ``ab_engine.py`` (its DIRECT- workloads).
"""

from __future__ import annotations

import inspect
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

import common
import measure

PARTS = ("pack", "entry", "exit", "release", "reach", "unpack")
FORWARD_PARTS = ("pack", "entry", "exit", "release")  # the main thread in a real step
BACKWARD_PARTS = ("reach", "unpack")                   # autograd's device thread in a real step
PER_TENSOR_PARTS = ("pack", "unpack")                  # one call per saved tensor
PER_GROUP_PARTS = ("entry", "exit", "release", "reach")  # one call (or so) per layer / group


@dataclass(frozen=True)
class PartsShape:
    """A synthetic step: ``num_layers`` of ``model_layers`` layers offloaded, each saving
    ``tensors_per_layer`` bf16 tensors of ``tensor_bytes`` bytes (each its own storage)."""

    name: str
    model_layers: int
    num_layers: int
    tensors_per_layer: int
    tensor_bytes: int

    @property
    def tensors_per_step(self) -> int:
        return self.num_layers * self.tensors_per_layer


def engine_option_names() -> set[str]:
    """The keyword options this offload package's entry points accept (new and old engines)."""
    import offload
    from offload import api

    names = set(getattr(api, "ENGINE_OPTIONS", ()))
    names |= set(inspect.signature(offload.get_cpu_offload_context).parameters)
    return names


def supports_option(name: str) -> bool:
    """Whether ``get_cpu_offload_context`` takes ``name`` (e.g. ``timing``, absent before issue 12)."""
    return name in engine_option_names()


class _TimedCalls:
    """Stands in for a bound method of the engine, adding up the seconds spent in it."""

    __slots__ = ("fn", "seconds", "calls")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t
            self.calls += 1


def measure_parts(
    env: common.Env,
    shape: PartsShape,
    *,
    reps: int,
    warmup: int,
    options: Optional[dict[str, Any]] = None,
    native_hooks: bool = False,
) -> dict[str, Any]:
    """Host cost of each part of the engine's work for ``shape`` (see the module notes).

    ``options``: keyword arguments of the offload context (``min_offload_bytes``, ``timing``...).
    ``native_hooks``: pack and unpack through the hooks the engine pushes (the native pair where
    ``offload._entries`` is built: what a real step calls) instead of its Python methods.
    Returns a flat dict: ``<part>_us_t`` / ``<part>_us_g`` (per tensor / per group),
    ``<part>_us_step``, the sums ``per_tensor_us`` (pack + unpack per tensor), ``per_group_us``
    (entry + exit + release + reach per group), ``forward_us_step`` / ``backward_us_step`` and
    ``total_us_t`` (every part per tensor). A missing part (reach on an engine without it) is None.
    """
    perf = time.perf_counter
    k, model_layers = shape.num_layers, shape.model_layers
    ctx, _ = measure.offload_context(env, k, model_layers, **(options or {}))
    engine = ctx.engine
    release = _TimedCalls(engine.release)
    try:
        engine.release = release  # the schedule calls engine.release(...): it finds the wrapper
        wrapped = True
    except AttributeError:  # an engine with __slots__: release stays inside entry / exit
        wrapped = False
    reach = getattr(engine, "on_backward_reach", None)
    hooks = getattr(engine, "_hooks", None)
    if native_hooks and hooks is not None:
        pack, unpack = hooks.pack_hook, hooks.unpack_hook
    else:
        pack, unpack = engine.pack, engine.unpack
    numel = max(1, shape.tensor_bytes // 2)
    pool = [[torch.randn(numel, device=env.device, dtype=torch.bfloat16) for _ in range(shape.tensors_per_layer)] for _ in range(k)]
    samples: dict[str, list[float]] = {p: [] for p in PARTS}
    reached = 0  # reps that called on_backward_reach (needs the engine's step index too)
    spent = dict.fromkeys(PARTS, 0.0)

    def span(part: str, start: float, released_before: float) -> None:
        # The time since ``start`` less what engine.release took inside it.
        spent[part] += perf() - start - (release.seconds - released_before)

    try:
        for rep in range(warmup + reps):
            spent.update(dict.fromkeys(PARTS, 0.0))
            release.seconds = 0.0
            handles: list[list[Any]] = []
            for layer in range(model_layers):
                r, a = release.seconds, perf()
                ctx.__enter__()
                span("entry", a, r)
                if layer < k:
                    r, a = release.seconds, perf()
                    handles.append([pack(t) for t in pool[layer]])
                    span("pack", a, r)
                r, a = release.seconds, perf()
                ctx.__exit__(None, None, None)
                span("exit", a, r)
            step_index = getattr(getattr(engine, "step", None), "index", None)
            reached += reach is not None and step_index is not None
            outs: list[Any] = []
            for layer in reversed(range(model_layers)):
                if reach is not None and step_index is not None:
                    r, a = release.seconds, perf()
                    reach(step_index, layer)
                    span("reach", a, r)
                if layer < k:
                    r, a = release.seconds, perf()
                    outs.extend([unpack(h) for h in handles[layer]])
                    span("unpack", a, r)
            spent["release"] = release.seconds
            bad = [i for i, o in enumerate(outs) if not isinstance(o, torch.Tensor)]
            if bad:
                raise RuntimeError(f"engine.unpack returned non-tensors for entries {bad[:5]}")
            del outs, handles
            env.sync()  # drain the GPU between reps, untimed (see the module notes)
            if rep >= warmup:
                for p in PARTS:
                    samples[p].append(spent[p])
        env.sync()
        stats = measure.offload_stats(ctx)
    finally:
        if wrapped:
            del engine.release  # back to the class's method
    n_t, n_g = shape.tensors_per_step, k
    # Release is separable only where the engine called the wrapper; otherwise its cost is inside
    # entry / exit and the part is reported as missing rather than as zero.
    separable_release = wrapped and release.calls > 0
    if not separable_release:
        print(f"  note: {shape.name}: engine.release was not called through the engine instance; "
              "release time is counted in layer entry / exit")
    if stats["offloaded_tensors"] != n_t:
        print(f"  note: {shape.name}: the engine offloaded {stats['offloaded_tensors']} of {n_t} tensors per step "
              f"(kept: {stats['kept']})")
    res: dict[str, Any] = {
        "shape": shape.name,
        "model_layers": model_layers,
        "num_layers": k,
        "tensors_per_layer": shape.tensors_per_layer,
        "tensor_bytes": shape.tensor_bytes,
        "tensors_per_step": n_t,
        "groups_per_step": n_g,
        "offloaded_per_step": stats["offloaded_tensors"],
        "groups_offloaded": stats.get("groups_offloaded"),
        "options": dict(options or {}),
        "native": stats.get("native"),
        "native_hooks": native_hooks and hooks is not None,
        "reps": reps,
        "release_calls_per_step": release.calls / (warmup + reps),
        "reach_available": bool(reached),
        "release_separable": separable_release,
    }
    for p in PARTS:
        missing = (p == "reach" and not reached) or (p == "release" and not separable_release)
        us = None if missing else statistics.median(samples[p]) * 1e6
        res[f"{p}_us_step"] = us
        res[f"{p}_us_t"] = None if us is None else us / n_t
        res[f"{p}_us_g"] = None if us is None else us / n_g

    def total(parts: tuple[str, ...]) -> float:
        return sum(res[f"{p}_us_step"] or 0.0 for p in parts)

    res["per_tensor_us"] = total(PER_TENSOR_PARTS) / n_t
    res["per_group_us"] = total(PER_GROUP_PARTS) / n_g
    res["forward_us_step"] = total(FORWARD_PARTS)
    res["backward_us_step"] = total(BACKWARD_PARTS)
    res["total_us_t"] = total(PARTS) / n_t
    del ctx, engine, pool
    common.free_memory(env)
    return res


# -- the same parts inside real training steps ------------------------------------------------------
IN_STEP_PARTS = ("entry", "pack", "exit", "sync", "reach", "unpack", "freed")
IN_STEP_FORWARD = ("entry", "pack", "exit", "sync")      # the main thread
IN_STEP_BACKWARD = ("reach", "unpack", "freed")          # autograd's device thread
IN_STEP_PER_TENSOR = ("pack", "unpack")
IN_STEP_PER_GROUP = tuple(p for p in IN_STEP_PARTS if p not in IN_STEP_PER_TENSOR)
# Timed inside the parts above (the schedule calls them from entry and exit), so never summed:
# a group's D2H submission (``start_offload``) and its release (``release``: the compute
# stream's wait, the originals' memory given back).
IN_STEP_INSIDE = ("offload", "release")


class _TimedContext:
    """The layer context, its ``__enter__`` / ``__exit__`` timed (TransformerEngine's call shape)."""

    def __init__(self, ctx: Any) -> None:
        self.entry = _TimedCalls(ctx.__enter__)
        self.exit = _TimedCalls(ctx.__exit__)

    def __enter__(self) -> "_TimedContext":
        self.entry()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.exit(*exc)


def measure_in_step(
    env: common.Env,
    layers: torch.nn.Module,
    x: torch.Tensor,
    *,
    num_layers: int,
    steps: int,
    warmup: int,
    options: Optional[dict[str, Any]] = None,
    native_hooks: bool = False,
) -> dict[str, Any]:
    """Each entry point of the engine timed inside real training steps of ``layers``.

    The direct loop of :func:`measure_parts` runs the engine's code alone, hot in the caches, with
    the GPU drained; inside a step every call the engine makes (a driver submission, a torch view,
    an allocation) shares the host with autograd and the layers' kernels and costs more. Here the
    engine's entry points are wrapped in place, inclusive of everything they call: **entry** and
    **exit** (the layer context), **pack** (every saved tensor, kept ones included), **sync**
    (``sync_function``: the backward marker), on the main thread; **reach** (the marker firing:
    reload submission and prefetch), **unpack**, **freed** (a group's host region going back
    when autograd lets go of it), on autograd's device thread. Per tensor: pack + unpack over the
    offloaded tensors; per group: the other parts over the offloaded groups (each charges all
    calls, kept tensors' too, to its unit). Needs the engine's ``_hooks``,
    ``on_backward_reach`` and ``_group_freed`` (this tree's engine); parts it cannot wrap are None.

    Timing pack and unpack means Python hooks in place of the engine's (native ones cannot be
    wrapped). ``native_hooks=True`` leaves the engine's hooks alone, so that the group parts are
    timed as a default step runs them; pack and unpack are then None. Either way the
    ``IN_STEP_INSIDE`` parts (a group's D2H submission and its release, both called inside entry
    or exit) are reported apart and never added to the totals.
    """
    ctx, sync = measure.offload_context(env, num_layers, len(layers), **(options or {}))
    engine = ctx.engine
    timed_ctx = _TimedContext(ctx)
    timers: dict[str, Optional[_TimedCalls]] = {"entry": timed_ctx.entry, "exit": timed_ctx.exit, "sync": _TimedCalls(sync)}
    if not native_hooks and hasattr(engine, "_hooks") and hasattr(engine, "pack") and hasattr(engine, "unpack"):
        timers["pack"], timers["unpack"] = _TimedCalls(engine.pack), _TimedCalls(engine.unpack)
        engine._hooks = torch.autograd.graph.saved_tensors_hooks(timers["pack"], timers["unpack"])
    for part, name in (("reach", "on_backward_reach"), ("freed", "_group_freed"),
                       ("offload", "start_offload"), ("release", "release")):
        method = getattr(engine, name, None)
        timers[part] = None if method is None else _TimedCalls(method)
        if method is not None:
            setattr(engine, name, timers[part])  # the marker and each new group look it up here
    step = measure.make_step(layers, x, context=timed_ctx, sync=timers["sync"])
    for _ in range(warmup):
        step()
    env.sync()
    for t in timers.values():
        if t is not None:
            t.seconds, t.calls = 0.0, 0
    start = time.perf_counter()
    for _ in range(steps):
        step()
    env.sync()
    step_ms = (time.perf_counter() - start) / steps * 1e3
    stats = measure.offload_stats(ctx)
    n_t, n_g = stats["offloaded_tensors"], stats.get("groups_offloaded")
    res: dict[str, Any] = {"steps": steps, "instrumented_step_ms": step_ms, "offloaded_tensors": n_t, "groups_offloaded": n_g}
    for part in IN_STEP_PARTS + IN_STEP_INSIDE:
        t = timers.get(part)
        res[f"{part}_us_step"] = None if t is None else t.seconds / steps * 1e6
        res[f"{part}_calls_step"] = None if t is None else t.calls / steps

    def total(parts: tuple[str, ...]) -> Optional[float]:
        values = [res[f"{p}_us_step"] for p in parts]
        return None if any(v is None for v in values) else sum(values)

    per_t, per_g = total(IN_STEP_PER_TENSOR), total(IN_STEP_PER_GROUP)
    res["per_tensor_us"] = None if per_t is None or not n_t else per_t / n_t
    res["per_group_us"] = None if per_g is None or not n_g else per_g / n_g
    res["forward_us_step"] = total(IN_STEP_FORWARD)
    res["backward_us_step"] = total(IN_STEP_BACKWARD)
    res["parts_us_step"] = total(IN_STEP_PARTS)
    del step, ctx, engine, timed_ctx, timers
    common.free_memory(env)
    return res
