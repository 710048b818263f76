"""The host-cost benchmarks on the CPU: ``host_cost.py`` (its variants, rounds and interleaved
cycles), ``interleave.py`` (rotation, per-cycle ratios, the median's interval, the fast step, the
host's part of a step), ``host_profile.py --py-spy`` (splitting py-spy's stacks, comparing
variants, a failed worker, no py-spy) and ``engine_parts.py`` inside real steps."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from _bench_util import bench_module, run_smoke


def test_host_cost_cpu_smoke_times_every_variant_per_round() -> None:
    result = run_smoke("host_cost.py", "host_cost_pytest", "--rounds", "2")
    summary = {row["variant"]: row for row in result["summary"]}
    assert list(summary) == ["plain", "offload (default)", "offload (Python hooks)", "offload group_bytes=0 (off)", "offload group_bytes=4 MiB",
                             "offload group_bytes=16 MiB", "hooks floor", "hooks floor (C)", "offload (nothing fits)", "save_on_cpu"]
    assert all(len(row["ratios"]) == 2 and row["ratio_median"] > 0 for row in summary.values()), summary
    # Off, each offloaded layer is copied on its own; the default (32 MiB) and 16 MiB hold all of
    # SMALL's (tiny on the CPU) in one.
    assert summary["offload group_bytes=0 (off)"]["groups"] == [15, 15]
    assert summary["offload (default)"]["groups"] == summary["offload group_bytes=16 MiB"]["groups"] == [1, 1]
    # Each round starts one variant later, so no variant always runs at the same place.
    n = len(summary)
    for r, rows in enumerate(result["rounds"]):
        assert [row["position"] for row in rows] == [(i - r) % n for i in range(n)], r
    assert result["workload"].startswith("SMALL")


def test_host_cost_interleaved_times_each_variant_once_per_cycle() -> None:
    result = run_smoke("host_cost.py", "host_cost_interleaved_pytest", "--interleave", "--steps", "3")
    summary = {row["variant"]: row for row in result["summary"]}
    assert len(summary) == 10 and summary["plain"]["ratio_median"] == 1.0
    assert all(row["cycles"] == 3 and row["ratio_p25"] <= row["ratio_median"] <= row["ratio_p75"] for row in summary.values()), summary
    assert summary["offload group_bytes=0 (off)"]["groups"] == 15 and summary["offload (default)"]["groups"] == 1
    assert summary["offload (nothing fits)"]["groups"] == 0  # every tensor refused by the budget
    # Every variant's step reports its forward's return, so each host time is split there.
    assert all(len(row["forward_steps_ms"]) == 3 and 0 < row["forward_ms"] < row["step_ms"] for row in summary.values()), summary
    assert all(row["forward_ratio_median"] > 0 and row["backward_ratio_median"] > 0 for row in summary.values())


def test_interleave_rotates_the_order_and_pairs_ratios_within_a_cycle() -> None:
    interleave = bench_module("interleave")
    order: list[str] = []
    # Each variant's step "takes" a time set by the cycle: a drift that a per-cycle ratio cancels.
    times = {"plain": 10.0, "a": 12.0, "b": 15.0}
    drift = [1.0, 3.0, 0.5]
    variants = [interleave.Variant(label, (lambda label=label: order.append(label))) for label in times]
    env = SimpleNamespace(sync=lambda: None)
    interleave.run_cycles(env, variants, warmup=1, cycles=3)  # type: ignore[arg-type]
    assert order[:3] == ["plain", "a", "b"]  # the warm-up
    assert order[3:] == ["plain", "a", "b", "a", "b", "plain", "b", "plain", "a"]
    assert all(len(v.step_ms) == len(v.host_ms) == 3 for v in variants)
    for v in variants:
        v.step_ms = [times[v.label] * d for d in drift]
        v.host_ms = [0.5 * times[v.label] * d for d in drift] if v.label != "b" else [5.0 * d for d in drift]
    rows = {row["variant"]: row for row in interleave.summarize(variants)}
    assert rows["a"]["ratio_median"] == 1.2 and rows["b"]["ratio_median"] == 1.5
    assert rows["a"]["ratio_p25"] == rows["a"]["ratio_p75"] == 1.2  # the drift cancelled in every cycle
    assert rows["plain"]["step_ms"] == 10.0 and rows["a"]["groups"] is None
    assert rows["a"]["ratio_ci95"] == [1.2, 1.2] and rows["b"]["steps_ms"] == [15.0, 45.0, 7.5]
    assert rows["b"]["ratio_fast"] == pytest.approx(1.5)  # 10th percentiles: 15 * 0.5 against 10 * 0.5
    # a's extra is all host time; b's host time is plain's, so what it adds waits on the GPU.
    assert rows["a"]["host_ratio_median"] == pytest.approx(1.2) and rows["b"]["host_ratio_median"] == pytest.approx(1.0)


def test_interleave_times_the_host_apart_from_the_sync() -> None:
    interleave = bench_module("interleave")
    clock = [0.0]
    monkey_time = SimpleNamespace(perf_counter=lambda: clock[0])

    def step() -> None:
        clock[0] += 0.002  # 2 ms of host work

    def sync() -> None:
        clock[0] += 0.003  # then 3 ms waiting for the device

    variants = [interleave.Variant("plain", step)]
    real_time = interleave.time
    interleave.time = monkey_time
    try:
        interleave.run_cycles(SimpleNamespace(sync=sync), variants, warmup=0, cycles=2)  # type: ignore[arg-type]
    finally:
        interleave.time = real_time
    assert variants[0].host_ms == pytest.approx([2.0, 2.0]) and variants[0].step_ms == pytest.approx([5.0, 5.0])


def test_interleave_splits_the_host_time_at_the_forwards_return() -> None:
    interleave = bench_module("interleave")
    clock = [0.0]
    monkey_time = SimpleNamespace(perf_counter=lambda: clock[0])
    forward_ms = {"plain": 2.0, "offload": 3.0}
    backward_ms = {"plain": 4.0, "offload": 4.4}
    variants: list[Any] = []

    def make_step(label: str) -> Any:
        def step() -> None:
            clock[0] += forward_ms[label] / 1e3
            variant.forward_done()  # what make_step's on_forward calls
            clock[0] += backward_ms[label] / 1e3
        variant = interleave.Variant(label, step)
        return variant

    variants = [make_step("plain"), make_step("offload")]
    real_time = interleave.time
    interleave.time = monkey_time
    try:
        interleave.run_cycles(SimpleNamespace(sync=lambda: None), variants, warmup=2, cycles=3)  # type: ignore[arg-type]
    finally:
        interleave.time = real_time
    # Warm-up steps are not recorded, a second run's included; each timed step is split where
    # its forward returned.
    assert [len(v.forward_ms) for v in variants] == [3, 3]
    try:
        interleave.time = monkey_time
        interleave.run_cycles(SimpleNamespace(sync=lambda: None), variants, warmup=2, cycles=1)  # type: ignore[arg-type]
    finally:
        interleave.time = real_time
    assert [len(v.forward_ms) for v in variants] == [len(v.step_ms) for v in variants] == [4, 4]
    rows = {row["variant"]: row for row in interleave.summarize(variants)}
    assert rows["offload"]["forward_ratio_median"] == pytest.approx(1.5)
    assert rows["offload"]["backward_ratio_median"] == pytest.approx(1.1)
    assert rows["offload"]["host_ratio_median"] == pytest.approx(7.4 / 6.0)
    assert rows["offload"]["forward_ms"] == pytest.approx(3.0) and rows["offload"]["forward_steps_ms"] == [3.0] * 4
    # A step that does not report its forward has no split (and no made-up one).
    bare = [interleave.Variant("plain", lambda: None), interleave.Variant("x", lambda: None)]
    interleave.run_cycles(SimpleNamespace(sync=lambda: None), bare, warmup=0, cycles=2)  # type: ignore[arg-type]
    assert all(row["forward_ratio_median"] is None and row["backward_ratio_median"] is None for row in interleave.summarize(bare))


def test_the_median_interval_and_the_fast_step() -> None:
    interleave = bench_module("interleave")
    # 100 values 1..100: the order statistics of ranks 40 and 61, the textbook interval.
    assert interleave.median_interval([float(v) for v in range(100, 0, -1)]) == (40.0, 61.0)
    assert interleave.median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)  # too few: the range
    # It narrows as the cycles grow: a 40-cycle median is less sure than a 400-cycle one.
    spread = [1.0 + 0.01 * (i % 30) for i in range(400)]
    lo40, hi40 = interleave.median_interval(spread[:40])
    lo400, hi400 = interleave.median_interval(spread)
    assert hi400 - lo400 < hi40 - lo40
    # The fast step is the 10th percentile, not the middle, and slow outliers do not move it.
    assert interleave.fast_step([float(v) for v in range(1, 101)]) == pytest.approx(10.1)
    assert interleave.fast_step([10.0] * 9 + [1000.0] * 2) == pytest.approx(10.0)


def test_host_profile_samples_splits_stacks_into_the_engine_and_the_rest() -> None:
    host_profile = bench_module("host_profile")
    lines = [
        "<module> (loop.py:3);step (loop.py:9);linear (libtorch_cpu.so) 50",
        "<module> (loop.py:3);step (loop.py:9);LinearGELU.forward (offload/models.py:40);gelu (libtorch_cpu.so) 20",
        "<module> (loop.py:3);step (loop.py:9);call_pack_hook (libtorch_python.so);"
        "hook<pack_common> (saved_hooks.cpp:312);pack_common (saved_hooks.cpp:235);HostArena.claim (offload/host/arena.py:184) 12",
        "<module> (loop.py:3);OffloadContext.__exit__ (offload/api.py:357);StepLifecycleMixin.end_layer (offload/engine/lifecycle.py:337) 8",
        "<module> (loop.py:1);<module> (offload/__init__.py:1);_compile_bytecode (<frozen>:1) 10",
        "",
    ]
    split = host_profile.split_samples(lines)
    assert split["samples"] == 100 and split["engine_samples"] == 30 and split["engine_share"] == 0.3
    # The model code the benchmarks import from the package is not the engine.
    assert dict(split["by_entry"]) == {"hook<pack_common>": 0.12, "import offload (start-up)": 0.1, "OffloadContext.__exit__": 0.08}
    assert dict(split["by_leaf"]) == {"HostArena.claim": 0.12, "_compile_bytecode": 0.1, "StepLifecycleMixin.end_layer": 0.08}


def test_host_profile_samples_compares_variants_frame_by_frame() -> None:
    # Inclusive counts (a frame once a sample, however deep), bare addresses left out (another
    # one in every process), then the difference a step between two variants' splits.
    host_profile = bench_module("host_profile")
    engine = host_profile.split_samples([
        "step (loop.py:9);backward (autograd.py:1);unpack_common (saved_hooks.cpp:300);restore (entry_table.h:9) 30",
        "step (loop.py:9);backward (autograd.py:1);0x7f00aa 10",
        "step (loop.py:9);linear (libtorch_cpu.so) 60",
    ])
    floor = host_profile.split_samples([
        "step (loop.py:9);backward (autograd.py:1);0x7f00bb 20",
        "step (loop.py:9);linear (libtorch_cpu.so) 60",
    ])
    assert engine["inclusive"] == {"step": 100, "backward": 40, "linear": 60, "unpack_common": 30, "restore": 30}
    diff = dict(host_profile.differences(engine, floor, steps=10))
    assert diff == {"unpack_common": 3.0, "restore": 3.0, "backward": 2.0, "step": 2.0, "linear": 0.0}
    assert host_profile.differences(engine, floor, steps=10, top=2)[0][1] == 3.0


FAKE_PY_SPY = """#!{python}
import sys
args = sys.argv[1:]
if args == ["--version"]:
    print("py-spy 0.0-fake")
    raise SystemExit(0)
