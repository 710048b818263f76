"""Context parallelism on a 2-D mesh (``offload.parallel.make_mesh(cp=2)`` over 4 gloo processes:
dp = 2 slices, each of 2 CP ranks), what the CPU can run of it: the layout of the meshes, each dp
slice sharding its own batch, and the loss and gradient of the step. FSDP2 shards the head over
all four ranks and averages its gradient over them; with ``loss_scale`` the gradient must be the
mean over the two batches of each batch's one-process gradient, and ``global_loss`` the mean of
their losses. (``test_context_parallel_cpu.py`` covers one slice of 2 CP ranks.)
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from spawn import free_port, rank_results, run_ranks

import offload

WORLD, CP = 4, 2
GROUP_TIMEOUT_S = 10.0
DEADLINE_S = 120.0
B, T, H, V = 2, 16, 16, 50

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="torch.distributed with gloo is not available"),
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed"),
]


def _batch(dp_rank: int) -> dict[str, torch.Tensor]:
    """The batch of one dp slice (each slice its own tokens and hidden states)."""
    g = torch.Generator().manual_seed(10 + dp_rank)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, 2 + dp_rank] = -100  # the slices count different numbers of targets
    return {"inputs_embeds": torch.randn(B, T, H, generator=g), "labels": labels}


def _head() -> torch.nn.Linear:
    torch.manual_seed(1)
    return torch.nn.Linear(H, V, bias=False)


class _HeadLoss(torch.nn.Module):
    """The tiled head and loss as a module, for FSDP2 to shard."""

    def __init__(self) -> None:
        super().__init__()
        self.head = _head()

    def forward(self, hidden: torch.Tensor, **shard: Any) -> torch.Tensor:
        return offload.tiling.causal_lm_loss(hidden, self.head, None, chunk_tokens=5, **shard)


def _one_process(dp_rank: int) -> tuple[float, torch.Tensor]:
    """One dp slice's batch on one process: its mean loss and its head's gradient."""
    head = _head()
    batch = _batch(dp_rank)
    loss = offload.tiling.causal_lm_loss(batch["inputs_embeds"], head, batch["labels"], chunk_tokens=5)
    loss.backward()
    return loss.item(), head.weight.grad


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world),
                      GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    result: dict[str, Any] = {}
    try:
        from torch.distributed.fsdp import fully_shard

        meshes = offload.parallel.make_mesh(cp=CP, device_type="cpu")
        dp_rank, cp_rank = meshes.dp.get_local_rank(), meshes.cp.get_local_rank()
        model = _HeadLoss()
        fully_shard(model, mesh=meshes.fsdp)
        with offload.parallel.context_parallel(meshes.cp, _batch(dp_rank)) as shard:
            loss = model(shard.inputs["inputs_embeds"], shift_labels=shard.shift_labels,
                         num_items_in_batch=shard.num_items_in_batch)
            (loss * shard.loss_scale).backward()
            local_tokens = shard.local_length
        logged = offload.parallel.global_loss(loss, meshes.cp, meshes.dp).item()
        grad = model.head.weight.grad.full_tensor()
        refs = [_one_process(d) for d in range(world // CP)]
        want_grad = sum(g for _, g in refs) / len(refs)
        result = {"dp": dp_rank, "cp": cp_rank, "local_tokens": local_tokens, "scale": shard.loss_scale,
                  "logged": logged, "want_logged": sum(v for v, _ in refs) / len(refs),
                  "grad_close": bool(torch.allclose(grad, want_grad, rtol=1e-5, atol=1e-7)),
                  "grad_ratio": (grad.norm() / want_grad.norm()).item()}
    except Exception:  # noqa: BLE001 - reported to the test
        result = {"error": traceback.format_exc(limit=6)}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo's threads meet static destructors at exit once in a while


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each of the 4 ranks saw."""
    out = tmp_path_factory.mktemp("cp2d")
    run_ranks(_worker, (WORLD, free_port(), str(out)), WORLD, DEADLINE_S)
    results = rank_results(out, WORLD, errors_fail=True)
    return results


def test_the_mesh_is_dp_slices_of_cp_ranks(ranks: list[dict[str, Any]]) -> None:
    # torchtitan's layout: ranks 0,1 share dp slice 0, ranks 2,3 slice 1; each holds half a sequence.
    assert [(r["dp"], r["cp"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["local_tokens"] == T // CP and r["scale"] == CP for r in ranks)


def test_the_gradient_is_the_mean_of_the_batches_one_process_gradients(ranks: list[dict[str, Any]]) -> None:
    # FSDP2 averages over dp x cp = 4 ranks; loss_scale = cp makes that the mean over the dp batches
    # of each batch's whole gradient (a scale of 1 would give half of it: the ratio says which).
    assert all(r["grad_close"] for r in ranks), [r["grad_ratio"] for r in ranks]


def test_the_logged_loss_is_the_mean_of_the_batches_losses(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["logged"] == pytest.approx(r["want_logged"], rel=1e-6)
