"""The multi-process scenarios of ``dist_scenarios`` on two gloo processes (CPU, ``device="cpu"``),
so CI runs them: DDP, FSDP2 and a 1F1B pipeline, each with TransformerEngine's call shape and
with ``OffloadActivations``, bitwise against the same run without offload, parameters never
copied, each DDP rank's default host budget its share of the node. The same scenarios run on two
GPUs with NCCL through ``test_torchrun_gpu.py`` (or ``torchrun`` directly)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch.distributed as dist

from dist_scenarios import SCENARIOS, gloo_worker, problems
from spawn import free_port, run_ranks

WORLD = 2
DEADLINE_S = 240.0

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo is not available"
)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every scenario, run once by two spawned gloo processes; one dict per rank."""
    out = tmp_path_factory.mktemp("gloo")
    run_ranks(gloo_worker, (WORLD, free_port(), str(out), list(SCENARIOS)), WORLD, DEADLINE_S)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_on_two_gloo_ranks(results: list[dict[str, Any]], name: str) -> None:
    found = problems(name, [r[name] for r in results], local_world=WORLD)
    assert not found, "\n".join(found)
