"""A rank that raises mid-step (issue 15, "bad input and faults"), on two gloo processes.

Rank 1's third layer raises inside ``OffloadActivations`` during a DDP forward; rank 0 runs its
step normally and reaches DDP's gradient all-reduce, which rank 1 never joins. What must hold:

* rank 1 gets its own exception, and no saved-tensor hooks are left on its thread: the context
  can run a plain step again afterwards;
* rank 0 fails through ``torch.distributed``'s own timeout error (rank 1 stays alive, so the
  all-reduce waits for the group's timeout), within that timeout plus slack, not by hanging in
  our code, and leaves no hooks either.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from spawn import free_port, run_ranks

WORLD = 2
GROUP_TIMEOUT_S = 8.0
DEADLINE_S = 120.0

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo is not available"
)


class _Boom(RuntimeError):
    """The failure rank 1 injects."""


class _FailingOnRank(torch.nn.Module):
    """A layer that raises on one rank while ``armed``."""

    def __init__(self, width: int, rank: int, failing_rank: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.fails = rank == failing_rank
        self.armed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fails and self.armed:
            raise _Boom("injected failure in the middle of the forward")
        return torch.tanh(self.linear(x))


def _hooks_installed() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(WORLD), GLOO_SOCKET_IFNAME="lo")
    import offload  # noqa: PLC0415 - imported in the spawned process

    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    result: dict[str, Any] = {"rank": rank}
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        [torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh()) for _ in range(2)]
        + [_FailingOnRank(32, rank, failing_rank=1)]
        + [torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh())]
    )
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers))
    oa = offload.OffloadActivations(layers, device="cpu", min_offload_bytes=0)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
    start = time.monotonic()
    try:
        with oa:
            loss = model(x).square().mean()
        loss.backward()
        result["outcome"] = "finished"
    except _Boom as exc:
        result["outcome"] = "own_error"
        result["message"] = str(exc)
    except Exception as exc:  # noqa: BLE001 - what torch.distributed raised is the point
        result["outcome"] = "distributed_error"
        result["error_type"] = type(exc).__name__
        result["message"] = str(exc)[:300]
        result["trace"] = traceback.format_exc()[-1500:]
    result["seconds"] = time.monotonic() - start
    result["hooks_left"] = _hooks_installed()
    if rank == 1:
        # The same context runs a step again (without DDP: the peer has given up on the group).
        layers[2].armed = False
        with oa:
            y = torch.nn.Sequential(*layers)(x).square().mean()
        y.backward()
        result["hooks_left_after_retry"] = _hooks_installed()
        result["retry_grads_finite"] = all(torch.isfinite(p.grad).all().item() for p in layers.parameters())
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    if rank == 1:
        # Stay alive (as a rank handling its error would) until rank 0 is done: rank 0 must then
        # fail by torch.distributed's timeout, not because this process closed its connections.
        peer = Path(out_dir, "rank0.json")
        stop = time.monotonic() + DEADLINE_S / 2
        while not peer.exists() and time.monotonic() < stop:
            time.sleep(0.1)
    # No destroy_process_group: the group is broken on purpose, and tearing it down can wait on
    # the peer. The result is on disk.
    os._exit(0)


def test_a_rank_raising_mid_step_leaves_no_hooks_and_the_peer_fails_through_torch_distributed(tmp_path: Path) -> None:
    run_ranks(_worker, (free_port(), str(tmp_path)), WORLD, DEADLINE_S)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD))

    assert rank1["outcome"] == "own_error", rank1
    assert not rank1["hooks_left"], "the failing rank left saved-tensor hooks behind"
    assert not rank1["hooks_left_after_retry"] and rank1["retry_grads_finite"]

    assert rank0["outcome"] == "distributed_error", rank0
    # The peer stayed alive: the collective waited for the group's timeout, then torch raised.
    assert GROUP_TIMEOUT_S * 0.9 <= rank0["seconds"] < GROUP_TIMEOUT_S + 30.0, f"rank 0 failed after {rank0['seconds']:.1f} s"
    assert not rank0["hooks_left"], "the waiting rank left saved-tensor hooks behind"
