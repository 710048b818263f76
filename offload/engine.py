"""The engine: saved-tensor hooks, the step and layer lifecycle, and the primitives schedules use.

Lifetime of one saved tensor (the data flow in brief: docs/design.md):
- ``pack`` (forward): the policy keeps it (``(tensor, version, layer)`` is returned, the tensor
  detached unless it is a parameter, see below) or it joins the open layer's group and
  ``(group, index)`` is returned to autograd.
- the schedule offloads the group (D2H into an arena region), releases the GPU originals, and
  reloads the group (one H2D into one buffer) ahead of its backward.
- ``unpack`` (backward): the original if the group still holds it, else a typed view of the
  reload buffer. Once every entry was handed back, the group drops its buffer reference; the
  views autograd still holds keep the memory alive until it is done with them.
- when autograd frees the saved tensors (and the engine has moved to the next step) the group is
  garbage and its host region goes back to the arena, tagged with the event of its last copy.

Layer boundaries. In TransformerEngine's call shape the saved-tensor hooks are pushed by each
layer's ``with ctx`` (only for layers the schedule offloads) and a step is ``model_layers`` layer
contexts. ``OffloadActivations`` instead pushes the hooks once around the whole forward and only
switches the open group at layer boundaries, so that a ``torch.utils.checkpoint`` inside the
forward pushes its own hooks *inside* ours and wins for the tensors of the region it recomputes
(only the checkpoint's inputs reach us). Tensors saved between two layers join the next layer's
group: a checkpoint wrapped around a layer's ``__call__`` (transformers 5.17) saves the layer's
inputs just before its pre-hook runs. A layer entered while autograd runs a backward is a
checkpoint recomputing it, and a layer entered under ``no_grad`` outside a training forward saves
nothing: both are *passive* (not counted, nothing recorded).

The step's groups are held weakly: autograd's handles keep them alive. A forward whose graph is
dropped before its backward (an exception between layers, a skipped backward) frees its groups,
which marks the step abandoned, so the next layer starts a fresh step instead of counting on.
Backward reaching a step whose forward is still open (fewer layer contexts than ``model_layers``)
ends that forward, with a warning that says what was seen.

Several micro-batches in flight (a pipeline stage's 1F1B order: forward mb0, forward mb1,
backward mb0, ...). Each forward is a step, so a group is keyed by (step, layer), i.e. by
(micro-batch, layer). A step whose backward is still to come when the next forward begins is
kept in ``in_flight`` (``step.InFlight``) rather than finished. Its backward markers reach the
schedule with that step (``Schedule.on_backward_reach(engine, step, layer)``, the one hook for
the current step and earlier ones alike), so the schedules prefetch that micro-batch's own
groups, and their budgets count what every micro-batch in flight holds (each schedule's module
says how). A step is finished (its figures final) when its backward has handed every group back.

One engine serves one forward at a time: a layer entered from another thread while a step's
forward is open raises (two concurrent forwards would mix their layers into one step), and so
does ``OffloadActivations`` going back to an earlier layer inside one ``with``.

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

CUDA graphs (see ``offload.graphs``):
- a step whose first layer starts while the current stream is capturing is a *captured step*:
  the same schedule runs, its copies and waits are recorded into the graph (``Group.captured``),
  its host regions become the graph's, and when its last group is handed back the side streams
  are joined to the capture stream. Forward and backward must both be inside the capture.
- a *local group* (``begin_local_group`` / ``end_local_group``) is one graphed layer's saved
  tensors, self-contained because the layer's forward and backward are two separate graphs:
  offloaded and released at the end of the forward (so its D2H joins inside that graph), and
  reloaded on first use in the backward.
"""

from __future__ import annotations

import threading
import warnings
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch.autograd.profiler import record_function

from .arena import CaptureError, HostArena
from .diagnose import nothing_offloaded
from .eager import saved_tensors_hooks
from .group import HOLDS_ORIGINALS, Group, GroupState, modified_error
from .marks import KEEP_ATTR, emptied_copy
from .policy import KEEP_BUDGET, KEEP_MARKED, KEEP_PARAMETER, KEEP_PINNING, KEEP_UNSUPPORTED, SelectionPolicy
from .stats import StepCounters, format_report, snapshot
from .step import BackwardReach, InFlight, StepState
from .transport import CudaTransport, HostTransport

