"""offload.plot: record a real step on the CPU into a Timeline and a MemoryCurve, and draw them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import offload
from offload.models import run_layers
from offload.plot import COMPUTE, D2H, H2D, Interval, MemoryCurve, ParetoPoint, Timeline, record_step

from _util import make_gpt_layers


def _recorded(enabled: bool):
    layers = make_gpt_layers(3, hidden=64)
    x = torch.randn(2, 32, 64, requires_grad=True)
    oa = offload.OffloadActivations(layers, device="cpu", min_offload_bytes=0, group_bytes=0, enabled=enabled)

    def step() -> None:
        with oa:
            out = run_layers(layers, x)
        out.sum().backward()

    step()  # warm-up: the first step allocates the arena
    return record_step(step, offloader=oa, layers=layers)


@pytest.fixture(scope="module")
def offloaded():
    return _recorded(True)


def test_timeline_has_copies_out_and_back_when_offload_ran(offloaded) -> None:
    t = offloaded.timeline
    assert t.device == "cpu"
    # All but the last of 3 layers are offloaded: one group each, copied out and back.
    assert len(t.lane(D2H)) == 2, f"expected a copy out per offloaded layer, got {t.lane(D2H)}"
    assert len(t.lane(H2D)) == 2, f"expected a copy back per offloaded layer, got {t.lane(H2D)}"
    for bar in t.lane(D2H) + t.lane(H2D):
        assert 0 <= bar.start_ms <= bar.end_ms <= t.step_ms, f"{bar} lies outside the step (0..{t.step_ms} ms)"
    # Copies out happen during the forward, copies back during the backward.
    assert max(b.end_ms for b in t.lane(D2H)) <= min(b.start_ms for b in t.lane(H2D))


def test_compute_lane_names_each_layer_forward(offloaded) -> None:
    t = offloaded.timeline
    labels = {bar.label for bar in t.lane(COMPUTE)}
    assert {"L0", "L1", "L2"} <= labels, f"layer forwards missing from the compute lane: {labels}"
    first = {lab: min(b.start_ms for b in t.lane(COMPUTE) if b.label == lab) for lab in ("L0", "L1", "L2")}
    assert first["L0"] < first["L1"] < first["L2"], f"layers out of order: {first}"
    # Layer 0's copy out starts after its own forward began.
    assert t.lane(D2H)[0].start_ms > first["L0"]


def test_memory_curve_follows_the_step(offloaded) -> None:
    curve = offloaded.memory
    assert curve.device == "cpu" and curve.start_bytes == 0
    times = [s[0] for s in curve.samples]
    assert times == sorted(times)
    assert curve.peak_bytes > 0, "no host allocation seen in a step that builds activations"
    assert abs(times[-1] - offloaded.timeline.step_ms) < 1e-6


def test_no_copies_when_offload_is_disabled() -> None:
    t = _recorded(False).timeline
    assert not t.lane(D2H) and not t.lane(H2D), f"copies drawn for a step that offloaded nothing: {t.lanes}"
    assert t.lane(COMPUTE), "the compute lane is empty"


def test_renders_three_pngs(offloaded, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from offload.plot import plot_memory, plot_pareto, plot_timeline

    points = {"tiny": [ParetoPoint("plain", 10 << 30, 1.0), ParetoPoint("plan @ lowest", 6 << 30, 1.2, kind="plan")]}
    written = [
        plot_timeline(offloaded.timeline, tmp_path / "timeline.png"),
        plot_memory(offloaded.memory, tmp_path / "memory.png"),
        plot_pareto(points, tmp_path / "pareto.png"),
    ]
    for path in written:
        assert path.exists() and path.stat().st_size > 1000, f"{path} missing or empty"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"


def test_renderers_refuse_empty_data(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from offload.plot import plot_memory, plot_pareto, plot_timeline

    with pytest.raises(ValueError, match="no lanes"):
        plot_timeline(Timeline(step_ms=1.0, device="cpu"), tmp_path / "t.png")
    with pytest.raises(ValueError, match="no samples"):
        plot_memory(MemoryCurve(device="cpu", what="x"), tmp_path / "m.png")
    with pytest.raises(ValueError, match="no points"):
        plot_pareto({"empty": []}, tmp_path / "p.png")


@pytest.mark.parametrize("renderer", ["plot_timeline", "plot_memory", "plot_pareto"])
def test_renderers_refuse_a_directory_that_does_not_exist(offloaded, tmp_path: Path, renderer: str) -> None:
    # Nothing is created for the caller: a mistyped path used to leave directories behind it.
    import offload.plot as plot

    data = {"plot_timeline": offloaded.timeline, "plot_memory": offloaded.memory,
            "plot_pareto": {"tiny": [ParetoPoint("plain", 1 << 30, 1.0)]}}[renderer]
    missing = tmp_path / "no" / "such"
    with pytest.raises(ValueError, match=f"plot.{renderer}: the directory .* does not exist; create it first"):
        getattr(plot, renderer)(data, missing / "x.png")
    assert not (tmp_path / "no").exists()


def test_record_step_refuses_bad_input() -> None:
    with pytest.raises(TypeError, match="step_fn must be callable"):
        record_step(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="offloader must be"):
        record_step(lambda: None, offloader=object(), device="cpu")


def test_interval_and_timeline_helpers() -> None:
    t = Timeline(step_ms=10.0, device="cpu", lanes={D2H: [Interval("", 1.0, 3.0), Interval("", 5.0, 5.5)]})
    assert t.busy_ms(D2H) == pytest.approx(2.5) and t.lane(H2D) == []


def test_importing_offload_and_its_plot_data_needs_no_matplotlib() -> None:
    # A fresh interpreter where matplotlib cannot be imported: offload and offload.plot's data
    # layer import; a renderer raises an ImportError that names the install command.
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "import offload, offload.plot\n"
        "from offload.plot import plot_memory, MemoryCurve\n"
        "try:\n"
        "    plot_memory(MemoryCurve('cpu', 'x', [(0.0, 1)]), 'x.png')\n"
        "except ImportError as e:\n"
        "    assert 'pip install matplotlib' in str(e), e\n"
        "    print('ok')\n"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                          env={"PYTHONPATH": str(root), "PATH": ""})
    assert done.stdout.strip() == "ok", done.stderr