variant = args[args.index("--worker") + 2]
if variant == "native":
    print("worker crashed")
    raise SystemExit(3)
open(args[args.index("-o") + 1], "w").write(
    "step (loop.py:9);linear (libtorch_cpu.so) 50\\n"
    "step (loop.py:9);hook<pack_common> (saved_hooks.cpp:1);restore (entry_table.h:9) " + ("10" if variant == "plain" else "40") + "\\n")
"""


def test_host_profile_samples_keeps_what_finished_when_a_variant_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A worker that fails is reported and skipped; the others are compared with the first, and
    # the JSON is written after each variant (a device call cut short keeps what it has).
    host_profile = bench_module("host_profile")
    fake = tmp_path / "py-spy"
    fake.write_text(FAKE_PY_SPY.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setattr(host_profile.shutil, "which", lambda name: str(fake))
    written: list[dict[str, Any]] = []
    monkeypatch.setattr(host_profile.common, "write_json", lambda name, env, payload, **kw: written.append(json.loads(json.dumps(payload))))
    assert host_profile.sample_main(["--cpu-smoke", "--variants", "plain,native,python"]) == 1
    assert len(written) == 2  # after plain, and after python; none after the failed one
    variants = written[-1]["variants"]
    assert "worker crashed" in variants["native"]["error"]
    assert variants["plain"]["engine_samples"] == 10 and variants["python"]["engine_samples"] == 40
    assert dict(variants["python"]["minus_plain"])["restore"] == 30 / 3  # 3 smoke steps


def test_host_profile_samples_without_py_spy_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    host_profile = bench_module("host_profile")
    monkeypatch.setattr(host_profile.shutil, "which", lambda name: None)
    assert host_profile.sample_main(["--cpu-smoke"]) == 2
    assert "needs py-spy on the PATH: pip install py-spy" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        host_profile.sample_main(["--variants", "plain,fast"])


def test_host_cost_variants_keeps_the_named_ones_and_refuses_unknown_labels() -> None:
    host_cost = bench_module("host_cost")
    spec = SimpleNamespace(layers=4)
    assert [label for label, _ in host_cost.variants(spec, ["hooks floor", "offload (Python hooks)"])] == [
        "plain", "offload (Python hooks)", "hooks floor"]
    assert host_cost.variants(spec, ["offload (Python hooks)"])[1][1]["python_hooks"] is True
    assert len(host_cost.variants(spec)) == 10
    floor_c = host_cost.variants(spec, ["hooks floor (C)"])[1][1]["layer_calls"][0]
    assert floor_c._hooks.pack_hook is floor_c._hooks.unpack_hook is torch.Tensor.detach  # no Python frame
    with pytest.raises(SystemExit, match=r"no variant \['fast'\]; the variants are"):
        host_cost.variants(spec, ["plain", "fast"])


def test_host_cost_cpu_smoke_runs_moe_on_request() -> None:
    result = run_smoke("host_cost.py", "host_cost_moe_pytest", "--rounds", "1", "--workload", "moe")
    assert result["workload"].startswith("MOE")
    summary = {row["variant"]: row for row in result["summary"]}
    assert "error" not in str(result["rounds"]), result["rounds"]
    assert summary["offload group_bytes=0 (off)"]["groups"][0] > summary["offload (default)"]["groups"][0] >= 1


def test_in_step_parts_with_the_native_hooks_time_the_copy_and_the_release_apart() -> None:
    common, engine_parts, workloads = (bench_module(m) for m in ("common", "engine_parts", "workloads"))
    import argparse

    env = common.Env(device=torch.device("cpu"), smoke=True, offload_device="cpu",
                     args=argparse.Namespace(no_json=True, name=None))
    spec = workloads.small(workloads.scale_for(True))
    layers, make_input = spec.build(env.device)
    rows = {native: engine_parts.measure_in_step(env, layers, make_input(), num_layers=spec.layers - 1, steps=2, warmup=1,
                                                 options={"min_offload_bytes": 0, "group_bytes": 0}, native_hooks=native)
            for native in (True, False)}
    groups = spec.layers - 1  # group_bytes=0: every offloaded layer copies and releases its own group
    for native, row in rows.items():
        assert row["offload_calls_step"] == groups and row["release_calls_step"] == groups, (native, row)
        assert 0 < row["offload_us_step"] < row["exit_us_step"] + row["entry_us_step"], row  # timed inside them
        assert row["groups_offloaded"] == groups and row["per_group_us"] > 0
    # The native hooks are left alone: no Python pack or unpack to time, so no per-tensor figure.
    assert rows[True]["pack_us_step"] is None and rows[True]["per_tensor_us"] is None
    assert rows[False]["pack_calls_step"] > 0 and rows[False]["per_tensor_us"] > 0
    # The inside parts are never added to the totals (they are already in entry and exit).
    parts = sum(rows[False][f"{p}_us_step"] for p in engine_parts.IN_STEP_PARTS)
    assert rows[False]["parts_us_step"] == pytest.approx(parts)
