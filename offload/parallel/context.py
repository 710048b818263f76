"""One batch under context parallelism: ``with context_parallel(cp_mesh, batch) as shard:``
gives this rank's shard of the batch, ready for ``model(**shard.inputs)``, inside torch's own
``context_parallel`` (ring attention over SDPA).

What torch does inside the ``with``: it shards the buffers it is given along the sequence, in
place, with its head-tail load balancer (rank r of c holds chunks r and 2c-1-r of 2c; the
causal attention work is then even), and patches SDPA so that each call runs the ring. So the
layout of every sharded tensor here is torch's by construction: the tokens, the shifted labels
and the positions are one set of buffers sharded in one call.

The HF attention-mask trap. With ``attention_mask=None``, transformers' mask preparation reads
``position_ids`` for packed sequences (``find_packed_sequence_indices``: a step other than +1
starts a new document). A load-balanced shard's positions jump (0..k-1, then the tail), so HF
takes the shard for packed documents and builds an explicit block-diagonal mask, which ring
attention cannot take (it runs causal with no mask): the step fails or, where a mask is
accepted, attends only within chunks. An all-ones 2-D ``attention_mask`` at the local length
turns that detection off, and HF's SDPA mask then reduces to ``is_causal=True`` with no mask,
what the ring needs. ``shard.inputs`` carries one.

What else the step needs is on the shard: ``num_items_in_batch`` (the global label count, in
``inputs`` too, so HF's loss and the tiled head divide by it) and ``loss_scale`` (see
``offload.parallel.loss``).

Plans and offload. Nothing here issues a collective (torch shards without communicating: every
CP rank holds the whole batch), so no rank can skip one. An ``OffloadActivations`` inside the
``with`` sees the local shapes: each rank plans its own shard, and the plan decisions are agreed
over its ``plan_group`` (by default every rank of the world, so the whole mesh). The ring's saved
tensors (the K/V it gathered, the logsumexp) are ordinary autograd saved tensors of the
attention: offloaded, kept or recomputed by the plan like any other, their bytes in the probe's.

The kernels the ring runs on. Inside the ``with``, SDPA may choose only the flash and cuDNN
kernels (of those the caller has enabled): the ring's backward over the memory-efficient kernel
gives NaN gradients (torch 2.11, measured on 2 H200s; the loss is right, so nothing else shows
it), and the math kernel has no ring. In deterministic mode
(``torch.use_deterministic_algorithms(True)``) the flash kernel's backward repeats itself bit for
bit, and so does the CP step.

A mesh of one rank shards nothing and leaves SDPA alone: the same script then runs on one GPU,
or on the CPU. On more than one rank, the attention needs the CUDA SDPA kernels: on the CPU,
torch's ring raises ``NotImplementedError`` (no sharding strategy for the CPU's flash kernel).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from .batch import local_attention_mask, prepare_batch
from .refuse import check_attention, check_composes

__all__ = ["Shard", "context_parallel"]


@dataclass
class Shard:
    """This rank's part of a batch (see the module notes).

    ``inputs``: the keyword arguments of the model's call: ``input_ids`` (or ``inputs_embeds``),
    ``labels``, ``shift_labels``, ``position_ids`` (global), an all-ones ``attention_mask``,
    ``num_items_in_batch``, and the batch's other keys unchanged. ``loss_scale``: multiply the
    loss by it before ``backward`` under FSDP2 or DDP over the dp x cp ranks (``cp``).
    """

    inputs: dict[str, Any]
    num_items_in_batch: Tensor
    loss_scale: int
    cp_rank: int
    cp_size: int
    length: int  # global tokens per row
    local_length: int

    @property
    def shift_labels(self) -> Tensor:
        """This rank's targets: token t's next token over the whole sequence (-100: none)."""
        return self.inputs["shift_labels"]

    @property
    def position_ids(self) -> Tensor:
        """The global positions of this rank's tokens."""
        return self.inputs["position_ids"]


