"""The one selection policy: which saved tensors leave the GPU.

Every schedule (v1, v2, manual) asks :meth:`SelectionPolicy.decide`, so a do-not-offload mark is
honored by construction rather than by a check repeated in each schedule. ``decide`` runs inside
the pack hook once per saved tensor, so it reads a handful of cheap attributes, cheapest and most
decisive first, and allocates nothing.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterable, Optional

import torch

from .marks import KEEP_ATTR, OFFLOAD_ATTR, TE_KEEP_ATTR

# Reasons a tensor stays where it is. They are the keys of ``stats["kept"]``.
KEEP_LAYER = "layer"            # not saved inside a layer the schedule offloads
KEEP_PARAMETER = "parameter"    # a parameter (frozen too), a leaf that requires grad, a view of
                                # one, or memory of a registered module parameter or buffer
KEEP_MARKED = "marked"          # mark_not_offload (ours or TransformerEngine's tag)
KEEP_NOT_SELECTED = "not_selected"  # opt-in selection (v1) and no mark_activation_offload
KEEP_SMALL = "small"            # fewer bytes than min_offload_bytes (empty tensors too)
KEEP_OTHER_DEVICE = "other_device"  # not on the engine's device
KEEP_UNSUPPORTED = "unsupported"    # meta/fake tensors, tensor subclasses, sparse and nested layouts
KEEP_BUDGET = "budget"          # host budget or pinned allocation exhausted
KEEP_PINNING = "pinning"        # its host block was still being pinned, and the GPU had room
KEEP_REGION = "keep_on_gpu"     # saved inside an ``offload.keep_on_gpu()`` region

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
        claim_ahead: Optional[Callable[[int, int], int]] = None,
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
        # ``claim_ahead(n, ahead) -> bytes promised``: the same budget as ``reserve_host_bytes``,
        # with a credit for the group's next tensors (``HostArena.claim_ahead``). The native pack
        # hook uses it to ask once for many small tensors; None: it asks per tensor.
        self.claim_ahead = claim_ahead
        # Data pointers of the storages of registered modules' parameters and buffers: a tensor
        # over that memory frees nothing when offloaded (the module keeps it), so it is kept.
        self.module_storages: frozenset[int] = frozenset()
        # The largest tensor kept as too small since the last step's diagnosis (the warning that
        # a step offloaded nothing names it); updated on the small-tensor keep path only.
        self.largest_small = 0

    def set_module_storages(self, modules: Iterable[torch.nn.Module]) -> None:
        """Keep every tensor whose storage is that of a parameter or buffer of ``modules``.

        The addresses are read now: register again after moving or re-creating the parameters
        (``module.to(...)``), since the memory they had may then hold activations.
        """
        ptrs = set()
        for module in modules:
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                if type(tensor) in (_Tensor, _Parameter) and not tensor.is_meta:
                    ptr = tensor.untyped_storage().data_ptr()
                    if ptr:
                        ptrs.add(ptr)
        self.module_storages = frozenset(ptrs)

    def decide(self, t: torch.Tensor, min_offload_bytes: Optional[int] = None) -> Optional[str]:
        """Return ``None`` to offload ``t``, or the reason (a ``KEEP_*`` string) to keep it.

        ``min_offload_bytes``: a size floor for this call (a plan that offloads only a layer's
        large tensors) instead of the policy's own.
        """
        tensor_type = type(t)
        if tensor_type is _Parameter:
            # Frozen ones too (requires_grad=False, as in LoRA): their memory stays on the GPU
            # whatever happens, so a copy would only cost time.
            return KEEP_PARAMETER
        if tensor_type is not _Tensor:
            # Parameters first: an FP8 weight may be a subclass with prepare_for_saving, and the
            # engine must not split it. Other subclasses (FakeTensor, FunctionalTensor, DTensor,
            # jagged nested tensors...): their bytes are not plain device memory.
            if t.requires_grad and t.is_leaf or isinstance(t, _Parameter):
                return KEEP_PARAMETER
            return KEEP_UNSUPPORTED
        if t.requires_grad and t.is_leaf:
            return KEEP_PARAMETER
        base = t._base
        if base is not None and (type(base) is _Parameter or base.requires_grad and base.is_leaf):
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
        if t.is_meta or t.layout is not _strided or t.is_nested:
            # Strided nested tensors have no single size or stride to restore a view with.
            return KEEP_UNSUPPORTED
        if self.module_storages and t.untyped_storage().data_ptr() in self.module_storages:
            return KEEP_PARAMETER
        nbytes = t.nbytes
        floor = self.min_offload_bytes if min_offload_bytes is None else min_offload_bytes
        if nbytes == 0 or (nbytes < floor and not opted_in):
            if nbytes > self.largest_small:
                self.largest_small = nbytes
            return KEEP_SMALL
        if not self.reserve_host_bytes(nbytes):
            return KEEP_BUDGET
        return None
