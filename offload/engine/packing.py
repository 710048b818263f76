"""The engine's saved-tensor hooks: ``pack`` and ``unpack``, the per-tensor hot path.

Separate from the rest of the engine because it is the one part that runs once per saved tensor
rather than once per layer or group: its host cost (a few microseconds a tensor, pack and unpack)
is paid thousands of times a step. So everything here stays flat: each hook is a method of the
engine itself (a mixin, no helper object to go through), and what is not needed per tensor lives
in the other parts (``offload.engine.lifecycle``, ``offload.engine.copies``). Even the profiler
is asked once per layer, not per tensor: while one runs, the engine pushes ``pack_profiled`` and
``unpack_profiled``, which wrap the hooks in ``offload::pack`` / ``offload::unpack`` ranges.

What ``pack`` returns to autograd (the handle), by the tensor's fate:
- kept where it is (the policy's decision, or a layer that is not offloaded, whose tensors
  OffloadActivations' hooks see too): ``(tensor, version at pack, layer)`` (:func:`keep_handle`),
  never the bare tensor, for both reasons below;
- recorded in the open group: ``(group, index)``;
- a quantized storage (``prepare_for_saving``): a ``StorageHandle`` of its components' handles.

Autograd keeps the handles, not the engine: ``backward(retain_graph=True)`` a second time simply
reloads again from the host region, which lives as long as the graph does.

Nothing the engine or a handle holds may refer back to the graph: autograd gives the pack hook a
node's *output* with that node as its ``grad_fn``, and the node holds what pack returns, so a
handle holding the output would make a cycle through C++ that Python's GC cannot see (an
abandoned or failed step would then keep its activations and host regions for good: the whole
graph, every earlier layer's groups included, hangs off such a cycle). Tensors that have a node
are therefore held detached (same storage and version counter); autograd puts the grad_fn back
when it unpacks. Leaves, parameters among them, hold no node.

In-place changes: autograd skips its version check for tensors saved through hooks, so the
engine records ``t._version`` at pack and compares at unpack, raising autograd's error. A
group's entry table holds its own alias of each tensor, and at release empties it in place,
keeping the version counter (``offload.engine.entry_table``), so a change made through any alias,
before or after release, is refused.
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
    from .forward import ForwardState
    from .step import InFlight, StepState
    from .transport import Transport

# A module global: one lookup per tensor, where ``torch.Tensor.detach`` takes three.
_detach = torch.Tensor.detach


def keep_handle(t: torch.Tensor, layer: int) -> tuple[torch.Tensor, int, int]:
    """The handle of a tensor kept where it is: ``(tensor, version at pack, layer)``.

    Detached when it has a node (it may be that node's own output: the cycle reason in the
    module notes); a leaf, a parameter among them, holds no node and is kept as it is, and so is
    a tensor subclass (its ``detach`` may not carry its internals, see ``marks.emptied_copy``).
    The version is checked by :func:`unpack_kept`, in place of autograd's skipped check.
    """
    if t.requires_grad and not t.is_leaf and type(t) is torch.Tensor:
        return (_detach(t), t._version, layer)
    return (t, t._version, layer)


def unpack_kept(handle: tuple[torch.Tensor, int, int]) -> torch.Tensor:
    """The tensor of a :func:`keep_handle`, after autograd's in-place check."""
    tensor, version, layer = handle
    if tensor._version != version:
        raise modified_error(tensor.shape, tensor.dtype, layer, tensor._version, version)
    return tensor


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
    forward: ForwardState
    in_flight: InFlight

    if TYPE_CHECKING:  # the other parts' methods used here
        def _between_layers_group(self) -> Optional[Group]: ...
        def _backward_started(self, step: StepState) -> None: ...
        def _check_finished(self, step: StepState) -> None: ...
        def start_reload(self, group: Group, into: Optional[torch.Tensor] = None) -> None: ...

    def pack(self, t: torch.Tensor, group: Optional[Group] = None) -> Any:
        """Pack hook: keep ``t`` (a ``(tensor, version, layer)`` handle) or record it in
        ``group``, by default the open one (a ``(group, index)`` handle)."""
        if group is None:
            forward = self.forward
            group = forward.open_group
            if group is None:
                group = self._between_layers_group()
                if group is None:
                    # A layer that is not offloaded (or the head): kept, but never as the tensor
                    # itself (the cycle and in-place reasons in the module notes).
                    return keep_handle(t, forward.layer)
        reason = self.policy.decide(t, group.min_offload_bytes)
        if reason is not None:
            if reason is KEEP_UNSUPPORTED and hasattr(t, "prepare_for_saving"):
                return self._pack_storage(group, t)
            group.counters.keep(reason)
            if reason is KEEP_PARAMETER:
                # A parameter, or a view of one: its node (if any) is the view's, never the node
                # saving it, so it needs no detach (the one keep on every step's Linear).
                return (t, t._version, group.layer)
            return keep_handle(t, group.layer)
        group.saved_bytes += t.nbytes
        return (group, group.table.add(t))

    def pack_profiled(self, t: torch.Tensor) -> Any:
        """:meth:`pack` inside an ``offload::pack`` profiler range: the hook pushed while a
        profiler runs (see ``StepLifecycleMixin._push_hooks``)."""
        with record_function("offload::pack"):
            return self.pack(t)

    def _pack_local(self, t: torch.Tensor) -> Any:
        # The pack hook of a graphed layer's forward (offload.graphs): its own group, no layers.
        return self.pack(t, self.forward.local_group)

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
        return StorageHandle(restorable, [None if c is None else self.pack(c, group) for c in components])

    def pack_kept(self, t: Any, reason: str, counters: StepCounters) -> Any:
        """Keep ``t`` where it is, counted under ``reason``: the pack hook of a keep region
        (``offload.keep_on_gpu``). Not on the per-tensor path of offloading contexts."""
        counters.keep(reason)
        return keep_handle(t, self.forward.layer)

    def unpack_profiled(self, packed: Any) -> Any:
        """:meth:`unpack` inside an ``offload::unpack`` profiler range (as :meth:`pack_profiled`)."""
        with record_function("offload::unpack"):
            return self.unpack(packed)

    def unpack(self, packed: Any) -> Any:
        """Unpack hook: hand back the original, or a typed view of the reloaded group."""
        if type(packed) is StorageHandle:
            return self._unpack_storage(packed)
        if len(packed) == 3:  # kept: (tensor, version at pack, layer)
            return unpack_kept(packed)
        group, index = packed
        step = self.forward.step
        if step is not None and not step.forward_done and group.step == step.index:
            self._backward_started(step)
        table = group.table
        if group.state in HOLDS_ORIGINALS:
            tensor = table.original(index)
            if tensor is None:  # changed in place since it was saved
                raise group.modified(index)
            group.unpacks += 1
            if group.unpacks == len(table):
                self._consumed(group)
            return tensor
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
        tensor = table.restore(index, group.gpu)
        if tensor is None:  # changed in place (through an alias the caller kept) since saved
            raise group.modified(index)
        group.unpacks += 1
        group.unpacks_since_reload += 1
        if group.unpacks_since_reload >= len(table):
            group.mark_dropped()
            self._consumed(group)
        return tensor

    def _unpack_storage(self, handle: StorageHandle) -> Any:
        # Every component is fetched first; only then is the storage rebuilt, so a failure leaves
        # nothing half-restored.
        parts = [None if p is None else self.unpack(p) for p in handle.parts]
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
            step = self.forward.step
            if step is None or step.index != group.step:
                step = self.in_flight.get(group.step)  # an earlier micro-batch's group
            if step is not None:
                step.unconsumed -= 1
                self._check_finished(step)
        else:
            self.schedule.on_consumed(self, group)