def ring_kernels(cp_size: int) -> contextlib.AbstractContextManager[Any]:
    """SDPA restricted to the kernels the ring is sound on (flash, cuDNN; see the module notes),
    of those enabled now; nothing changes on a mesh of one rank."""
    if cp_size == 1:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    enabled = [backend for backend, on in ((SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled()),
                                           (SDPBackend.CUDNN_ATTENTION, torch.backends.cuda.cudnn_sdp_enabled()))
               if on]
    if not enabled:
        raise ValueError(
            "offload.parallel.context_parallel: ring attention needs the flash or cuDNN SDPA kernel, and both are "
            "disabled here (the memory-efficient kernel's ring backward gives NaN gradients, the math kernel has "
            "no ring); enable one, e.g. torch.nn.attention.sdpa_kernel([SDPBackend.FLASH_ATTENTION])"
        )
    return sdpa_kernel(enabled)


def _dim_names(mesh: DeviceMesh) -> tuple[str, ...]:
    """The names of ``mesh``'s dimensions and of its root mesh's (where a ``pp`` would be)."""
    root: Optional[DeviceMesh] = None
    try:
        root = mesh._get_root_mesh()  # torch >= 2.9
    except AttributeError:
        from torch.distributed.device_mesh import _mesh_resources

        root = _mesh_resources.get_root_mesh(mesh)
    return tuple(mesh.mesh_dim_names or ()) + tuple((root.mesh_dim_names or ()) if root is not None else ())


@contextlib.contextmanager
def context_parallel(cp_mesh: DeviceMesh, batch: Mapping[str, Any], *, model: Optional[torch.nn.Module] = None,
                     ignore_index: int = -100) -> Iterator[Shard]:
    """Run the forward (and backward) of ``batch`` on ``cp_mesh``'s ranks, each on its shard of
    the sequence, with ring attention: ``with context_parallel(meshes.cp, batch, model=model)
    as shard: (model(**shard.inputs).loss * shard.loss_scale).backward()``.

    ``cp_mesh``: 1-D, the ranks sharing this batch (``offload.parallel.make_mesh(cp).cp``); each
    must give the same ``batch`` (HF's dict: ``input_ids`` or ``inputs_embeds``, ``labels``;
    optional ``position_ids`` 0..T-1, an all-ones ``attention_mask``, other keys passed on).
    ``model``: checked for what does not compose yet (give it: FP8 and CUDA-graphed layers are
    refused). The caller's batch is not changed. The model must use SDPA attention
    (``attn_implementation="sdpa"``), the one torch patches.

    Raises ``ValueError`` for a length that is not a multiple of ``2 x cp`` (naming the length to
    pad to), a padding mask, packed positions, a batch without labels or a model whose attention is
    not SDPA (on more than one rank), and ``RuntimeError`` for
    pipeline stages, CUDA graphs and FP8 layers (see ``offload.parallel.refuse``).
    """
    check_composes(model, _dim_names(cp_mesh))
    if cp_mesh.ndim != 1:
        raise ValueError(
            f"offload.parallel.context_parallel: cp_mesh must be the 1-D mesh of the context-parallel ranks, got "
            f"{cp_mesh.ndim} dimensions {cp_mesh.mesh_dim_names}; pass make_mesh(cp).cp (or mesh['cp'])"
        )
    cp_size = cp_mesh.size()
    if cp_size > 1:
        check_attention(model)
    prepared = prepare_batch(batch, cp_size, ignore_index)
    buffers = list(prepared.tensors.values())
    if cp_size == 1:
        sharding: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    else:
        from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel

        # no_restore_buffers: they are ours (prepare_batch copied them), nothing to give back.
        sharding = torch_context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                          no_restore_buffers=set(buffers))
    with ring_kernels(cp_size), sharding:
        inputs: dict[str, Any] = dict(prepared.passed)
        inputs.update(prepared.tensors)  # sharded in place by now
        inputs["attention_mask"] = local_attention_mask(prepared, cp_size)
        inputs["num_items_in_batch"] = prepared.num_items_in_batch
        yield Shard(inputs, prepared.num_items_in_batch, cp_size, cp_mesh.get_local_rank(), cp_size,
                    prepared.length, prepared.length // cp_size)
