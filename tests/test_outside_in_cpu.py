"""What a newcomer meets first, checked from the outside (issue 32): the figures a disabled
context reports, the report's wording, the install's dependencies and the documents' claims
against the code. CPU only."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

import offload
from offload import fp8
from offload.planner.budget import DEVICE_HEADROOM, DEVICE_HEADROOM_EXPANDABLE
from offload.engine.schedules import ScheduleAuto, ScheduleV1, ScheduleV2
from offload.engine.schedules.planned import PlannedSchedule
from offload.engine.stats import StepCounters, StepStats, disabled_stats, format_report, snapshot

from _util import cpu_context, make_gpt_layers, train_step

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 32


def fp8_layers() -> torch.nn.ModuleList:
    """Three Linear+GELU layers turned into FP8 ones by ``fp8.convert``, after one forward (so
    their FP8 weight copies exist)."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH, dtype=torch.bfloat16), torch.nn.GELU()) for _ in range(3)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "converted on the CPU": slow _scaled_mm, fine here
        fp8.convert(layers)
    x = torch.randn(16, WIDTH, dtype=torch.bfloat16)
    with torch.no_grad():
        for layer in layers:
            x = layer(x)
    assert fp8.weight_cache_bytes(layers) > 0, "the converted layers hold no FP8 weight copy after a forward"
    return layers


def _snapshot(transport: str = "cpu", mode: str = "v2", **kw: object) -> StepStats:
    counters = StepCounters(step=1, mode=mode, offloaded_tensors=3, offloaded_bytes=3 << 20, released_bytes=3 << 20,
                            bytes_d2h=3 << 20, bytes_h2d=3 << 20, reloads=1, finished=True)
    # One timed copy each way (host-clock marks as the cpu transport records them).
    counters.copies += [("d2h", 3 << 20, _Mark(0.0), _Mark(1e-3)), ("h2d", 3 << 20, _Mark(0.0), _Mark(1e-3))]
    return snapshot(counters, pinned_bytes_held=4 << 20, native=True, transport=transport,
                    host_budget_bytes=1 << 30, host_budget_source="host_budget_bytes", **kw)  # type: ignore[arg-type]


class _Mark:
    """A timing mark at a fixed time (seconds), as ``transport.WallMark`` measures."""

    def __init__(self, t: float) -> None:
        self.t = t

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def elapsed_time(self, end: "_Mark") -> float:
        """Milliseconds to ``end``."""
        return (end.t - self.t) * 1e3


def _row(text: str, label: str) -> str:
    """The value of the report's row ``label``."""
    for line in text.splitlines():
        if line.startswith(label + "  ") or line.startswith(label + " "):
            return line[len(label):].strip()
    raise AssertionError(f"the report has no {label!r} row:\n{text}")


# -- defect 11: a disabled context reports the FP8 weight copies ---------------------------------
def test_disabled_stats_count_the_fp8_weight_copies_of_the_given_modules() -> None:
    layers = fp8_layers()
    held = fp8.weight_cache_bytes(layers)
    assert disabled_stats()["weight_cache_bytes"] is None, "no modules given: the figure is None, as when enabled"
    assert disabled_stats(layers)["weight_cache_bytes"] == held
    assert disabled_stats(list(layers))["weight_cache_bytes"] == held
    assert disabled_stats(m for m in layers)["weight_cache_bytes"] == held  # a generator, as params_from may be
    assert disabled_stats(layers[0])["weight_cache_bytes"] == fp8.weight_cache_bytes(layers[0])  # one module
    plain = make_gpt_layers(2)
    assert disabled_stats(plain)["weight_cache_bytes"] == 0  # modules without FP8 layers: 0, not None
    s = disabled_stats(layers)
    assert s["mode"] == "disabled" and s["offloaded_bytes"] == 0 and s["transport"] == "none"


def test_disabled_offload_activations_reports_what_an_enabled_one_does() -> None:
    layers = fp8_layers()
    enabled = offload.OffloadActivations(layers, device="cpu").stats["weight_cache_bytes"]
    disabled = offload.OffloadActivations(layers, enabled=False).stats["weight_cache_bytes"]
    assert enabled == fp8.weight_cache_bytes(layers) > 0
    assert disabled == enabled, (
        f"OffloadActivations(layers, enabled=False).stats['weight_cache_bytes'] is {disabled!r}, but the "
        f"layers' FP8 weight copies hold {enabled} bytes whether offloading is on or off"
    )


def test_disabled_layer_context_reports_the_weight_copies_of_params_from() -> None:
    layers = fp8_layers()
    ctx, _ = offload.get_cpu_offload_context(False, params_from=layers)
    on, _ = cpu_context(2, 3, params_from=layers)
    assert ctx.stats["weight_cache_bytes"] == on.stats["weight_cache_bytes"] == fp8.weight_cache_bytes(layers), (
        "get_cpu_offload_context(False, params_from=layers).stats['weight_cache_bytes'] should be the "
        f"layers' FP8 weight copies ({fp8.weight_cache_bytes(layers)} bytes), got {ctx.stats['weight_cache_bytes']!r}"
    )
    bare, _ = offload.get_cpu_offload_context(False)
    assert bare.stats["weight_cache_bytes"] is None


# -- the report says what its first lines mean ------------------------------------------------------
@pytest.mark.parametrize("mode", [ScheduleV2.name, ScheduleV1.name, PlannedSchedule.name, ScheduleAuto.name,
                                  "v2 (manual)", "v1 (manual)", "disabled"])
def test_report_explains_the_schedule(mode: str) -> None:
    text = format_report(_snapshot(mode=mode))
    assert "mode / transport" not in text
    row = _row(text, "schedule")
    base = mode.split(" ")[0]
    assert row.startswith(f"{base} (") and len(row) > len(base) + 12, f"schedule {mode!r} is not explained: {row!r}"
    if "manual" in mode:
        assert "manual_synchronization=True" in row, row


