"""The README is a user guide whose code runs: every fenced ```python block is run on the CPU as
pasted (each in a fresh namespace, in a scratch directory); a fragment that cannot run says so on
its first line (``# not run: <reason>``) and is skipped with that reason. The guide's shape is
checked too: its length, the quick start, the entry-point table, the results' host."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
NOT_RUN = re.compile(r"#\s*not run:\s*(\S.*)")


def _blocks() -> list[tuple[str, str]]:
    """(name, code) of each python block: its section heading and line, e.g. 'Quick start (line 36)'."""
    found = []
    for match in re.finditer(r"```python\n(.*?)```", README, flags=re.S):
        line = README.count("\n", 0, match.start()) + 1
        headings = re.findall(r"^#+ (.+)$", README[:match.start()], flags=re.M)
        found.append((f"{headings[-1] if headings else 'top'} (line {line})", match.group(1)))
    return found


BLOCKS = _blocks()


@pytest.mark.parametrize("code", [code for _, code in BLOCKS], ids=[name for name, _ in BLOCKS])
def test_readme_block_runs_on_cpu(code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reason = NOT_RUN.match(code.splitlines()[0])
    if reason:
        pytest.skip(f"marked in the README: {reason.group(1)}")
    if "transformers" in code:
        pytest.importorskip("transformers")
        pytest.importorskip("accelerate")
    monkeypatch.chdir(tmp_path)  # whatever a block writes lands in the scratch directory
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # an offload warning (nothing offloaded...) fails the block
        warnings.filterwarnings("ignore", category=UserWarning, module=r"(transformers|accelerate|torch)\.")
        exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})  # noqa: S102 - our own README


def test_every_block_runs_or_says_why_not() -> None:
    assert len(BLOCKS) >= 5
    marked = [name for name, code in BLOCKS if NOT_RUN.match(code.splitlines()[0])]
    assert len(marked) <= 1, f"most of the README's code should run as pasted; marked: {marked}"


def test_readme_is_a_short_user_guide() -> None:
    lines = README.splitlines()
    assert len(lines) < 250, f"the README is {len(lines)} lines"
    headings = re.findall(r"^## (.+)$", README, flags=re.M)
    assert headings == ["Set-up", "Quick start", "Which entry point", "Results", "More"], headings
    quick = next(code for name, code in BLOCKS if name.startswith("Quick start"))
    assert len(quick.strip().splitlines()) <= 20, "the quick start is over 20 lines"
    first_code = README.index("```python")
    assert README.count("\n", 0, first_code) < 60, "the first code example comes after line 60"


def test_which_entry_point_has_the_five_situations() -> None:
    section = README.split("## Which entry point", 1)[1].split("\n#", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| ") and not r.startswith("| you have")]
    situations = [r.split("|")[1].strip() for r in rows]
    assert situations == ["an HF model", "your own training loop", "TransformerEngine / Megatron code",
                          "torchtune or TRL", "a model that does not fit"], situations


def test_results_name_their_host_and_the_contenders() -> None:
    section = README.split("## Results", 1)[1].split("\n## ", 1)[0]
    assert "H100" in section
    header = next(r for r in section.splitlines() if r.startswith("| workload"))
    for contender in ("plain", "HF checkpointing", "torch selective checkpointing", "save_on_cpu", "offload"):
        assert contender in header, f"the results leave out {contender}"


def test_setup_states_the_test_runtime_and_the_recommended_checkpointing() -> None:
    # The real figure (issue 48: 18.5 minutes on a shared 2-core box against "about 10"), and a
    # quick subset whose files exist.
    assert re.search(r"The tests take \d+ minutes on 2 idle CPU cores \(CI's last run: \d+ s\)", README)
    quick = re.search(r"`python -m pytest -q ((?:tests/\S+\.py ?)+)` checks the core", README)
    assert quick and all((ROOT / name).exists() for name in quick.group(1).split()), "the quick subset"
    assert "activation_checkpointing_enable()" in README
    for figure in ("us a group", "GB/s for `torch.empty", "drifts"):
        assert figure not in README, f"engineering figure {figure!r} belongs in docs/benchmarks.md"


def test_engineering_figures_name_their_host_in_docs() -> None:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    results = text.split("# Results, each with the host it was measured on", 1)[1]
    for section in re.split(r"^## ", results, flags=re.M)[1:]:
        title, body = section.split("\n", 1)
        assert re.search(r"H100|H200|CPU-only|2-core", title + body), f"docs/benchmarks.md '{title}' names no host"
    assert "2,394 ms" in results and "CPU-only development machine" in results  # FP8 host time, with its host


def test_the_demo_writes_into_a_folder_git_ignores() -> None:
    assert "under `offload-demo/`" in README
    assert 'default="offload-demo"' in (ROOT / "offload" / "demo.py").read_text()
    ignored = (ROOT / ".gitignore").read_text().split()
    assert "/offload-demo/" in ignored


def test_the_readme_names_the_error_of_running_beside_the_clone(tmp_path: Path) -> None:
    # `git clone` names the folder `offload`; Python run from the folder holding it takes that
    # folder (the repository's root, no __init__.py) for an empty namespace package, ahead of
    # the installed one. No code of ours runs then, so the README says it, in Python's words.
    import os
    import subprocess
    import sys

    (tmp_path / "offload").symlink_to(ROOT, target_is_directory=True)  # a clone named offload
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import offload; offload.OffloadActivations"
    beside = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert beside.returncode != 0, "the namespace package no longer shadows offload: drop the README's note"
    said = beside.stderr.strip().splitlines()[-1].partition(": ")[2]
    assert said and said in README, f"the README should quote what Python says there: {said!r}"
    inside = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert inside.returncode == 0, inside.stderr[-2000:]


def test_the_functions_the_readme_names_exist() -> None:
    # e.g. `offload.host.native.entries_reason()` (it said `native.entries_reason()`, issue 48).
    import importlib

    names = set(re.findall(r"`(offload(?:\.\w+)+)\(", README))
    assert "offload.host.native.entries_reason" in names
    for dotted in names:
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                target = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        for attr in parts[cut:]:
            assert hasattr(target, attr), f"the README names {dotted}, which does not exist"
            target = getattr(target, attr)
