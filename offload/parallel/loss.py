"""The loss of a context-parallel step: its normalisation, its gradient's scale, its value.

Each CP rank's loss is the sum over its own tokens divided by the batch's GLOBAL count of label
tokens (``num_items_in_batch``, counted before sharding), so the losses of the ``cp`` ranks of a
batch add up to the one-device loss of that batch, and so do their gradients.

FSDP2 (and DDP) average the gradients over all their ``dp x cp`` ranks. The gradient wanted is
the average over the ``dp`` batches of each batch's full gradient, the sum over its ``cp``
ranks: ``(1/dp) sum_dp sum_cp g = cp x (1/(dp cp)) sum g``. So the loss each rank
backpropagates is scaled by ``cp`` (:attr:`Shard.loss_scale`), as HF's Trainer scales by the
number of processes when it averages tokens across devices. (Equivalently: leave the loss
as it is and ``set_gradient_divide_factor(dp)`` on every FSDP module.) The value to log is
:func:`global_loss`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["global_loss"]


def global_loss(loss: Tensor, cp_mesh: DeviceMesh, dp_mesh: Optional[DeviceMesh] = None) -> Tensor:
    """The loss of the whole batch, for logging: this rank's ``loss`` (its tokens' sum over the
    global count, unscaled) summed over the ``cp`` ranks, then averaged over ``dp_mesh``'s ranks
    if given. A detached float32 copy; a collective, so every rank of the meshes must call it."""
    value = loss.detach().to(torch.float32).clone()
    if cp_mesh.size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=cp_mesh.get_group())
    if dp_mesh is not None and dp_mesh.size() > 1:
        # SUM then divide: gloo has no AVG.
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=dp_mesh.get_group())
        value /= dp_mesh.size()
    return value
