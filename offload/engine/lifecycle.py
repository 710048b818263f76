"""The engine's step and layer lifecycle: where a step and each layer begin and end.

Separate because this is the engine's bookkeeping once per layer and once per step, in the order
its callers drive it: which step is running, which layer's group is open, when the forward ends,
when a step is finished, and which steps (micro-batches) are still waiting for their backward.
The schedule hears of each event here; the tensors themselves go through ``offload.engine.packing``, and
the copies through ``offload.engine.copies``.

Layer boundaries. In TransformerEngine's call shape the saved-tensor hooks are pushed by each
layer's ``with ctx`` (only for layers the schedule offloads) and a step is ``model_layers`` layer
contexts. ``OffloadActivations`` instead pushes the hooks once around the whole forward and only
switches the open group at layer boundaries, so that a ``torch.utils.checkpoint`` inside the
forward pushes its own hooks *inside* ours and wins for the tensors of the region it recomputes
(only the checkpoint's inputs reach us). Tensors saved between two layers join the next layer's
group: a checkpoint wrapped around a layer's ``__call__`` (transformers 5.17) saves the layer's
inputs just before its pre-hook runs. A layer entered while autograd runs a backward is a
checkpoint recomputing it, and a layer entered under ``no_grad`` outside a training forward saves
nothing: both are *passive* (not counted, nothing recorded). A ``no_grad`` layer inside an autograd
Function's forward is not passive: that is a reentrant checkpoint running a training forward's
layer (perhaps its first), and it keeps its number so that the right layers are offloaded.

The step's groups are held weakly: autograd's handles keep them alive, and the handles never
hold a node of the graph (``offload.engine.packing``), so a graph that is dropped frees them. A forward
whose graph is dropped before its backward (an exception between layers, a skipped backward)
frees its groups, which marks the step abandoned, so the next layer starts a fresh step instead
of counting on. Backward reaching a step whose forward is still open (fewer layer contexts than
``model_layers``) ends that forward, with a warning that says what was seen.

A forward that raises inside a layer or an ``OffloadActivations`` ``with`` goes through one
transition, :meth:`abort_step`: the hooks are popped, the open and pending groups and their host
claims dropped, the schedule told (``Schedule.on_abort``: v1 holds groups in its queue), and the
step forgotten. Nothing else of the step is held by the engine, so everything it saved dies with
the graph; a group that dies with a prefetch unread makes the compute stream wait for that copy
before its buffer can be reused (``offload.engine.copies``).

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

import sys
import threading
from typing import TYPE_CHECKING, Optional

import torch
from torch.autograd.function import FunctionCtx

from ..host.arena import CaptureError, HostArena
from .diagnose import nothing_offloaded
from .forward import ForwardState, Phase

# Module globals: one lookup each on the per-layer path.
_BETWEEN = Phase.BETWEEN
_IN_LAYER = Phase.IN_LAYER
_profiling = torch._C._autograd._profiler_enabled  # one C call (~50 ns)
from .group import Group, GroupState
from .policy import SelectionPolicy
from .stats import StepCounters
from .step import BackwardReach, InFlight, StepState

if TYPE_CHECKING:
    from .schedules.base import Schedule
    from .transport import Transport


def inside_function_forward(max_frames: int = 64) -> bool:
    """Whether the caller runs inside the ``forward`` of an ``torch.autograd.Function`` (such as
    ``torch.utils.checkpoint``'s reentrant ``CheckpointFunction``).

    Autograd keeps no flag for it, so the Python frames are read: a ``forward`` whose first
    argument is a Function's context. Asked only for a layer entered under no_grad with no
    forward open (never on a training step's hot path); a few microseconds per such layer.
    """
    frame = sys._getframe(1)
    for _ in range(max_frames):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "forward" and code.co_argcount and code.co_varnames[0] == "ctx" \
                and isinstance(frame.f_locals.get("ctx"), FunctionCtx):
            return True
        frame = frame.f_back
    return False


class StepLifecycleMixin:
    """The step and layer lifecycle of :class:`offload.engine.OffloadEngine`: each event moves
    ``self.forward`` (:class:`~offload.engine.forward.ForwardState`) by one checked transition,
    then tells the schedule."""

    # The engine's parts used here (set up in OffloadEngine.__init__); the step's state is in
    # ``forward`` alone.
    policy: SelectionPolicy
    schedule: Schedule
    transport: Transport
    arena: HostArena
    mode: str
    model_layers: int
    layer_contexts: bool
    forward: ForwardState
    last_finished: Optional[StepCounters]
    in_flight: InFlight
    _warned: set[str]
    _hooks: torch.autograd.graph.saved_tensors_hooks
    _profiled_hooks: torch.autograd.graph.saved_tensors_hooks
    _local_hooks: torch.autograd.graph.saved_tensors_hooks

    if TYPE_CHECKING:  # the other parts' methods used here
        def warn_once(self, key: str, message: str) -> None: ...
        def start_offload(self, group: Group) -> None: ...
        def release(self, group: Group) -> None: ...
        def _group_freed(self, group: Group) -> None: ...
        def _join_side_streams(self, counters: StepCounters) -> None: ...

    def _push_hooks(self) -> None:
        # The hooks are pushed at each offloaded layer (or once a forward), so the profiler is
        # asked here rather than at each of the thousands of packs and unpacks a step makes:
        # while one runs, the pair that names its work (offload::pack, offload::unpack) goes
        # on. Popping needs no choice: either object's exit pops the top pair.
        (self._profiled_hooks if _profiling() else self._hooks).__enter__()

    @property
    def step(self) -> Optional[StepState]:
        """The step started last (its forward open, or waiting for its backward), or None."""
        return self.forward.step

    # -- steps -----------------------------------------------------------------------------------
    def begin_step(self, captured: Optional[bool] = None) -> None:
        """Start a new step, finishing the previous one's bookkeeping.

        ``captured``: whether the current stream is capturing a CUDA graph (asked if None).
        """
        if captured is None:
            captured = self.transport.capturing()
        forward = self.forward
        previous = forward.step
        if previous is not None:
            if captured or not self.in_flight.admit(previous):
                # Trimming idle blocks waits on their events on the host: not under capture.
                self._finish(previous, trim=not captured)
            # Let go of its groups now: freed, they hand their host regions back to the arena,
            # where a capture starting with this step looks for them.
            forward.let_go()
            del previous
        for stale in self.in_flight.stale():
            self._finish(stale, trim=False)
        if captured:
            self._check_capture_ready("a step")
        index = forward.step_index + 1
        self.in_flight.start(index)
        counters = StepCounters(step=index, mode=self.mode, captured=captured)
        counters.pinned_allocations = -self.arena.counters.pinned_allocations
        forward.start_step(StepState(index=index, counters=counters, captured=captured), threading.get_ident())
        self.schedule.on_step_start(self)

    def step_state(self, index: int) -> Optional[StepState]:
        """The step (micro-batch) of that index: the current one or one still in flight."""
        step = self.forward.step
        if step is not None and step.index == index:
            return step
        return self.in_flight.get(index)

    def micro_batches(self) -> list[StepState]:
        """Every step in flight: the earlier ones waiting for their backward, then the current."""
        steps = list(self.in_flight.values())
        step = self.forward.step
        if step is not None and not step.counters.finished:
            steps.append(step)
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

    # -- layers ----------------------------------------------------------------------------------
    def _passive_layer(self, forward_open: bool) -> bool:
        # Inside a backward (autograd's graph task is set): a checkpoint recomputing a layer.
        # Under no_grad with no training forward open: an eval forward, which saves nothing,
        # unless it runs inside an autograd Function's forward (a reentrant checkpoint, which
        # runs its layers under no_grad and saves their inputs itself): that is a training
        # forward's layer, perhaps its first. A no_grad layer *inside* an open training forward
        # (a frozen layer, a reentrant checkpoint) counts too, so that the layer numbering
        # matches the model.
        if torch._C._current_graph_task_id() != -1:
            return True
        if forward_open or torch.is_grad_enabled():
            return False
        return not inside_function_forward()

    def next_layer(self) -> Optional[int]:
        """The index :meth:`begin_layer` would give the layer entered now, or None when it
        would be passive (see the module notes)."""
        forward = self.forward
        forward_open = forward.forward_open()
        if forward.passive_depth or self._passive_layer(forward_open):
            return None
        return forward.step.layers_started if forward_open else 0  # type: ignore[union-attr]

    def begin_layer(self) -> bool:
        """Forward enters the next layer: schedule decisions, then capture its saved tensors.

        Returns False for a passive layer (see the module notes): nothing is tracked until the
        matching :meth:`end_layer`. Atomic: if it raises, the engine is as it was.
        """
        forward = self.forward
        forward_open = forward.forward_open()
        if forward.passive_depth or self._passive_layer(forward_open):
            forward.passive_depth += 1
            return False
        new_step = not forward_open
        if not new_step and threading.get_ident() != forward.thread:
            raise RuntimeError(
                "offload: a layer was entered from another thread while this offload context "
                "runs a forward in its own thread; one context serves one forward at a time, "
                "and two concurrent forwards would mix their layers into one step. Give each "
                "thread (each model or micro-batch stream run concurrently) its own context: "
                "one get_cpu_offload_context(...) or OffloadActivations(...) per stream"
            )
        if forward.phase is _IN_LAYER:
            raise RuntimeError(
                "offload: a layer context was entered while another is still open; offload "
                "contexts do not nest: close the outer layer's `with` before entering the next "
                "(with OffloadActivations, pass layers that do not contain one another)"
            )
        captured = self.transport.capturing()
        layer = 0 if new_step else forward.step.layers_started  # type: ignore[union-attr]
        offloads = torch.is_grad_enabled() and self.schedule.offloads(layer)
        push = offloads and self.layer_contexts
        if push:
            # First, before any state changes: pushing raises under
            # torch.autograd.graph.disable_saved_tensors_hooks, and the engine must stay usable.
            self._push_hooks()
        try:
            if new_step:
                self.begin_step(captured)
            step = forward.step
            if captured != step.captured:  # type: ignore[union-attr]
                raise CaptureError(
                    "offload: a step's layers must all run under the same CUDA-graph capture or all "
                    f"eagerly, but layer {step.layers_started} {'is' if captured else 'is not'} being "  # type: ignore[union-attr]
                    "captured and the step's first layer was "
                    f"{'not ' if captured else ''}captured; capture the whole forward and backward"
                )
        except BaseException:
            if push:
                self._hooks.__exit__(None, None, None)
            raise
        step.layers_started += 1  # type: ignore[union-attr]
        group = forward.take_pending()
        if group is not None and (not offloads or group.top != layer):
            self._keep_pending(group, step)  # type: ignore[arg-type]
            group = None
        elif group is not None and group.layer != layer:
            # A small group carried on (``Schedule.joins_next``): this layer joins it. The
            # schedule is not told: nothing it holds changed since the group's first layer began.
            step.groups[layer] = group  # type: ignore[union-attr]
            forward.enter_layer(layer, group, push)
            return True
        if offloads and group is None:
            group = self._new_group(layer, step)  # type: ignore[arg-type]
        forward.enter_layer(layer, group, push)
        self.schedule.on_layer_start(self, layer)
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
        forward = self.forward
        if forward.phase is not _BETWEEN or forward.passive_depth or not forward.forward_open():
            return None
        step = forward.step
        layer = step.layers_started  # type: ignore[union-attr]
        group = forward.pending_group
        if group is None:
            if not self.schedule.offloads(layer):
                return None
            group = self._new_group(layer, step)  # type: ignore[arg-type]
            forward.open_pending(group)
        return group

    def end_layer(self, failed: bool = False) -> Optional[int]:
        """Forward left the layer: close its group and let the schedule start its D2H.

        Returns the layer's index, or None for a passive layer or after a failure.
        """
        forward = self.forward
        if forward.passive_depth:
            forward.passive_depth -= 1
            forward.last_closed = None
            return None
        if forward.phase is not _IN_LAYER:
            forward.last_closed = None
            return None
        if failed:
            self.abort_step()
            return None
        if forward.layer_hooks:
            self._hooks.__exit__(None, None, None)
        group = forward.exit_layer()
        step = forward.step
        layer = forward.layer
        if group is not None and not step.forward_done and self.schedule.joins_next(group, layer):  # type: ignore[union-attr]
            # Too small to be copied on its own: it stays open as the next layer's group, and
            # the schedule has nothing to start (``Schedule.joins_next``).
            group.top = layer + 1
            forward.open_pending(group)
            return layer
        if group is not None:
            group = self._close(group, step)  # type: ignore[arg-type]
        self.schedule.on_layer_end(self, layer, group)
        if step.forward_done or self.layer_contexts and step.layers_started >= self.model_layers:  # type: ignore[union-attr]
            self.end_forward()
        return layer

    def _close(self, group: Group, step: StepState) -> Optional[Group]:
        # Lay the group out, or forget it when nothing was saved into it.
        self.arena.unclaim(group.take_claim())
        if len(group.table):
            group.close()
            step.unconsumed += 1
            return group
        group.state = GroupState.KEPT  # nothing saved: nothing to do, ever
        step.groups.pop(group.layer, None)
        return None

    def _keep_pending(self, pending: Group, step: StepState) -> None:
        # Tensors saved between layers for a layer that did not offload (or never came): they
        # stay on the GPU, and the host bytes claimed for them go back.
        pending = self._close(pending, step)
        if pending is not None:
            pending.mark_kept()

    # -- OffloadActivations' forward and its end -------------------------------------------------
    def begin_forward(self) -> bool:
        """OffloadActivations' entry: start a step and push the hooks for the whole forward.

        Returns False (and does nothing) under ``no_grad``, where a forward saves nothing.
        Atomic like :meth:`begin_layer`.
        """
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return False
        self._push_hooks()  # first: it may raise, and then nothing has changed
        try:
            self.begin_step()
        except BaseException:
            self._hooks.__exit__(None, None, None)
            raise
        self.forward.forward_hooks = True
        return True

    def _pop_forward_hooks(self) -> None:
        forward = self.forward
        if forward.forward_hooks:
            forward.forward_hooks = False
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
        forward = self.forward
        step = forward.step
        if step is None:
            return
        pending = forward.end_forward()
        if pending is not None:
            # Saved after the last layer that ran, for a layer that never came: keep it here.
            self._keep_pending(pending, step)
        if step.forward_done:
            return
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

    def abort_step(self) -> None:
        """Forget the step after an exception in forward; the next layer starts a fresh step.

        The one transition out of a failed forward, from any point of it: the hooks are popped,
        the open and pending groups, the schedule's references and the host bytes claimed for
        them are dropped, and the step is forgotten. The engine then holds nothing of the step:
        its groups (held weakly) die with whatever autograd graph still references them, and
        a group that dies with a copy in flight is ordered after it (``_group_freed``), so no
        GPU or host memory stays behind and none is reused too early.
        """
        forward = self.forward
        if forward.layer_hooks:
            forward.layer_hooks = False
            self._hooks.__exit__(None, None, None)
        self._pop_forward_hooks()
        step = forward.abort()
        if step is None:
            return
        for group in step.groups.values():
            if group.state is GroupState.OPEN:
                self.arena.unclaim(group.take_claim())
                group.saved_bytes = 0
        self.schedule.on_abort(self, step)

    # -- backward markers ------------------------------------------------------------------------
    def on_backward_reach(self, step: int, layer: int) -> None:
        """Called by the backward markers: backward is about to run ``layer`` of ``step`` (the
        current step or an earlier micro-batch still in flight; any other is done with)."""
        state = self.step_state(step)
        if state is None:
            return
        if state is self.forward.step and not state.forward_done:
            self._backward_started(state)
        state.reached = layer
        self.schedule.on_backward_reach(self, state, layer)

    def attach_backward_marker(self, tensor: torch.Tensor, layer: int) -> None:
        """Fire ``on_backward_reach(layer)`` when the gradient of ``tensor`` is computed."""
        forward = self.forward
        step = forward.step
        if step is None or not tensor.requires_grad:
            return
        carried = forward.pending_group
        if carried is not None and carried.layer <= layer < carried.top:
            # A layer inside a group that small layers share (``Schedule.joins_next``): backward
            # reaching the group's top layer reloads all of it, and prefetches below its first
            # layer, so a marker here would find nothing to do.
            return
        marker = BackwardReach(self, step.index, layer)
        node = tensor.grad_fn
        if node is not None:
            # A pre-hook of the node that made the tensor fires at the same point (a non-leaf
            # tensor's own hooks are run as that node's pre-hooks) for less host time (6 against
            # 10 us a call on our CPU box): Tensor.register_hook also builds a hook dict in Python.
            node.register_prehook(marker)
        else:
            tensor.register_hook(marker)

    # -- finishing a step ------------------------------------------------------------------------
    def _check_finished(self, step: StepState) -> None:
        # A step is finished once its forward is done and every group was handed back in full.
        if step.forward_done and step.unconsumed <= 0:
            if step.captured and not step.counters.finished:
                # Still inside the capture (the last unpack of its backward): join the side
                # streams this step forked, or the capture cannot end.
                self._join_side_streams(step.counters)
            self._finish(step)

    def _finish(self, step: StepState, trim: bool = True) -> None:
        if not step.counters.finished:
            step.counters.finished = True
            step.counters.pinned_allocations += self.arena.counters.pinned_allocations
            self._diagnose(step.counters)
        self.last_finished = step.counters
        if self.in_flight:
            self.in_flight.pop(step.index, None)
        # Trim only when the whole wave of micro-batches is done, keeping the blocks any of
        # them used: the next wave (the pipeline's next iteration) asks for them again.
        current = self.forward.step
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
            counters, min_offload_bytes=self.policy.min_offload_bytes, largest_small=largest_small,
            host_room=self.arena.host_room,
        )
        if message is not None:
            self.warn_once("nothing_offloaded", message)

    # -- graphed layers (offload.graphs) ---------------------------------------------------------
    def begin_local_group(self, label: int, counters: StepCounters) -> Group:
        """Collect the saved tensors of one graphed layer's forward into a self-contained group.

        Used by ``offload.graphs`` around a layer's forward while it is warmed up and captured;
        ``label`` names the layer in messages, ``counters`` receive its figures.
        """
        forward = self.forward
        if forward.local_group is not None:
            raise RuntimeError("offload: graphed layers do not nest; a graphed layer's forward called another")
        captured = self.transport.capturing()
        if captured:
            self._check_capture_ready(f"graphed layer {label}")
        group = Group(label, step=0)
        group.local = True
        group.captured = captured
        group.on_free = self._group_freed
        group.counters = counters
        forward.local_group = group
        if torch.is_grad_enabled():
            self._local_hooks.__enter__()
            forward.local_hooks = True
        return group

    def end_local_group(self, failed: bool = False) -> None:
        """Close the graphed layer's group: offload it and release its GPU memory at once.

        Releasing here makes the forward wait for its own D2H, which is what joins the copy
        stream back before the forward graph ends; with ``cuda_graph_event`` the caller's stream
        does not have to wait for that tail (see ``offload.graphs``).
        """
        forward = self.forward
        group = forward.local_group
        if group is None:
            return
        forward.local_group = None
        if forward.local_hooks:
            forward.local_hooks = False
            self._local_hooks.__exit__(None, None, None)
        self.arena.unclaim(group.take_claim())
        group.saved_bytes = 0
        if failed or not len(group.table):
            group.state = GroupState.KEPT  # nothing to move; any handles autograd kept stay valid
            return
        group.close()
        self.start_offload(group)
        self.release(group)
