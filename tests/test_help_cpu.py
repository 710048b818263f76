"""help(offload) shows the API: every public name in the package docstring, one line each, and no
inherited dict or Exception methods; ``import offload`` stays cheap (the FP8 layers, plots and
integrations are imported on first use) and needs neither matplotlib, triton nor transformers."""

from __future__ import annotations

import pydoc
import re
import subprocess
import sys
from pathlib import Path

import offload

ROOT = Path(__file__).resolve().parents[1]


def _help() -> str:
    return pydoc.render_doc(offload, renderer=pydoc.plaintext)


def test_all_has_every_entry_point_and_each_resolves() -> None:
    for name in ("fp8", "plot", "plan", "BudgetError", "selective_recompute", "integrations", "StepStats", "CaptureError",
                 "tiling"):
        assert name in offload.__all__, f"{name} is not in offload.__all__"
    for name in offload.__all__:
        assert getattr(offload, name) is not None


def test_the_package_docstring_lists_every_public_name() -> None:
    doc = offload.__doc__ or ""
    missing = [name for name in offload.__all__ if not re.search(rf"\b{re.escape(name)}\b", doc)]
    assert not missing, f"the package docstring leaves out {missing}"


def test_help_fits_on_two_screens_of_what_matters() -> None:
    text = _help()
    lines = text.splitlines()
    description = lines[lines.index("DESCRIPTION") + 1:lines.index("PACKAGE CONTENTS")]
    assert len(description) <= 40, f"the API overview takes {len(description)} lines"
    assert "inherited from builtins" not in text, "help(offload) dumps inherited dict/Exception methods"
    assert "class StepStats" not in text and "class CaptureError" not in text and "class BudgetError" not in text
    # 450 after the trim; OffloadActivations.first_steps (issue 50) added three.
    assert len(lines) <= 455, f"help(offload) is {len(lines)} lines (658 before it was trimmed)"
    assert "__getattr__(name" in text and "lazily imported subpackages" in text, \
        "the module __getattr__ shows up in help(offload) without its docstring"


def test_step_stats_documents_every_mode() -> None:
    doc = offload.StepStats.__doc__ or ""
    for mode in ('"v1"', '"v2"', '"planned"', '"auto"', '"disabled"', '" (manual)"'):
        assert mode in doc, f"StepStats does not document the mode {mode}"


def test_import_is_cheap_and_needs_no_optional_package() -> None:
    # A fresh interpreter where matplotlib, triton and transformers cannot be imported.
    code = (
        "import sys\n"
        "for name in ('matplotlib', 'triton', 'transformers', 'accelerate', 'trl'):\n"
        "    sys.modules[name] = None\n"
        "import offload\n"
        "loaded = [m for m in ('offload.fp8', 'offload.plot', 'offload.integrations', 'torch._dynamo') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "from offload import *\n"
        "assert fp8.Linear and plot.Timeline and integrations.offload_trainer and BudgetError\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert done.stdout.strip() == "ok", done.stderr
