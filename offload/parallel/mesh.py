"""The 2-D device mesh context parallelism runs on: data x context, as torchtitan lays it out.

``dp`` ranks read different batches; the ``cp`` ranks of one ``dp`` slice share a batch and
each holds one shard of its sequence. FSDP2 shards the parameters over every rank, the
flattened ``dp x cp`` mesh (torchtitan's ``dp_shard_cp``): context parallelism is data
parallelism for the parameters, only the batch is cut along another axis.

The flattened mesh is returned apart, not sliced back out of the root mesh each time: torch
deprecates slicing a flattened dimension from the root ("users need to bookkeep the flattened
mesh directly").
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["Meshes", "make_mesh"]

WHERE = "offload.parallel.make_mesh"


class Meshes(NamedTuple):
    """The meshes of one (dp, cp) layout: ``cp`` for ``context_parallel``, ``dp`` the
    data-parallel ranks, ``fsdp`` (dp x cp flattened) for ``fully_shard``, ``root`` the 2-D one."""

    root: DeviceMesh
    dp: DeviceMesh
    cp: DeviceMesh
    fsdp: DeviceMesh


def make_mesh(cp: int, device_type: Optional[str] = None) -> Meshes:
    """The (dp, cp) meshes over every rank, ``dp = world_size // cp``.

    ``device_type``: "cuda" where CUDA is available, else "cpu". Without a process group, one is
    made: from torchrun's environment (``RANK``, ``WORLD_SIZE``) if set, with NCCL for CUDA and
    gloo for the host (``"cpu:gloo,cuda:nccl"``, so the planner's small agreements reduce on the
    host, see ``offload.planner.agree``); else a group of this one process (an in-memory store),
    so that the same script runs unchanged on one device. Raises ``ValueError`` if ``cp`` does not
    divide the world size.
    """
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"{WHERE}: cp must be an int >= 1 (ranks per sequence), got {cp!r}")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if not dist.is_initialized():
        _init_group(device_type)
    world = dist.get_world_size()
    if world % cp:
        raise ValueError(
            f"{WHERE}: cp={cp} does not divide the {world} ranks; launch a multiple of {cp} processes "
            f"(torchrun --nproc-per-node), or pick cp among the divisors of {world}"
        )
    root = init_device_mesh(device_type, (world // cp, cp), mesh_dim_names=("dp", "cp"))
    fsdp = root["dp", "cp"]._flatten("dp_cp")
    return Meshes(root, root["dp"], root["cp"], fsdp)


def _init_group(device_type: str) -> None:
    backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
