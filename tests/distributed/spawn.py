"""Spawning gloo ranks from a test: a free loopback port, and processes joined under a deadline
(killed past it, so a hang fails the test instead of the CI job)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any, Callable

import pytest
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port free on the loopback interface now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker: Callable[..., None], args: tuple[Any, ...], nprocs: int, deadline_s: float) -> None:
    """Run ``worker(rank, *args)`` in ``nprocs`` spawned processes and wait for all of them;
    past ``deadline_s`` they are killed and the test fails, saying that something hung."""
    workers = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="spawn")
    waited = 0.0
    while not workers.join(timeout=2):
        waited += 2
        if waited >= deadline_s:
            for process in workers.processes:
                process.kill()
            pytest.fail(f"the {nprocs} ranks did not finish within {deadline_s:.0f} s: something hung (killed)")


def rank_results(out_dir: Path, world: int, errors_fail: bool = False) -> list[dict[str, Any]]:
    """What each of ``world`` ranks wrote to ``out_dir / f"rank{r}.json"``, in rank order; with
    ``errors_fail``, a rank that recorded an ``"error"`` fails the test with its traceback."""
    results = [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(world)]
    for r, res in enumerate(results):
        assert not errors_fail or "error" not in res, f"rank {r} raised:\n{res['error']}"
    return results
