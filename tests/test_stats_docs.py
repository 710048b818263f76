"""The documented stats keys and the report's wording per transport."""

from __future__ import annotations

import typing

import torch

import offload
from offload.engine.stats import StepCounters, StepStats, format_report, snapshot

from _util import cpu_context, make_gpt_layers, train_step


def _snapshot(transport: str) -> StepStats:
    counters = StepCounters(step=1, mode="v2", offloaded_tensors=3, offloaded_bytes=3 << 20,
                            released_bytes=3 << 20, bytes_d2h=3 << 20, bytes_h2d=3 << 20, reloads=1, finished=True)
    return snapshot(counters, pinned_bytes_held=4 << 20, native=True, transport=transport,
                    host_budget_bytes=1 << 30, host_budget_source="host_budget_bytes")


def test_every_stats_key_is_declared_and_documented() -> None:
    layers = make_gpt_layers(3)
    ctx, sync = cpu_context(2, 3)
    train_step(layers, torch.randn(2, 16, 64), ctx, sync)
    declared = typing.get_type_hints(StepStats)
    assert set(ctx.stats) == set(declared), (
        f"ctx.stats and offload.engine.stats.StepStats disagree: undeclared {set(ctx.stats) - set(declared)}, "
        f"missing {set(declared) - set(ctx.stats)}"
    )
    doc = StepStats.__doc__ or ""
    undocumented = [k for k in declared if f"``{k}``" not in doc]
    assert not undocumented, f"StepStats' docstring does not explain {undocumented}"
    assert offload.StepStats is StepStats


def test_stats_properties_point_to_the_documented_keys() -> None:
    for prop in (offload.OffloadContext.stats, offload.OffloadActivations.stats):
        assert "StepStats" in (prop.__doc__ or ""), f"{prop.fget.__qualname__} does not point to StepStats"


def test_host_report_speaks_of_host_copies_not_the_gpu() -> None:
    text = format_report(_snapshot("cpu"))
    for word in ("GPU", "D2H", "H2D", "pinned"):
        assert word not in text, f"the host transport's report says {word!r}:\n{text}"
    for label in ("host copy out", "host copy back", "host arena held", "originals freed after the host copy"):
        assert label in text, f"{label!r} missing from the host report:\n{text}"


def test_cuda_report_keeps_the_gpu_words() -> None:
    text = format_report(_snapshot("cuda"))
    for label in ("D2H", "H2D", "released from the GPU", "pinned held", "groups kept on GPU"):
        assert label in text, f"{label!r} missing from the CUDA report:\n{text}"
    assert "host copy" not in text
