"""A new sequence length's first step (issue 50 s2), for ``first_step.py --new-lengths``: LLAMA-1B,
batch 4, under ``OffloadActivations(layers, num_offload_layers=0)``, plain or under HF's own
checkpointing (non-reentrant). Each case runs in a process of its own: cuDNN caches its attention
plans per process (and per thread), so a case that followed another would find them built.

- :func:`case`: two steps at 1024 tokens, then three at each of :data:`LENGTHS`; the attention
  backward built ahead (``offload.layers.attention_graphs``) ``off`` or ``on``.
- :func:`where`: where a new length's extra time goes, without the copy: each of two lengths'
  first and second steps, forward and backward timed apart (synchronised), and torch's profiler's
  per-op host time and device time, first step against second; the ops whose host time grew
  most are reported.
"""

from __future__ import annotations

import collections
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

import offload

import common
import workers
import workloads

LENGTHS = (2048, 3072, 4096, 6144)
CASES = tuple((form, copy) for form in ("plain", "ckpt") for copy in ("off", "on"))
WHERE_LENGTHS = (2048, 6144)
TOP_OPS = 6


def _model_and_step(env: common.Env, form: str) -> tuple[Any, Any, Callable[[int], tuple[float, float]]]:
    # The model, its context (the copy on, as by default on CUDA) and one step, timed: (forward ms, backward ms).
    spec = workloads.llama_1b(workloads.scale_for(env.smoke))
    model, _ = spec.build(env.device)
    if form == "ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    ctx = offload.OffloadActivations(model.model.layers, num_offload_layers=0)

    def step(length: int) -> tuple[float, float]:
        ids = torch.randint(0, spec.vocab, (spec.batch, length), device=env.device)
        env.sync()
        started = time.perf_counter()
        with ctx:
            loss = model(input_ids=ids, labels=ids).loss
        env.sync()
        forward = time.perf_counter()
        loss.backward()
        model.zero_grad(set_to_none=True)
        env.sync()
        return (forward - started) * 1e3, (time.perf_counter() - forward) * 1e3

    return model, ctx, step


def _scaled(env: common.Env, lengths: tuple[int, ...]) -> list[int]:
    scale = workloads.scale_for(env.smoke)
    return [max(8, int(n * scale)) for n in lengths]


def case(env: common.Env, form: str, copy: str) -> dict[str, Any]:
    """One case, in this process: each length's three step times (ms)."""
    _, ctx, step = _model_and_step(env, form)
    ctx._attention.enabled = copy == "on" and ctx._attention.enabled  # (off on the CPU either way)
    warm, *lengths = _scaled(env, (1024, *LENGTHS))
    step(warm), step(warm)
    row: dict[str, Any] = {"case": f"{form}, copy {copy}"}
    for n, length in zip(LENGTHS, lengths):
        row[str(n)] = [sum(step(length)) for _ in range(3)]
    row["copies"] = len(ctx._attention.built)
    return row


def where(env: common.Env, form: str) -> dict[str, Any]:
    """Where each of :data:`WHERE_LENGTHS`' first step spends its extra time, the copy off."""
    from torch.profiler import ProfilerActivity, profile

    _, ctx, step = _model_and_step(env, form)
    ctx._attention.enabled = False
    warm, *lengths = _scaled(env, (1024, *WHERE_LENGTHS))
    step(warm), step(warm)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.device.type == "cuda" else [])
    row: dict[str, Any] = {"form": form}
    for n, length in zip(WHERE_LENGTHS, lengths):
        steps, totals = [], []
        for _ in range(2):
            with profile(activities=activities) as prof:
                steps.append(step(length))
            host: collections.Counter = collections.Counter()
            device: collections.Counter = collections.Counter()
            for event in prof.key_averages():
                host[event.key] += event.self_cpu_time_total / 1e3
                device[event.key] += event.self_device_time_total / 1e3
            totals.append((host, device))
        (host1, device1), (host2, device2) = totals
        grew = sorted(host1, key=lambda k: host2.get(k, 0.0) - host1[k])[:TOP_OPS]
        row[str(n)] = {
            "first_ms": [round(t, 1) for t in steps[0]], "second_ms": [round(t, 1) for t in steps[1]],
            "device_ms": [round(sum(device1.values()), 1), round(sum(device2.values()), 1)],
            "host_grew_ms": {k: round(host1[k] - host2.get(k, 0.0), 1) for k in grew}}
    return row


def _in_processes(env: common.Env, script: str, specs: list[str]) -> list[dict[str, Any]]:
    # ``script --worker SPEC`` in a process of its own per spec (workers.spawn: its JSON read
    # back, a death recorded as the row's "error"), one after the other.
    extra = ["--no-json"] + (["--cpu-smoke"] if env.smoke else [])
    jobs = [(spec, ["--worker", spec, *extra]) for spec in specs]
    return [dict(row, spec=spec) for spec, row in workers.spawn_all(Path(script), jobs).items()]


def run_worker(env: common.Env, spec: str) -> dict[str, Any]:
    """A worker's row from its ``--worker`` spec: ``case:FORM,COPY`` or ``where:FORM``."""
    kind, _, value = spec.partition(":")
    return case(env, *value.split(",")) if kind == "case" else where(env, value)


def cases(env: common.Env, script: str, rounds: int) -> list[dict[str, Any]]:
    """Every case in a process of its own (``script --worker case:FORM,COPY``), ``rounds`` times,
    the cases of a round one after the other; each length's first step and its ratio to the
    median of the later two."""
    rows = []
    for round_ in range(rounds):
        for row in _in_processes(env, script, [f"case:{f},{c}" for f, c in CASES]):
            row["round"] = round_ + 1
            row.setdefault("case", row["spec"])  # (a worker that died has only its spec)
            for n in LENGTHS:
                times = row.get(str(n))
                if times:
                    row[f"{n}_first"], row[f"{n}_x"] = times[0], times[0] / statistics.median(times[1:])
            rows.append(row)
    return rows


def wheres(env: common.Env, script: str) -> list[dict[str, Any]]:
    """:func:`where` for the plain and the checkpointed form, each in a process of its own
    (``script --worker where:FORM``)."""
    return _in_processes(env, script, ["where:plain", "where:ckpt"])
