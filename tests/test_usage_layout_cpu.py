"""docs/usage.md's "Layout" names files and folders that exist (issue 48: it named `engine.py`,
`group.py` and others at the package's top after they had moved into `engine/`, `layers/` and
`host/`), and every module of the package's layers."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "offload"


def _layout() -> str:
    text = (ROOT / "docs" / "usage.md").read_text()
    start = text.index("## Layout\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def test_the_layout_names_files_that_exist() -> None:
    names = re.findall(r"`([\w./]+(?:\.py|/))`", _layout())
    assert len(names) > 30, names
    where = [ROOT, ROOT / "examples", PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__")]
    missing = [n for n in names if not any((base / n.rstrip("/")).exists() for base in where)]
    assert not missing, f"docs/usage.md's Layout names what the tree does not have: {missing}"


def test_the_layout_names_every_module_of_the_core_folders() -> None:
    named = set(re.findall(r"`([\w]+\.py)`", _layout()))
    folders = [PACKAGE, *(PACKAGE / f for f in ("engine", "engine/schedules", "layers", "host", "planner", "forwards"))]
    left = sorted(str(p.relative_to(PACKAGE)) for folder in folders for p in folder.glob("*.py")
                  if p.name != "__init__.py" and p.name not in named)
    assert not left, f"docs/usage.md's Layout leaves out {left}: add each with its job"