@pytest.mark.parametrize("transport,words", [("cpu", 'host-to-host copies, device="cpu"'),
                                             ("cuda", "side-stream copies to pinned host memory")],
                         ids=["host-transport", "gpu-transport"])
def test_report_explains_the_transport(transport: str, words: str) -> None:
    row = _row(format_report(_snapshot(transport)), "transport")
    assert row.startswith(f"{transport} (") and words in row and "native" in row, row


def test_report_of_a_real_host_step_names_schedule_and_transport() -> None:
    layers = make_gpt_layers(3)
    ctx, sync = cpu_context(2, 3)
    train_step(layers, torch.randn(2, 16, 64), ctx, sync)
    text = ctx.report()
    assert _row(text, "schedule").startswith("v2 (offloaded layers copied out as they end")
    assert _row(text, "transport").startswith('cpu (host-to-host copies, device="cpu"')


# -- FP8 weight copies: a line only when there is a figure -----------------------------------------
# The ids avoid "cuda": conftest skips every test with that keyword where CUDA is absent, and
# these need none.
@pytest.mark.parametrize("transport", ["cpu", "cuda"], ids=["host-transport", "gpu-transport"])
def test_report_shows_fp8_weight_copies_only_when_they_hold_memory(transport: str) -> None:
    for figure in (None, 0):
        text = format_report(_snapshot(transport, weight_cache_bytes=figure))
        assert "FP8 weight copies" not in text, f"weight_cache_bytes={figure!r} still shows the FP8 line:\n{text}"
    text = format_report(_snapshot(transport, weight_cache_bytes=2056))
    assert _row(text, "FP8 weight copies").startswith("2.0 KiB"), text


def test_report_of_a_model_without_fp8_has_no_fp8_line() -> None:
    layers = make_gpt_layers(3)
    oa = offload.OffloadActivations(layers, device="cpu", min_offload_bytes=0)
    with oa:
        out = layers[2](layers[1](layers[0](torch.randn(2, 16, 64, requires_grad=True))))
    out.float().pow(2).mean().backward()
    assert oa.stats["weight_cache_bytes"] == 0
    assert "FP8 weight copies" not in oa.report()
    oa.close()


# -- the host transport's copy back shows no rate that is not a copy rate ------------------------
def test_host_report_shows_no_copy_back_rate() -> None:
    text = format_report(_snapshot("cpu"))
    back = _row(text, "host copy back")
    assert "GB/s" not in back.replace("no GB/s", ""), f"the host copy back shows a rate: {back!r}"
    assert "page faults" in back, f"the host copy back does not say why it has no rate: {back!r}"
    assert "GB/s" in _row(text, "host copy out")  # the copy out into the reused arena region keeps its rate


def test_cuda_report_keeps_the_h2d_rate() -> None:
    back = _row(format_report(_snapshot("cuda")), "H2D")
    assert "3.1 GB/s" in back and "page faults" not in back, back


def test_real_host_step_report_has_no_copy_back_rate() -> None:
    layers = make_gpt_layers(3)
    ctx, sync = cpu_context(2, 3)
    train_step(layers, torch.randn(2, 16, 64), ctx, sync)
    back = _row(ctx.report(), "host copy back")
    assert ctx.stats["timed_bytes_h2d"] > 0 and re.search(r" in \d+\.\d\d ms", back), back
    assert "GB/s" not in back.replace("no GB/s", ""), back


# -- the install and the documents against the code ------------------------------------------------
def test_numpy_is_a_dependency() -> None:
    # `import torch` itself warns "Failed to initialize NumPy" where numpy is missing (torch's
    # wheels do not require it): a plain `pip install -e .` must bring it.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0].lower() for d in project["dependencies"]]
    assert "numpy" in names, f"pyproject.toml's dependencies {project['dependencies']} leave out numpy"


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_readme_states_the_device_headroom_the_code_leaves() -> None:
    readme = _one_line((ROOT / "README.md").read_text())
    # "device" turns expandable segments on unless the process configured them (planner/make.py).
    said = re.findall(r"less (\d+)% headroom", readme)
    assert said == [f"{DEVICE_HEADROOM_EXPANDABLE * 100:.0f}"], (
        f"the README says the \"device\" budget leaves {said}% headroom; planner/budget.py leaves "
        f"{DEVICE_HEADROOM_EXPANDABLE:.0%} with expandable segments"
    )
    assert f"{DEVICE_HEADROOM:.0%} without them" in readme


def test_docs_do_not_call_the_fused_norm_kernel_missing() -> None:
    assert (ROOT / "offload" / "fp8" / "triton_norm.py").exists() and (ROOT / "offload" / "fp8" / "triton_swiglu.py").exists()
    for path in sorted((ROOT / "docs").glob("*.md")):
        text = _one_line(path.read_text())
        assert "no fused norm kernel" not in text, f"{path.name} says there is no fused norm kernel"


def test_every_results_json_quoted_is_committed_or_said_missing() -> None:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    results = ROOT / "benchmarks" / "results"
    for name in sorted(set(re.findall(r"`([a-z0-9_]+\.json)`", text))):
        if (results / name).exists():
            continue
        stem = name[: -len(".json")]
        sections = [s for s in re.split(r"^## ", text, flags=re.M) if name in s]
        assert any("not committed" in _one_line(s) and f"benchmarks/results/{name}" in s for s in sections), (
            f"docs/benchmarks.md quotes {name}, which is not in benchmarks/results/, without saying it "
            f"was not committed and where the next run of the script writes it ({stem})"
        )
