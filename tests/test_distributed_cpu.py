"""Two processes on the gloo backend (CPU, so CI runs them): DDP with ``OffloadActivations`` gives
the gradients of the same DDP run without offload, bit for bit, on every rank; parameters are
never copied; each rank's default host budget is its share of the node. And a pipeline stage's
1F1B order (several micro-batches in flight) on one process, bitwise."""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


class _Stack(torch.nn.Module):
    """The layers in a row: what DDP wraps (its forward prepares the gradient reduction)."""

    def __init__(self, layers: torch.nn.ModuleList) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _worker(rank: int, port: int, out_dir: str) -> None:
    # Loopback for gloo's own connections: resolving the host name can pick an interface the
    # container cannot reach, and the ranks then wait for each other for good.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(WORLD), GLOO_SOCKET_IFNAME="lo")
    sys.path.insert(0, str(Path(__file__).parent))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        result = _run_rank(rank)
        # Every DDP object is gone (freed when _run_rank returned) while the group still lives:
        # a reducer destroyed after destroy_process_group can wait for good.
        dist.barrier()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    # The result is on disk. Skip the interpreter's teardown: gloo's threads met static
    # destructors there once in a while ("terminate called without an active exception").
    os._exit(0)


def _run_rank(rank: int) -> dict[str, object]:
    import psutil

    import offload
    from _util import make_mlp_layers

    layers = make_mlp_layers(4, width=64)  # same seed on every rank: same weights
    model = torch.nn.parallel.DistributedDataParallel(_Stack(layers))
    torch.manual_seed(100 + rank)  # each rank its own batch
    x = torch.randn(32, 64)

    def step(wrapper: object) -> list[torch.Tensor]:
        for p in model.parameters():
            p.grad = None
        xin = x.detach().requires_grad_(True)
        if wrapper is None:
            out = model(xin)
        else:
            with wrapper:
                out = model(xin)
        (out ** 2).mean().backward()
        return [p.grad.clone() for p in model.parameters()] + [xin.grad.clone()]

    plain = step(None)
    again = step(None)
    oa = offload.OffloadActivations(layers, device="cpu", min_offload_bytes=0)
    offloaded = [step(oa) for _ in range(2)]
    stats = oa.stats
    # The gradients are DDP's averages: equal on both ranks.
    flat = torch.cat([g.flatten() for g in offloaded[-1][:-1]])
    gathered = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(gathered, flat)
    return {
        "repeats": all(torch.equal(a, b) for a, b in zip(plain, again)),
        "bitwise": all(all(torch.equal(a, b) for a, b in zip(plain, got)) for got in offloaded),
        "offloaded": stats["offloaded_tensors"],
        "parameters_kept": stats["kept"].get("parameter", 0),
        "budget_ok": stats["host_budget_bytes"] == int(psutil.virtual_memory().total * 0.75) // WORLD,
        "synced": torch.equal(gathered[0], gathered[1]),
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo is not available")
def test_ddp_two_ranks_on_gloo_bitwise_with_offload(tmp_path: Path) -> None:
    workers = mp.start_processes(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=False, start_method="spawn")
    deadline = 120.0
    while not workers.join(timeout=5):
        deadline -= 5
        if deadline <= 0:
            for process in workers.processes:
                process.kill()
            pytest.fail("the two gloo ranks did not finish within 120 s (killed)")
    for rank in range(WORLD):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["repeats"], f"rank {rank}: the plain DDP step does not repeat itself"
        assert result["bitwise"], f"rank {rank}: gradients with offload differ from without"
        assert result["offloaded"] > 0 and result["parameters_kept"] > 0, result
        assert result["budget_ok"], f"rank {rank}: the default host budget is not its share of the node"
        assert result["synced"], "DDP's averaged gradients differ between the ranks"


# -- pipeline order on one process -------------------------------------------------------------------
ONE_F_ONE_B = [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]


@pytest.mark.parametrize("form", ["te", "oa"])
def test_hand_written_1f1b_order_is_bitwise(form: str) -> None:
    """Several micro-batches in flight (forward mb0, forward mb1, backward mb0, ...), as a
    pipeline stage runs them with 1F1B: each backward reloads its own micro-batch's groups."""
    sys.path.insert(0, str(Path(__file__).parent))
    import offload
    from offload.models import run_layers
    from _util import assert_bitwise, cpu_context, make_mlp_layers

    layers = make_mlp_layers(4, width=64)
    torch.manual_seed(7)
    batches = [torch.randn(16, 64) for _ in range(3)]

    def run(order: list[tuple[str, int]], forward: Any) -> list[torch.Tensor]:
        for p in layers.parameters():
            p.grad = None
        inputs, losses = {}, {}
        for kind, mb in order:
            if kind == "F":
                inputs[mb] = batches[mb].detach().requires_grad_(True)
                losses[mb] = (forward(inputs[mb]) ** 2).mean()
            else:
                losses.pop(mb).backward()
        return [p.grad.clone() for p in layers.parameters()] + [inputs[mb].grad.clone() for mb in sorted(inputs)]

    plain = run(ONE_F_ONE_B, lambda x: run_layers(layers, x))
    assert_bitwise(plain, run(ONE_F_ONE_B, lambda x: run_layers(layers, x)))
    if form == "te":
        ctx, sync = cpu_context(3, 4)
        forward = lambda x: run_layers(layers, x, ctx, sync)  # noqa: E731
        stats = lambda: ctx.stats  # noqa: E731
    else:
        oa = offload.OffloadActivations(layers, device="cpu", min_offload_bytes=0)

        def forward(x: torch.Tensor) -> torch.Tensor:
            with oa:
                return run_layers(layers, x)

        stats = lambda: oa.stats  # noqa: E731
    for _ in range(2):
        assert_bitwise(plain, run(ONE_F_ONE_B, forward))
    assert stats()["offloaded_tensors"] > 0
