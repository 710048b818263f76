"""What a newcomer runs first: the demo's CPU path and the examples (the README's code blocks: test_readme_cpu.py)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

import offload
from offload import demo

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="device=None means CUDA where CUDA is present")
def test_offload_activations_on_a_cpu_only_machine_uses_the_host_transport() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    oa = offload.OffloadActivations(list(model))
    assert oa.engine.transport.name == "cpu"


def test_readme_names_no_file_a_clone_lacks() -> None:
    text = (ROOT / "README.md").read_text()
    assert "shared/" not in text, "the README points at shared/, which a clone does not have"
    for path in re.findall(r"`((?:docs|benchmarks|examples|offload)/[\w/.-]+\.(?:py|md|json|png))`", text):
        assert (ROOT / path).exists(), f"the README names {path}, which is not in the repository"


def test_no_source_points_at_project_notes_outside_the_repository() -> None:
    # DESIGN.md and BENCHMARKS.md live outside the repository; docs/ has our short versions.
    # The project's own files only: hidden folders (.git, scratch space) and build output are not.
    top = ("offload", "tests", "benchmarks", "examples", "docs", "csrc")
    files = [p for p in ROOT.rglob("*") if p.suffix in (".py", ".md", ".sh") and "results" not in p.parts
             and p.relative_to(ROOT).parts[0] in top + ("README.md", "setup.py")
             and p.name != "test_examples_cpu.py"]
    for path in files:
        text = path.read_text(errors="replace")
        for name in ("DESIGN.md", "BENCHMARKS.md", "shared/"):
            assert name not in text, f"{path.relative_to(ROOT)} points at {name}, which a clone lacks"


def test_readme_installs_cpu_torch_from_the_public_index() -> None:
    text = (ROOT / "README.md").read_text()
    assert "--index-url https://download.pytorch.org/whl/cpu" in text
    assert "torch==2.13.0` gives the CPU build" not in text


def test_ci_runs_the_readme_test_command() -> None:
    # python -m pip: the pip of the python that runs the tests (on a box whose python is a venv's
    # and whose pip is the system's, a bare pip installs offload, unbuilt, elsewhere).
    command = ("python -m pip install -U setuptools wheel pybind11 && python -m pip install --no-build-isolation "
               "-e '.[test]' && python -m pytest -q")
    assert command in (ROOT / "README.md").read_text()
    assert command.replace("python ", "python3 ") in (ROOT / ".ci" / "run").read_text()


def test_demo_cpu_path_shows_exact_gradients_and_host_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = demo.main(["--device", "cpu", "--steps", "1", "--plot-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "bitwise equal" in out and "DIFFERENT" not in out
    assert "moved to the host arena" in out and "MiB" in out
    for gpu_word in ("GPU memory allocated", "D2H", "H2D", "released from the GPU", "pinned"):
        assert gpu_word not in out, f"the CPU demo says {gpu_word!r}:\n{out}"
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "timeline.png").stat().st_size > 1000
        assert (tmp_path / "memory.png").stat().st_size > 1000


def test_demo_fails_when_gradients_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    # The exit code is the gradient check's: a contender whose gradients differ must fail it.
    real_run = demo.Bench.run

    def corrupt(self, name, expected, **kw):
        row = real_run(self, name, expected, **kw)
        if name != "plain":
            row.same_gradients = False
        return row

    monkeypatch.setattr(demo.Bench, "run", corrupt)
    assert demo.main(["--device", "cpu", "--steps", "1", "--no-plot"]) == 1


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_hf_llama_example_runs_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    example = _load_example("hf_llama")
    assert example.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("gradients bitwise equal to plain: True") == 3, out
    assert "selective_recompute(MLPs) + OffloadActivations: gradients bitwise equal to plain: True" in out
    assert "plan for the lowest peak:" in out and "host copy out" in out


def test_hf_trainer_example_runs_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    example = _load_example("hf_trainer")
    assert example.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "3 optimizer steps: parameters bitwise equal to the plain Trainer's: True" in out, out
    # The tiny model's three offloaded layers share one group (the default group_bytes).
    assert "host copy out" in out and "in 1 group\n" in out, out
