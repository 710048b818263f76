"""The multi-process scenarios on two GPUs with NCCL, launched by torchrun (marked ``distributed``
and ``cuda``: ``pytest -m distributed`` on a machine with two GPUs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

RUN = Path(__file__).resolve().parent / "run.py"

pytestmark = [pytest.mark.distributed, pytest.mark.cuda]


def test_every_scenario_under_torchrun_on_two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(RUN)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    print(done.stdout)
    assert done.returncode == 0, f"torchrun failed ({done.returncode}):\n{done.stdout[-8000:]}\n{done.stderr[-8000:]}"
