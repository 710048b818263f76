"""The one selection policy: which saved tensors leave the GPU.

Every schedule (v1, v2, manual) asks :meth:`SelectionPolicy.decide`, so a do-not-offload mark is
honored by construction rather than by a check repeated in each schedule. ``decide`` runs inside
the pack hook once per saved tensor, so it reads a handful of cheap attributes, cheapest and most
decisive first, and allocates nothing.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .marks import KEEP_ATTR, OFFLOAD_ATTR, TE_KEEP_ATTR

# Reasons a tensor stays where it is. They are the keys of ``stats["kept"]``.
KEEP_LAYER = "layer"            # not saved inside a layer the schedule offloads
KEEP_PARAMETER = "parameter"    # a parameter (leaf that requires grad) or a view of one
KEEP_MARKED = "marked"          # mark_not_offload (ours or TransformerEngine's tag)
KEEP_NOT_SELECTED = "not_selected"  # opt-in selection (v1) and no mark_activation_offload
KEEP_SMALL = "small"            # fewer bytes than min_offload_bytes (empty tensors too)
KEEP_OTHER_DEVICE = "other_device"  # not on the engine's device
KEEP_UNSUPPORTED = "unsupported"    # meta/fake tensors, tensor subclasses, sparse layouts
KEEP_BUDGET = "budget"          # host budget or pinned allocation exhausted

SELECTIONS = ("auto", "marked")

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_strided = torch.strided


class SelectionPolicy:
    """Decides, per saved tensor, whether to offload it or keep it (and why).

    ``selection="auto"`` offloads every eligible tensor of at least ``min_offload_bytes``;
    ``selection="marked"`` (v1's default) offloads only tensors opted in with
    ``mark_activation_offload``. An opted-in tensor is offloaded whatever its size: small FP8
    scales must travel with their data, and they share the group's region, so they cost no copy
    of their own. ``reserve_host_bytes(n) -> bool`` is asked last, so that only tensors that will
    really be copied take host budget.
    """

    def __init__(
        self,
        *,
        device_index: int,
        min_offload_bytes: int,
        selection: str,
        reserve_host_bytes: Callable[[int], bool],
    ) -> None:
        if selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
        if min_offload_bytes < 0:
            raise ValueError(f"min_offload_bytes must be >= 0, got {min_offload_bytes}")
        # ``Tensor.get_device()`` returns -1 for CPU tensors and the index for CUDA ones: one int
        # compare instead of building ``torch.device`` objects on the hot path.
        self.device_index = device_index
        self.min_offload_bytes = min_offload_bytes
        self.selection = selection
        self.opt_in_only = selection == "marked"
        self.reserve_host_bytes = reserve_host_bytes

    def decide(self, t: torch.Tensor) -> Optional[str]:
        """Return ``None`` to offload ``t``, or the reason (a ``KEEP_*`` string) to keep it."""
        tensor_type = type(t)
        if tensor_type is not _Tensor and tensor_type is not _Parameter:
            # FakeTensor, FunctionalTensor, DTensor...: their bytes are not plain device memory.
            return KEEP_UNSUPPORTED
        if t.requires_grad and t.is_leaf:
            return KEEP_PARAMETER
        base = t._base
        if base is not None and base.requires_grad and base.is_leaf:
            return KEEP_PARAMETER
        if getattr(t, KEEP_ATTR, False) or getattr(t, TE_KEEP_ATTR, False):
            return KEEP_MARKED
        if base is not None and (getattr(base, KEEP_ATTR, False) or getattr(base, TE_KEEP_ATTR, False)):
            return KEEP_MARKED
        opted_in = getattr(t, OFFLOAD_ATTR, False) or (
            base is not None and getattr(base, OFFLOAD_ATTR, False)
        )
        if self.opt_in_only and not opted_in:
            return KEEP_NOT_SELECTED
        if t.get_device() != self.device_index:
            return KEEP_OTHER_DEVICE
        if t.is_meta or t.layout is not _strided:
            return KEEP_UNSUPPORTED
        nbytes = t.nbytes
        if nbytes == 0 or (nbytes < self.min_offload_bytes and not opted_in):
            return KEEP_SMALL
        if not self.reserve_host_bytes(nbytes):
            return KEEP_BUDGET
        return None
