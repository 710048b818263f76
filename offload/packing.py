"""The engine's saved-tensor hooks: ``pack`` and ``unpack``, the per-tensor hot path.

Separate from the rest of the engine because it is the one part that runs once per saved tensor
rather than once per layer or group: its host cost (a few microseconds a tensor, pack and unpack)
is paid thousands of times a step. So everything here stays flat: each hook is a method of the
engine itself (a mixin, no helper object to go through), and what is not needed per tensor lives
in the other parts (``offload.lifecycle``, ``offload.copies``).

What ``pack`` returns to autograd (the handle), by the tensor's fate:
- kept where it is (the policy's decision): ``(tensor, version at pack, layer)``;
- recorded in the open group: ``(group, index)``;
- a quantized storage (``prepare_for_saving``): a ``StorageHandle`` of its components' handles.

Autograd keeps the handles, not the engine: ``backward(retain_graph=True)`` a second time simply
reloads again from the host region, which lives as long as the graph does.

Nothing the engine or a handle holds may refer back to the graph: autograd gives the pack hook a
node's *output* with that node as its ``grad_fn``, and the node holds what pack returns, so a
handle holding the output would make a cycle through C++ that Python's GC cannot see (an
abandoned or failed step would then keep its activations and host regions for good). Tensors
that require grad are therefore held detached (same storage and version counter); autograd puts
the grad_fn back when it unpacks. Parameters are leaves: they hold no node.

In-place changes: autograd skips its version check for tensors saved through hooks, so the
engine records ``t._version`` at pack and compares at unpack, raising autograd's error. Once a
group is released it holds nothing that shares the version counter, so the check also runs at
release, and after it through a weak reference to the caller's tensor object while that lives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.autograd.profiler import record_function

from .group import HOLDS_ORIGINALS, Group, GroupState, modified_error
from .marks import KEEP_ATTR, emptied_copy
from .policy import KEEP_MARKED, KEEP_PARAMETER, KEEP_UNSUPPORTED, SelectionPolicy

if TYPE_CHECKING:
    from .schedules.base import Schedule
    from .stats import StepCounters
    from .step import InFlight, StepState
    from .transport import Transport

# A module global: one lookup per tensor, where ``torch.Tensor.detach`` takes three.
_detach = torch.Tensor.detach
# One C call (~50 ns): the profiler ranges below cost nothing while no profiler runs.
_profiling = torch._C._autograd._profiler_enabled


class StorageHandle:
    """What ``pack`` returns for a quantized storage: the storage shell and its packed parts."""

    __slots__ = ("restorable", "parts")

    def __init__(self, restorable: Any, parts: list[Any]) -> None:
        self.restorable = restorable
        self.parts = parts


class PackingMixin:
    """The pack and unpack hooks of :class:`offload.engine.OffloadEngine`."""

    # The engine's state used here (set up by OffloadEngine.__init__).
    policy: SelectionPolicy
    schedule: Schedule
    transport: Transport
    step: Optional[StepState]
    in_flight: InFlight
    open_group: Optional[Group]
    local_group: Optional[Group]
    current_layer: int

    if TYPE_CHECKING:  # the other parts' methods used here
        def _between_layers_group(self) -> Optional[Group]: ...
        def _backward_started(self, step: StepState) -> None: ...
        def _check_finished(self, step: StepState) -> None: ...
        def start_reload(self, group: Group, into: Optional[torch.Tensor] = None) -> None: ...

    def pack(self, t: torch.Tensor) -> Any:
        """Pack hook: keep ``t`` (a ``(tensor, version, layer)`` handle) or record it in the open
        group (a ``(group, index)`` handle)."""
        group = self.open_group
        if group is None:
            group = self._between_layers_group()
            if group is None:
                return t
        if _profiling():
            with record_function("offload::pack"):
                return self._pack_into(group, t)
        return self._pack_into(group, t)

    def _pack_local(self, t: torch.Tensor) -> Any:
        # The pack hook of a graphed layer's forward (offload.graphs): its own group, no layers.
        return self._pack_into(self.local_group, t)  # type: ignore[arg-type]

    def _pack_into(self, group: Group, t: Any) -> Any:
        reason = self.policy.decide(t, group.min_offload_bytes)
        if reason is not None:
            if reason is KEEP_UNSUPPORTED and hasattr(t, "prepare_for_saving"):
                return self._pack_storage(group, t)
            group.counters.keep(reason)
            # Detached for the cycle reason above; a parameter is a leaf (or a view of one,
            # whose grad_fn is the view's node, not the node saving it).
            if reason is not KEEP_PARAMETER and t.requires_grad:
                return (_detach(t), t._version, group.layer)
            return (t, t._version, group.layer)
        group.saved_bytes += t.nbytes
        return (group, group.add(t))

    def _pack_storage(self, group: Group, storage: Any) -> Any:
        # A quantized tensor subclass (TransformerEngine's Float8Tensor and friends; parameters
        # were kept by the policy already): each component is decided and packed on its own, and
        # the storage is rebuilt on unpack. The caller's object is never emptied: forward may
        # still use it or save it again. An emptied copy is what the handle keeps, so once the
        # components are released nothing here holds their GPU memory.
        reason = KEEP_MARKED if getattr(storage, KEEP_ATTR, False) else None
        shell = None if reason is not None else emptied_copy(storage)
        if shell is None:
            group.counters.keep(reason or KEEP_UNSUPPORTED)
            # Not detached: a subclass's detach may not carry its internals (see emptied_copy).
            return (storage, storage._version, group.layer)
        restorable, components = shell
        return StorageHandle(restorable, [None if c is None else self._pack_into(group, c) for c in components])

    def pack_kept(self, t: Any, reason: str, counters: StepCounters) -> Any:
        """Keep ``t`` where it is, counted under ``reason``: the pack hook of a keep region
        (``offload.keep_on_gpu``). Not on the per-tensor path of offloading contexts."""
        # Not shared with _pack_into's keep branch: that one knows the policy's reason (a
        # parameter is never detached) and must stay free of an extra call per tensor; this one
        # sees any tensor, and detaches neither leaves (they hold no node) nor subclasses (see
        # _pack_storage).
        counters.keep(reason)
        if type(t) is torch.Tensor and t.requires_grad and not t.is_leaf:
            t = _detach(t)  # the cycle reason in the module notes
        return (t, t._version, self.current_layer)

    def unpack(self, packed: Any) -> Any:
        """Unpack hook: hand back the original, or a typed view of the reloaded group."""
        if _profiling():
            with record_function("offload::unpack"):
                return self._unpack(packed)
        return self._unpack(packed)

    def _unpack(self, packed: Any) -> Any:
        if type(packed) is not tuple:
            if type(packed) is StorageHandle:
                return self._unpack_storage(packed)
            return packed
        if len(packed) == 3:  # kept: (tensor, version at pack, layer)
            tensor, version, layer = packed
            if tensor._version != version:
                raise modified_error(tensor.shape, tensor.dtype, layer, tensor._version, version)
            return tensor
        group, index = packed
        step = self.step
        if step is not None and not step.forward_done and group.step == step.index:
            self._backward_started(step)
        if group.state in HOLDS_ORIGINALS:
            tensor = group.original(index)
            if tensor._version != group.versions[index]:
                group.check_version(index, tensor)
            group.unpacks += 1
            if group.unpacks == len(group.entries):
                self._consumed(group)
            return tensor
        caller = group.callers[index]()
        if group.modified is not None or (caller is not None and caller._version != group.versions[index]):
            group.check_version(index, caller)
        group.unpacks += 1
        if group.state is GroupState.OFFLOADED:
            # No prefetch started this reload: compute will wait for all of it.
            group.counters.reloads_on_demand += 1
            if not group.local:  # a graphed layer's group is outside the schedule's steps
                self.schedule.on_unpack_miss(self, group)
            if group.state is GroupState.OFFLOADED:
                self.start_reload(group)
        if not group.h2d_waited:
            self.transport.wait_reloaded(group, group.counters)
            group.h2d_waited = True
        tensor = group.restore(index)
        group.unpacks_since_reload += 1
        if group.unpacks_since_reload >= len(group.entries):
            group.mark_dropped()
            self._consumed(group)
        return tensor

    def _unpack_storage(self, handle: StorageHandle) -> Any:
        # Every component is fetched first; only then is the storage rebuilt, so a failure leaves
        # nothing half-restored.
        parts = [None if p is None else self._unpack(p) for p in handle.parts]
        handle.restorable.restore_from_saved(parts)
        return handle.restorable

    def _consumed(self, group: Group) -> None:
        # Every entry of the group was handed back (once, or again after a retained graph's
        # reload): tell the schedule, and count the group off its step the first time.
        if group.local:
            group.consumed = True
            return
        if not group.consumed:
            group.consumed = True
            self.schedule.on_consumed(self, group)
            step = self.step
            if step is None or step.index != group.step:
                step = self.in_flight.get(group.step)  # an earlier micro-batch's group
            if step is not None:
                step.unconsumed -= 1
                self._check_finished(step)
        else:
            self.schedule.on_consumed(self, group)
