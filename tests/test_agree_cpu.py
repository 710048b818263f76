"""``offload.planner.agree``: ranks agree on the step shape they plan for (the largest batch and
length of any rank) and on a ``BudgetError`` (any rank's true is every rank's), over two spawned
gloo processes; without a process group of more than one rank, nothing is communicated."""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent / "distributed"))  # spawn.py
from spawn import free_port, rank_results, run_ranks  # noqa: E402

from offload.planner import agree  # noqa: E402
from offload.planner.agree import agree_flag, agree_max, agree_shape, agree_step, ranks_agree_enabled  # noqa: E402
from offload.planner.shapes import StepShape  # noqa: E402

WORLD = 2
DEADLINE_S = 60.0
SHAPES = (StepShape(2, 100), StepShape(1, 300))  # rank 0's, rank 1's


class _CountingAllReduce:
    """``dist.all_reduce``, counted: how many collectives a call made."""

    def __init__(self) -> None:
        self.calls = 0
        self._real = dist.all_reduce

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self._real(*args, **kwargs)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank: agree on shapes and flags over the default group, then over a group of this
    rank alone (no collective); the results go to ``out_dir/rank<r>.json``."""
    # Loopback for gloo's connections (the host name may resolve to an unreachable interface).
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    result: dict[str, Any] = {}
    try:
        counter = _CountingAllReduce()
        dist.all_reduce = counter  # type: ignore[assignment]  # agree looks it up on the module
        cpu = torch.device("cpu")
        result["enabled"] = ranks_agree_enabled()
        agreed = agree_shape(SHAPES[rank], cpu)
        result["shape"] = [agreed.batch, agreed.length]
        result["shape_calls"] = counter.calls
        # Flags: only rank 1 true, only rank 0 true, none, all.
        result["flags"] = [agree_flag(rank == 1, cpu), agree_flag(rank == 0, cpu), agree_flag(False, cpu),
                           agree_flag(True, cpu)]
        result["flag_calls"] = counter.calls - result["shape_calls"]
        before = counter.calls
        # A planned step: the shape and any rank's out-of-memory flag, in one all-reduce; a probe
        # step's outcome: the element-wise maximum.
        step_shape, ran_out = agree_step(SHAPES[rank], rank == 0, cpu)
        result["step"] = [step_shape.batch, step_shape.length, ran_out]
        result["max"] = agree_max([rank, 3 - rank, 0], cpu)
        result["step_calls"] = counter.calls - before
        # Ranks at different points (rank 0 decides whether a plan fits, rank 1 a step's shape):
        # one clear error on both, not one point's values read as the other's.
        try:
            if rank == 0:
                agree_flag(True, cpu)
            else:
                agree_shape(SHAPES[rank], cpu)
            result["mismatch"] = "no error"
        except RuntimeError as exc:
            result["mismatch"] = str(exc)
        # False: no agreeing at all, whatever the process group.
        before = counter.calls
        result["off"] = [ranks_agree_enabled(False), agree_step(SHAPES[rank], rank == 1, cpu, group=False)[1],
                         agree_max([rank], cpu, group=False), counter.calls - before]
        # A group of one rank: no collective. new_group is itself collective: every rank makes both.
        alone = [dist.new_group([r]) for r in range(world)][rank]
        before = counter.calls
        same = agree_shape(SHAPES[rank], cpu, group=alone)
        result["alone"] = {"enabled": ranks_agree_enabled(alone), "same": same == SHAPES[rank],
                           "flag": agree_flag(rank == 1, cpu, group=alone), "calls": counter.calls - before}
    except Exception:  # noqa: BLE001 - reported to the test
        result["error"] = traceback.format_exc()
    finally:
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()
    # Skip the interpreter's teardown (gloo's threads and static destructors: see
    # dist_scenarios.gloo_worker).
    os._exit(0)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The two ranks' results (spawned once for the module's tests)."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path_factory.mktemp("agree")
    run_ranks(_worker, (WORLD, free_port(), str(out)), WORLD, DEADLINE_S)
    results = rank_results(out, WORLD, errors_fail=True)
    return results


def test_ranks_agree_on_the_largest_batch_and_length(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        assert res["enabled"]
        # Max in each dimension separately: (2, 300) is no rank's own shape.
        assert StepShape(*res["shape"]) == StepShape(2, 300)
        assert res["shape_calls"] == 1  # one all-reduce for both dims


def test_any_rank_true_makes_every_rank_true(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        assert res["flags"] == [True, True, False, True]
        assert res["flag_calls"] == 4


def test_a_step_agrees_its_shape_and_flag_in_one_all_reduce(ranks: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(ranks):
        assert res["step"] == [2, 300, True] and res["max"] == [1, 3, 0]
        assert res["step_calls"] == 2
        assert "different agreement points ('planned step' and 'plan fits')" in res["mismatch"], res["mismatch"]
        assert res["off"] == [False, rank == 1, [rank], 0]  # group=False: each rank's own, no collective


def test_a_group_of_one_rank_communicates_nothing(ranks: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(ranks):
        assert res["alone"] == {"enabled": False, "same": True, "flag": rank == 1, "calls": 0}


def test_without_a_process_group_the_input_comes_back(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not dist.is_initialized()

    def no_collective(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("agree made a collective without a process group")

    monkeypatch.setattr(dist, "all_reduce", no_collective)
    shape = StepShape(3, 77)
    assert not ranks_agree_enabled()
    assert agree_shape(shape, torch.device("cpu")) is shape
    assert agree_flag(True, torch.device("cpu")) is True
    assert agree_flag(False, torch.device("cpu")) is False


@pytest.mark.parametrize("backend, given, expected", [
    ("gloo", "cpu", "cpu"),
    ("gloo", "cuda:1", "cpu"),          # gloo reduces on the host: no wait on the GPU
    ("nccl", "cuda:1", "cuda:1"),       # NCCL needs the CUDA device given
    ("cpu:gloo,cuda:nccl", "cuda:1", "cpu"),  # a group with a host backend reduces there
    ("cuda:nccl", "cuda:1", "cuda:1"),
    ("ucc", "cuda:1", "cuda:1"),        # takes both: the caller's device
    ("mpi", "cpu", "cpu"),
])
def test_the_reduction_runs_where_the_backend_needs(monkeypatch: pytest.MonkeyPatch, backend: str, given: str,
                                                   expected: str) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert agree._reduce_device(torch.device(given), None) == torch.device(expected)