if TYPE_CHECKING:
    from .schedules.base import Schedule

Transport = Union[CudaTransport, HostTransport]

_detach = torch.Tensor.detach
# One C call (~50 ns): the profiler ranges below cost nothing while no profiler runs.
_profiling = torch._C._autograd._profiler_enabled


class StorageHandle:
    """What ``pack`` returns for a quantized storage: the storage shell and its packed parts."""

    __slots__ = ("restorable", "parts")

    def __init__(self, restorable: Any, parts: list[Any]) -> None:
        self.restorable = restorable
        self.parts = parts


class OffloadEngine:
    """Owns one model's offloading: policy, schedule, transport, arena and per-step state."""

    def __init__(
        self,
        *,
        policy: SelectionPolicy,
        schedule: Schedule,
        transport: Transport,
        arena: HostArena,
        mode: str,
        model_layers: int,
        layer_contexts: bool,
    ) -> None:
        self.policy = policy
        self.schedule = schedule
        self.transport = transport
        self.arena = arena
        self.mode = mode
        self.model_layers = model_layers
        # True: TransformerEngine's call shape. It has no "end of forward" call, so a step is
        # model_layers layer contexts, and each offloaded layer's context pushes the hooks.
        # False: OffloadActivations, which pushes the hooks once and ends the forward itself.
        self.layer_contexts = layer_contexts
        self.step: Optional[StepState] = None
        self.last_finished: Optional[StepCounters] = None
        self.open_group: Optional[Group] = None
        # The next layer's group, opened early by a tensor saved between two layers. Strong
        # reference: until its layer runs, no autograd handle may hold it yet.
        self.pending_group: Optional[Group] = None
        self.current_layer = -1
        self.last_closed_layer: Optional[int] = None  # None after a passive layer
        self.in_layer = False
        self._passive_depth = 0  # open layer contexts that are not tracked (see module notes)
        self._hooks_pushed = False
        self._forward_hooks_pushed = False
        self._warned: set[str] = set()
        # Run eagerly even under a compiled frame (see offload.eager).
        self._hooks = saved_tensors_hooks(self.pack, self.unpack)
        self._step_index = 0
        self.in_flight = InFlight()  # earlier micro-batches, backward still to come
        self._forward_thread = 0  # the thread running the open step's forward
        # The graphed layer being captured or warmed up (offload.graphs), with its own hooks.
        self.local_group: Optional[Group] = None
        self._local_hooks = saved_tensors_hooks(self._pack_local, self.unpack)
        self._local_hooks_pushed = False

    # -- step and layer lifecycle ----------------------------------------------------------------
    def begin_step(self, captured: Optional[bool] = None) -> None:
        """Start a new step, finishing the previous one's bookkeeping.

        ``captured``: whether the current stream is capturing a CUDA graph (asked if None).
        """
        if captured is None:
            captured = self.transport.capturing()
        previous = self.step
        if previous is not None:
            if captured or not self.in_flight.admit(previous):
                # Trimming idle blocks waits on their events on the host: not under capture.
                self._finish(previous, trim=not captured)
            # Let go of its groups now: freed, they hand their host regions back to the arena,
            # where a capture starting with this step looks for them.
            self.step = None
            del previous
        for stale in self.in_flight.stale():
            self._finish(stale, trim=False)
        if captured:
            self._check_capture_ready("a step")
        self.in_flight.start(self._step_index + 1)
        self._forward_thread = threading.get_ident()
        self._step_index += 1
        counters = StepCounters(step=self._step_index, mode=self.mode, captured=captured)
        counters.pinned_allocations = -self.arena.counters.pinned_allocations
        self.step = StepState(index=self._step_index, counters=counters, captured=captured)
        self.schedule.on_step_start(self)

    def step_state(self, index: int) -> Optional[StepState]:
        """The step (micro-batch) of that index: the current one or one still in flight."""
        step = self.step
        if step is not None and step.index == index:
            return step
        return self.in_flight.get(index)

    def micro_batches(self) -> list[StepState]:
        """Every step in flight: the earlier ones waiting for their backward, then the current."""
        steps = self.in_flight.values()
        if self.step is not None and not self.step.counters.finished:
            steps.append(self.step)
        return steps

    def _check_capture_ready(self, what: str) -> None:
        # Pinned memory cannot be allocated under capture, so the regions must exist already.
        if self.schedule.num_layers > 0 and not self.arena.has_idle_blocks():
            hint = (
                "" if self.arena.retain else
                " and pass retain_pinned_cpu_buffers=True so its blocks are kept for the capture"
            )
            raise CaptureError(
                f"offload: CUDA-graph capture of {what} with offloading began, but no pinned host "
                "buffers are ready: they cannot be allocated under capture. Run one eager step (or "
                f"warm-up iteration) with offloading on right before capturing{hint}."
            )

    def _forward_open(self) -> bool:
        step = self.step
        return step is not None and not step.forward_done and not step.abandoned

    def _passive_layer(self) -> bool:
        # Inside a backward (autograd's graph task is set): a checkpoint recomputing a layer.
        # Under no_grad with no training forward open: an eval forward, which saves nothing.
        # A no_grad layer *inside* a training forward (a frozen layer, a reentrant checkpoint)
        # still counts, so that the layer numbering matches the model.
        if torch._C._current_graph_task_id() != -1:
            return True
        return not torch.is_grad_enabled() and not self._forward_open()

    def next_layer(self) -> Optional[int]:
        """The index :meth:`begin_layer` would give the layer entered now, or None when it
        would be passive (see the module notes)."""
        if self._passive_depth or self._passive_layer():
            return None
        return self.step.layers_started if self._forward_open() else 0  # type: ignore[union-attr]

    def begin_layer(self) -> bool:
        """Forward enters the next layer: schedule decisions, then capture its saved tensors.

        Returns False for a passive layer (see the module notes): nothing is tracked until the
        matching :meth:`end_layer`. Atomic: if it raises, the engine is as it was.
        """
        if self._passive_depth or self._passive_layer():
            self._passive_depth += 1
            return False
        if self._forward_open() and threading.get_ident() != self._forward_thread:
            raise RuntimeError(
                "offload: a layer was entered from another thread while this offload context "
                "runs a forward in its own thread; one context serves one forward at a time, "
                "and two concurrent forwards would mix their layers into one step. Give each "
                "thread (each model or micro-batch stream run concurrently) its own context: "
                "one get_cpu_offload_context(...) or OffloadActivations(...) per stream"
            )
        if self.in_layer:
            raise RuntimeError(
                "offload: a layer context was entered while another is still open; offload "
                "contexts do not nest: close the outer layer's `with` before entering the next "
                "(with OffloadActivations, pass layers that do not contain one another)"
            )
        captured = self.transport.capturing()
        new_step = not self._forward_open()
        layer = 0 if new_step else self.step.layers_started  # type: ignore[union-attr]
        offloads = torch.is_grad_enabled() and self.schedule.offloads(layer)
        push = offloads and self.layer_contexts
        if push:
            # First, before any state changes: pushing raises under
            # torch.autograd.graph.disable_saved_tensors_hooks, and the engine must stay usable.
            self._hooks.__enter__()
        try:
            if new_step:
                self.begin_step(captured)
            step = self.step
            if captured != step.captured:
                raise CaptureError(
                    "offload: a step's layers must all run under the same CUDA-graph capture or all "
                    f"eagerly, but layer {step.layers_started} {'is' if captured else 'is not'} being "
                    "captured and the step's first layer was "
                    f"{'not ' if captured else ''}captured; capture the whole forward and backward"
                )
        except BaseException:
            if push:
                self._hooks.__exit__(None, None, None)
            raise
        self._hooks_pushed = push
        step.layers_started += 1
        self.current_layer = layer
        self.in_layer = True
        self.schedule.on_layer_start(self, layer)
        if offloads:
            group = self.pending_group
            self.pending_group = None
            if group is None or group.layer != layer:
                group = self._new_group(layer, step)
            self.open_group = group
        return True

    def _new_group(self, layer: int, step: StepState) -> Group:
        group = Group(layer, step.index)
        group.min_offload_bytes = self.schedule.min_offload_bytes(layer)
        group.on_free = self._group_freed
        group.counters = step.counters
        group.captured = step.captured
        step.groups[layer] = group
        return group

    def _between_layers_group(self) -> Optional[Group]:
        """The group for a tensor saved between two layers of OffloadActivations' forward: the
        next layer's (see the module notes), or None to keep it where it is."""
        if self.in_layer or self._passive_depth or not self._forward_open():
            return None
        step = self.step
        layer = step.layers_started  # type: ignore[union-attr]
        group = self.pending_group
        if group is None or group.layer != layer:
            if not self.schedule.offloads(layer):
                return None
            group = self.pending_group = self._new_group(layer, step)  # type: ignore[arg-type]
        return group

    def end_layer(self, failed: bool = False) -> Optional[int]:
        """Forward left the layer: close its group and let the schedule start its D2H.

        Returns the layer's index, or None for a passive layer or after a failure.
        """
        self.last_closed_layer = None
        if self._passive_depth:
            self._passive_depth -= 1
            return None
        if not self.in_layer:
            return None
        self.in_layer = False
        if self._hooks_pushed:
            self._hooks_pushed = False
            self._hooks.__exit__(None, None, None)
        group = self.open_group
        self.open_group = None
        if failed:
            self.abort_step()
            return None
        step = self.step
        if group is not None:
            group = self._close(group, step)
        self.schedule.on_layer_end(self, self.current_layer, group)
        self.last_closed_layer = self.current_layer
        if self.layer_contexts and step.layers_started >= self.model_layers:
            self.end_forward()
        return self.current_layer

    def _close(self, group: Group, step: StepState) -> Optional[Group]:
        # Lay the group out, or forget it when nothing was saved into it.
        self.arena.unclaim(group.saved_bytes)
        if group.entries:
            group.close()
            step.unconsumed += 1
            return group
        group.state = GroupState.KEPT  # nothing saved: nothing to do, ever
        step.groups.pop(group.layer, None)
        return None

    def begin_forward(self) -> bool:
        """OffloadActivations' entry: start a step and push the hooks for the whole forward.

        Returns False (and does nothing) under ``no_grad``, where a forward saves nothing.
        Atomic like :meth:`begin_layer`.
        """
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return False
        self._hooks.__enter__()  # first: it may raise, and then nothing has changed
        self._forward_hooks_pushed = True
        try:
            self.begin_step()
        except BaseException:
            self._pop_forward_hooks()
            raise
        return True

    def _pop_forward_hooks(self) -> None:
        if self._forward_hooks_pushed:
            self._forward_hooks_pushed = False
            self._hooks.__exit__(None, None, None)

    def finish_forward(self) -> None:
        """OffloadActivations' exit: pop the forward's hooks, then :meth:`end_forward`."""
        self._pop_forward_hooks()
        self.end_forward()

    def end_forward(self) -> None:
        """The forward pass is over: the schedule releases what it still holds.

        Also called from backward (see :meth:`_backward_started`), possibly on autograd's
        device thread, so it leaves the hooks alone: they belong to the thread that pushed them.
        """
        step = self.step
        if step is None or step.forward_done:
            return
        pending = self.pending_group
        if pending is not None:
            # Saved after the last layer that ran, for a layer that never came: keep it here.
            self.pending_group = None
            pending = self._close(pending, step)
            if pending is not None:
                pending.mark_kept()
        step.forward_done = True
        self.schedule.on_forward_end(self)
        self._check_finished(step)

    def _backward_started(self, step: StepState) -> None:
        # Backward reached a step whose forward is still open: the forward is over, whatever
        # the layer count said. Say so when the count is the TE call shape's step boundary.
        if self.layer_contexts and step.layers_started != self.model_layers:
            self.warn_once(
                "count",
                f"offload: backward began after {step.layers_started} layer contexts, but "
                f"model_layers={self.model_layers}; the step was ended there. Pass the number of "
                "`with ctx` blocks one forward really runs as model_layers, or the schedule "
                "offloads the wrong layers (gradients stay exact).",
            )
        self.end_forward()

    def warn_once(self, key: str, message: str) -> None:
        """Warn with ``message`` the first time ``key`` comes up in this engine's life."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)

    def abort_step(self) -> None:
        """Forget the step after an exception in forward; the next layer starts a fresh step.

        Its groups are dropped from the engine here and freed with whatever autograd graph
        still references them, so no GPU or host memory stays behind.
        """
        if self._hooks_pushed:
            self._hooks_pushed = False
            self._hooks.__exit__(None, None, None)
        self._pop_forward_hooks()
        self.in_layer = False
        self.open_group = None
        self.pending_group = None
        self._passive_depth = 0
        if self.step is not None:
            for group in list(self.step.groups.values()):
                if group.state is GroupState.OPEN:
                    self.arena.unclaim(group.saved_bytes)
                    group.saved_bytes = 0
        self.step = None

    def _finish(self, step: StepState, trim: bool = True) -> None:
        if not step.counters.finished:
            step.counters.finished = True
            step.counters.pinned_allocations += self.arena.counters.pinned_allocations
            self._diagnose(step.counters)
        self.last_finished = step.counters
        if self.in_flight:
            self.in_flight.pop(step.index)
        # Trim only when the whole wave of micro-batches is done, keeping the blocks any of
        # them used: the next wave (the pipeline's next iteration) asks for them again.
        current = self.step
        wave_done = not self.in_flight and (current is None or current is step or current.counters.finished)
        if trim and wave_done and not step.captured:
            self.arena.end_step(step.index, first_step=self.in_flight.wave_first)

    def _diagnose(self, counters: StepCounters) -> None:
        # Once per step, from its counters: a step that was meant to offload and moved nothing
        # warns (once per context) with the reason, instead of failing silently.
        largest_small, self.policy.largest_small = self.policy.largest_small, 0
        if "nothing_offloaded" in self._warned or not self.schedule.expects_offload():
            return
        message = nothing_offloaded(
            counters, min_offload_bytes=self.policy.min_offload_bytes, largest_small=largest_small
        )
        if message is not None:
            self.warn_once("nothing_offloaded", message)

    def pack_kept(self, t: Any, reason: str, counters: StepCounters) -> Any:
        """Keep ``t`` where it is, counted under ``reason``: the pack hook of a keep region
        (``offload.keep_on_gpu``). Not on the per-tensor path of offloading contexts."""
        counters.keep(reason)
        if type(t) is torch.Tensor and t.requires_grad and not t.is_leaf:
            t = _detach(t)  # the cycle reason in the module notes
        return (t, t._version, self.current_layer)

    def _check_finished(self, step: StepState) -> None:
        # A step is finished once its forward is done and every group was handed back in full.
        if step.forward_done and step.unconsumed <= 0:
            if step.captured and not step.counters.finished:
                # Still inside the capture (the last unpack of its backward): join the side
                # streams this step forked, or the capture cannot end.
                self._join_side_streams(step.counters)
            self._finish(step)

    def _join_side_streams(self, counters: StepCounters) -> None:
        self.transport.join(d2h=counters.groups_offloaded > 0, h2d=counters.reloads > 0)

    # -- graphed layers (offload.graphs) ---------------------------------------------------------
    def begin_local_group(self, label: int, counters: StepCounters) -> Group:
        """Collect the saved tensors of one graphed layer's forward into a self-contained group.

        Used by ``offload.graphs`` around a layer's forward while it is warmed up and captured;
        ``label`` names the layer in messages, ``counters`` receive its figures.
        """
        if self.local_group is not None:
            raise RuntimeError("offload: graphed layers do not nest; a graphed layer's forward called another")
        captured = self.transport.capturing()
        if captured:
            self._check_capture_ready(f"graphed layer {label}")
        group = Group(label, step=0)
        group.local = True
        group.captured = captured
        group.on_free = self._group_freed
        group.counters = counters
        self.local_group = group
        if torch.is_grad_enabled():
            self._local_hooks.__enter__()
            self._local_hooks_pushed = True
        return group

    def end_local_group(self, failed: bool = False) -> None:
        """Close the graphed layer's group: offload it and release its GPU memory at once.

        Releasing here makes the forward wait for its own D2H, which is what joins the copy
        stream back before the forward graph ends; with ``cuda_graph_event`` the caller's stream
        does not have to wait for that tail (see ``offload.graphs``).
        """
        group = self.local_group
        if group is None:
            return
        self.local_group = None
        if self._local_hooks_pushed:
            self._local_hooks_pushed = False
            self._local_hooks.__exit__(None, None, None)
        self.arena.unclaim(group.saved_bytes)
        group.saved_bytes = 0
        if failed or not group.entries:
            group.state = GroupState.KEPT  # nothing to move; any handles autograd kept stay valid
            return
        group.close()
        self.start_offload(group)
        self.release(group)

    # -- hooks -----------------------------------------------------------------------------------
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

    # -- primitives for schedules ----------------------------------------------------------------
    def start_offload(self, group: Group) -> None:
        """Copy a closed group to a host region (or keep it on the GPU if none can be had)."""
        if group.state is not GroupState.RESIDENT:
            return
        if _profiling():
            with record_function("offload::offload"):
                return self._start_offload(group)
        return self._start_offload(group)

    def _start_offload(self, group: Group) -> None:
        counters = group.counters
        kept_while_pinning = self.arena.counters.kept_while_pinning
        try:
            region = self.arena.acquire(
                group.nbytes, group.step, captured=group.captured,
                expected_more=None if group.local else lambda: self.schedule.offloaded_after(group.layer),
            )
        except CaptureError:
            # Join what this capture forked so that it can end and this error is the one seen.
            self._join_side_streams(counters)
            raise
        if region is None:
            group.mark_kept()
            counters.groups_kept += 1
            pinning = self.arena.counters.kept_while_pinning != kept_while_pinning
            counters.keep(KEEP_PINNING if pinning else KEEP_BUDGET, len(group.entries))
            return
        group.mark_offloading(region, self.transport.offload(group, region, counters))
        counters.groups_offloaded += 1
        counters.offloaded_tensors += len(group.entries)
        counters.offloaded_bytes += group.copy_bytes
        counters.bytes_d2h += group.copy_bytes

    def release(self, group: Group) -> None:
        """Drop the GPU originals of an offloading group once its D2H is ordered before reuse."""
        if group.state is not GroupState.OFFLOADING:
            return
        if _profiling():
            with record_function("offload::release_wait"):
                self.transport.wait_offloaded(group, group.counters)
        else:
            self.transport.wait_offloaded(group, group.counters)
        group.mark_released()
        group.counters.released_bytes += group.copy_bytes

    def start_reload(self, group: Group, into: Optional[torch.Tensor] = None) -> None:
        """Start the one H2D copy of an offloaded group (into a fresh or the given buffer)."""
        if group.state is not GroupState.OFFLOADED:
            return
        if _profiling():
            with record_function("offload::reload"):
                return self._start_reload(group, into)
        return self._start_reload(group, into)

    def _start_reload(self, group: Group, into: Optional[torch.Tensor]) -> None:
        captured = self.transport.capturing()
        if captured != group.captured:
            raise CaptureError(
                f"offload: the saved tensors of layer {group.layer} were offloaded "
                f"{'under CUDA-graph capture' if group.captured else 'eagerly'} but are needed "
                f"{'under capture' if captured else 'eagerly'}; the forward and backward that "
                "use offloading must be captured together (one graph for the step), or graphed "
                "per layer with offload.graphs.make_graphed_callables"
            )
        group.reload_captured = captured
        # A graphed layer's D2H is in its forward graph, its H2D in the backward graph: the
        # H2D cannot wait on an event of another graph (replay order covers it instead).
        wait_d2h = not (captured and group.local)
        buffer, done = self.transport.reload(group, group.counters, into, wait_d2h=wait_d2h)
        group.mark_reloaded(buffer, done)
        group.counters.bytes_h2d += group.nbytes
        group.counters.reloads += 1

    def on_backward_reach(self, step: int, layer: int) -> None:
        """Called by the backward markers: backward is about to run ``layer`` of ``step`` (the
        current step or an earlier micro-batch still in flight; any other is done with)."""
        state = self.step_state(step)
        if state is None:
            return
        if state is self.step and not state.forward_done:
            self._backward_started(state)
        state.reached = layer
        self.schedule.on_backward_reach(self, state, layer)

    def attach_backward_marker(self, tensor: torch.Tensor, layer: int) -> None:
        """Fire ``on_backward_reach(layer)`` when the gradient of ``tensor`` is computed."""
        if self.step is not None and tensor.requires_grad:
            tensor.register_hook(BackwardReach(self, self.step.index, layer))

    def _group_freed(self, group: Group) -> None:
        # From Group.__del__: the host region goes back with the event of its last copy, so the
        # next writer waits for it on the GPU instead of the host waiting now.
        if group.host is not None:
            self.arena.release(group.host, self.transport.last_host_use(group))
            group.host = None
        step = self.step
        if step is None or group.step != step.index:
            earlier = self.in_flight.get(group.step)
            if earlier is not None and group.entries and not group.consumed:
                earlier.unconsumed -= 1  # settled (finished) at the next step's start
            return
        if group.entries and not group.consumed and group.state is not GroupState.OPEN:
            step.unconsumed -= 1  # dropped with its graph before backward handed it all back
        if self.layer_contexts and group.entries and not step.forward_done:
            # (OffloadActivations knows where each forward starts.)
            step.abandoned = True

    def reserve(self, nbytes: int, *, background: bool = False) -> int:
        """Pin host blocks for ``nbytes`` of offloaded groups ahead of need; returns the bytes.

        The blocks take the sizes the latest step's groups asked for (repeated) when a step has
        run, else ``nbytes`` is cut into one equal block per offloaded layer (an arena block
        serves groups of half to all of its size). ``background=True`` queues them on the
        arena's pinner thread and returns at once. Over the host budget: ``ValueError`` naming
        it, and nothing is pinned.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise TypeError(f"offload: reserve(nbytes) takes an integer number of bytes, got {type(nbytes).__name__}")
        if nbytes < 0:
            raise ValueError(f"offload: reserve(nbytes) takes a number of bytes >= 0, got {nbytes}")
        if nbytes == 0:
            return 0
        sizes = self.arena.sizes_for(nbytes, blocks_if_unknown=self.schedule.num_layers)
        return self.arena.preallocate(sizes, background=background)

    def register_module_storages(self, *modules: torch.nn.Module) -> None:
        """Keep on the GPU every saved tensor over the memory of these modules' parameters and
        buffers (views and aliases such as ``.data`` included): offloading it frees nothing.

        Replaces what was registered before; call again after moving the modules' parameters.
        Parameters themselves and views of them are kept without this.
        """
        self.policy.set_module_storages(modules)

    # -- stats -----------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Figures of the last finished step (or of the step in progress if none finished)."""
        counters = self.last_finished
        if counters is None:
            counters = self.step.counters if self.step is not None else StepCounters(step=0, mode=self.mode)
        return snapshot(
            counters,
            pinned_bytes_held=self.arena.counters.bytes_held,
            native=self.transport.use_native,
            transport=self.transport.name,
            host_budget_bytes=self.arena.budget_bytes,
            host_budget_source=self.arena.budget_source,
            host_numa_node=self.arena.numa.node,
            host_numa_source=self.arena.numa.source,
        )

    def report(self) -> str:
        """A readable table of :meth:`stats`."""
        return format_report(self.stats())
