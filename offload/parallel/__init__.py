"""Longer than one GPU: context parallelism (PyTorch's ring attention over SDPA) with FSDP2 on a
(dp, cp) mesh, composed with offload's plans and its tiled head and loss. Each module one job:

- :mod:`.mesh`: :func:`make_mesh` (the dp, cp and flattened FSDP meshes, torchtitan's layout).
- :mod:`.batch`: an HF batch made ready before sharding (labels shifted over the whole
  sequence, global positions, the global label count, the checks).
- :mod:`.context`: :func:`context_parallel`, the ``with`` that shards one batch with torch's
  ``context_parallel`` and gives this rank's :class:`Shard`.
- :mod:`.loss`: the loss normalisation and gradient scale, :func:`global_loss` for logging.
- :mod:`.refuse`: what does not compose yet (pipeline stages, CUDA graphs, FP8).

A step, under ``torchrun --nproc-per-node 2``::

    meshes = offload.parallel.make_mesh(cp=2)
    for layer in model.model.layers:
        fully_shard(layer, mesh=meshes.fsdp)
    fully_shard(model, mesh=meshes.fsdp)
    oa = offload.OffloadActivations(model.model.layers, model=model)
    with offload.parallel.context_parallel(meshes.cp, batch, model=model) as shard:
        with oa:
            loss = model(**shard.inputs).loss
        (loss * shard.loss_scale).backward()
    print(offload.parallel.global_loss(loss, meshes.cp, meshes.dp))

The CPU runs all of it but the ring itself: on more than one rank, torch's ring attention needs
the CUDA SDPA kernels.
"""

from __future__ import annotations

from .batch import padded_length
from .context import Shard, context_parallel
from .loss import global_loss
from .mesh import Meshes, make_mesh

__all__ = ["Meshes", "Shard", "context_parallel", "global_loss", "make_mesh", "padded_length"]
