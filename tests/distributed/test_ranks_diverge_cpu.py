"""Ranks that differ on purpose never hang (issue 48), on 2 and 3 gloo processes, 20 steps per
case: per-rank lengths, one rank forced onto the low-memory probe, one rank's steps failing with a
simulated out-of-memory error (in the probe and in a planned step; no DDP there, see
``diverge``), one rank meeting a new bucket, one rank's base growing past its plans' (it plans
again, every rank with it), and the model form's short probe on one rank's long batch. The cases and what must hold are in ``diverge``'s docstring.

A collective one rank never joins fails within the group's short timeout (the rank records the
error), and the processes are killed past a deadline: the test fails, it never hangs CI.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from spawn import free_port, rank_results, run_ranks

from diverge import CPU_CASES, problems, run_cases, sizes_for

GROUP_TIMEOUT_S = 20.0  # a step of these tiny models takes milliseconds; a missing rank, forever
DEADLINE_S = 240.0

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="torch.distributed with gloo is not available"),
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed"),
]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank: every CPU case; the results to ``out_dir/rank<r>.json``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world),
                      GLOO_SOCKET_IFNAME="lo")  # loopback: the host name may resolve to an unreachable interface
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    torch.use_deterministic_algorithms(True)
    # One thread a process: 2 or 3 ranks share CI's 2 cores, and oversubscribed intra-op threads
    # made a step of these tiny models 30x slower.
    torch.set_num_threads(1)
    results = run_cases(sizes_for(rank, world, torch.device("cpu")), CPU_CASES)
    if not any("error" in r for r in results.values()):
        dist.barrier()  # every DDP reducer is gone while the group lives
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))
    # The results are on disk; a broken group's teardown can wait on its peer, and gloo's threads
    # meet static destructors at the interpreter's exit once in a while (dist_scenarios.gloo_worker).
    os._exit(0)


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every case, run once by ``world`` spawned gloo processes; one dict per rank."""
    world = request.param
    out = tmp_path_factory.mktemp(f"diverge{world}")
    run_ranks(_worker, (world, free_port(), str(out)), world, DEADLINE_S)
    return rank_results(out, world)


@pytest.mark.parametrize("case", CPU_CASES, ids=[c.name for c in CPU_CASES])
def test_ranks_that_diverge_on_purpose_decide_together(results: list[dict[str, Any]], case: Any) -> None:
    s = sizes_for(0, len(results), torch.device("cpu"))
    found = problems(case, [r[case.name] for r in results], s.base, s.batch)
    assert not found, f"{case.name} on {len(results)} ranks:\n" + "\n".join(found)
