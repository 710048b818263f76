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
    assert re.search(r"The tests take about \d+ minutes on a 2-core CPU", README)
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
