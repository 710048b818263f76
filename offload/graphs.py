"""CUDA-graph support: a whole step captured with offloading inside, and graphed layers that offload.

Two ways to put offloading into CUDA graphs:

1. **Whole step.** Run forward and backward, with the offload context inside, under
   ``torch.cuda.graph`` (or :class:`StepGraph`, which adds warm-up, static inputs and the shape
   check). The engine notices the capture when the step's first layer starts and records the
   same schedule into the graph: D2H and H2D copies on its side streams, the waits that order
   them, the reload buffers (from the graph's private pool). Replays then run it all with no
   Python. What it needs:

   - pinned host blocks that already exist: pinning memory synchronises the device, which a
     capture forbids. Run one eager step with offloading first; ``retain_pinned_cpu_buffers=True``
     keeps every block it used (a capture started with an empty arena raises ``CaptureError``).
   - the whole step inside the capture: forward and backward both, since a copy recorded into a
     graph only happens on replay.

   The host regions the capture used belong to the graph from then on (replays write and read
   them), so the arena never lends them to an eager step again.

2. **Graphed layers** (:func:`make_graphed_callables`). Each layer becomes a forward graph and a
   backward graph (``torch.cuda.make_graphed_callables``). With ``offload=`` the layer's saved
   tensors are offloaded inside its forward graph and reloaded inside its backward graph: a
   *local group* of the engine (see ``lifecycle.py``), released at the end of the forward so that
   its memory in the graphs' shared pool is reused by the layers captured after it. Such layers
   mix with eager layers in one model; the eager layers keep the engine's normal schedule.

   A call may pass ``cuda_graph_stream``: the replay then runs on that stream after it waits on
   the current one, and the current stream resumes once the replay is done, or, when
   ``cuda_graph_event`` is given too, as soon as that event (recorded inside the graph, such as
   the layer's :attr:`GraphedLayer.compute_done_event`) has fired. What runs after the event on
   the side stream is the layer's D2H tail; the next replay of any graph of the same set is
   ordered after that tail, because those graphs share one memory pool and a later graph may
   reuse the memory the tail is still reading.

Shapes: a graph replays fixed addresses and sizes. Every replay checks its inputs against the
sample the graph was captured with (shape, dtype, device, requires_grad) and refuses a mismatch.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch.utils import _pytree

from .host.arena import CaptureError
from .engine.core import OffloadEngine
from .keywords import parameter_names, reject_unknown
from .engine.stats import StepCounters, snapshot

__all__ = ["CaptureError", "GraphedLayer", "StepGraph", "make_graphed_callables"]


# -- checks --------------------------------------------------------------------------------------
class InputSignature:
    """Shape, dtype, device and requires_grad of the tensors a graph was captured with."""

    def __init__(self, sample: Sequence[torch.Tensor]) -> None:
        self.specs = [(tuple(t.shape), t.dtype, t.device, t.requires_grad) for t in sample]

    @staticmethod
    def _describe(spec: tuple[Any, ...]) -> str:
        shape, dtype, device, requires_grad = spec
        return f"shape {list(shape)}, {dtype}, {device}, requires_grad={requires_grad}"

    def check(self, args: Sequence[Any], what: str) -> None:
        """Raise ``ValueError`` unless ``args`` match the captured sample exactly."""
        if len(args) != len(self.specs):
            raise ValueError(f"offload: {what} was captured with {len(self.specs)} tensor inputs and got {len(args)}")
        for i, (arg, spec) in enumerate(zip(args, self.specs)):
            if not isinstance(arg, torch.Tensor):
                raise ValueError(f"offload: input {i} of {what} must be a tensor (as captured), got {type(arg).__name__}")
            got = (tuple(arg.shape), arg.dtype, arg.device, arg.requires_grad)
            if got != spec:
                raise ValueError(
                    f"offload: input {i} of {what} was captured with {self._describe(spec)} and got "
                    f"{self._describe(got)}. A CUDA graph replays fixed memory and sizes, so it is "
                    "not replayed for other inputs: capture again with the new sample inputs, or "
                    "run this input eagerly."
                )


def _check_stream_and_event(stream: Any, event: Any) -> None:
    if event is not None and stream is None:
        raise ValueError(
            "offload: cuda_graph_event was given without cuda_graph_stream. The event lets the "
            "current stream go on before a replay on a *dedicated* stream has finished; on the "
            "current stream there is nothing to skip. Pass cuda_graph_stream too, or drop the event."
        )
    if stream is not None and not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"offload: cuda_graph_stream must be a torch.cuda.Stream, got {type(stream).__name__}")
    if event is not None and not isinstance(event, torch.cuda.Event):
        raise TypeError(f"offload: cuda_graph_event must be a torch.cuda.Event, got {type(event).__name__}")


def _engine_of(offload: Any) -> Optional[OffloadEngine]:
    if offload is None:
        return None
    engine = getattr(offload, "engine", offload)
    if not isinstance(engine, OffloadEngine):
        raise TypeError(
            "offload: offload= must be the context of get_cpu_offload_context (enabled=True), an "
            f"OffloadActivations, or None; got {type(offload).__name__}"
        )
    if engine.transport.name != "cuda":
        raise ValueError("offload: graphed layers offload through CUDA; this offload context was built with device='cpu'")
    return engine


def _normalize(callables: Any, sample_args: Any) -> tuple[bool, tuple[Any, ...], tuple[tuple[torch.Tensor, ...], ...]]:
    single = not isinstance(callables, (tuple, list))
    funcs = (callables,) if single else tuple(callables)
    if not funcs:
        raise ValueError("offload: make_graphed_callables needs at least one callable")
    if not isinstance(sample_args, (tuple, list)):
        raise TypeError("offload: sample_args must be a tuple of tensors (one callable) or a tuple of such tuples")
    samples = (tuple(sample_args),) if single else tuple(tuple(a) if isinstance(a, (tuple, list)) else (a,) for a in sample_args)
    if len(samples) != len(funcs):
        raise ValueError(f"offload: {len(funcs)} callables but {len(samples)} sets of sample_args; give one tuple per callable")
    for i, (func, args) in enumerate(zip(funcs, samples)):
        if not callable(func):
            raise TypeError(f"offload: callable {i} is a {type(func).__name__}, not a module or function")
        if isinstance(func, torch.nn.Module) and (func._forward_hooks or func._forward_pre_hooks or func._backward_hooks):
            raise ValueError(
                f"offload: module {i} has hooks registered; torch cannot graph a module with hooks. "
                "Graph the layers first, then build OffloadActivations (or other hooks) on the result."
            )
        for j, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                raise TypeError(f"offload: sample_args[{i}][{j}] is a {type(a).__name__}; graphed callables take tensors only")
    return single, funcs, samples


# -- graphed layers ------------------------------------------------------------------------------
class GraphSet:
    """The graphs of one :func:`make_graphed_callables` call, which share one memory pool.

    ``tail``: a stream on which a replay may still run past the event its caller resumed at. The
    next replay from the set waits for it first (see the module notes).
    """

    def __init__(self) -> None:
        self.tail: Optional[torch.cuda.Stream] = None

    def join_tail(self, stream: torch.cuda.Stream) -> None:
        """Order ``stream`` after the pending tail, if there is one on another stream."""
        tail = self.tail
        if tail is not None and tail != stream:
            stream.wait_stream(tail)
        self.tail = None

    def replay(self, graphed: Callable[..., Any], args: tuple[Any, ...], stream: Optional[torch.cuda.Stream], event: Optional[torch.cuda.Event]) -> Any:
        """Run ``graphed`` on ``stream`` (or the current one) and resume at ``event`` (or the end)."""
        current = torch.cuda.current_stream()
        if stream is None:
            self.join_tail(current)
            return graphed(*args)
        self.join_tail(stream)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            out = graphed(*args)
        if event is None:
            current.wait_stream(stream)
            return out
        current.wait_event(event)
        self.tail = stream
        # Backward replays of this set may reuse the memory the tail reads too; the first one
        # comes after the gradient of this output, so the tail is joined there (if still pending).
        first = next((t for t in _pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if first is not None:
            first.register_hook(_JoinTailInBackward(self))
        return out


class _JoinTailInBackward:
    """Gradient hook: the current (backward) stream waits for the set's pending tail."""

    __slots__ = ("graphs",)

    def __init__(self, graphs: GraphSet) -> None:
        self.graphs = graphs

    def __call__(self, grad: torch.Tensor) -> None:
        if self.graphs.tail is not None:
            self.graphs.join_tail(torch.cuda.current_stream())


class GraphedLayer(torch.nn.Module):
    """One layer as captured by :func:`make_graphed_callables`; call it like the layer.

    Extra keyword arguments of a call: ``cuda_graph_stream`` and ``cuda_graph_event`` (see the
    module notes). Attributes: ``module`` (the original layer, whose parameters it uses),
    ``compute_done_event`` (an external event the forward graph records after the layer's
    compute and before its offload copies), ``index`` (its position in the call).
    """

    def __init__(self, module: Callable[..., Any], index: int, engine: Optional[OffloadEngine]) -> None:
        super().__init__()
        if isinstance(module, torch.nn.Module):
            self.module = module  # registered: its parameters are the graphs' parameters
        self.__dict__["_layer"] = module  # the same callable, kept out of module registration
        self.index = index
        self._engine = engine
        self.counters = StepCounters(step=0, mode="graphed layer")
        # external=True: recorded as a node of the graph, so it fires on every replay and can be
        # waited on from outside the graph (a plain event only orders streams inside a capture).
        self.compute_done_event = torch.cuda.Event(external=True) if torch.cuda.is_available() else None
        self._replay: Optional[Callable[..., Any]] = None
        self._signature: Optional[InputSignature] = None
        self._graphs: Optional[GraphSet] = None
        self._captured_training = True

    def forward(self, *args: Any, cuda_graph_stream: Optional[torch.cuda.Stream] = None, cuda_graph_event: Optional[torch.cuda.Event] = None) -> Any:
        """Replay the graphs (after capture) or run the layer eagerly (warm-up, capture, eval)."""
        _check_stream_and_event(cuda_graph_stream, cuda_graph_event)
        if self._replay is not None and self.training == self._captured_training:
            self._signature.check(args, f"graphed layer {self.index}")  # type: ignore[union-attr]
            return self._graphs.replay(self._replay, args, cuda_graph_stream, cuda_graph_event)  # type: ignore[union-attr]
        return self._run_layer(args)

    def _run_layer(self, args: tuple[Any, ...]) -> Any:
        engine = self._engine
        if engine is None:
            out = self._layer(*args)
            self._record_compute_done()
            return out
        engine.begin_local_group(self.index, self.counters)
        try:
            out = self._layer(*args)
        except BaseException:
            engine.end_local_group(failed=True)
            raise
        self._record_compute_done()
        engine.end_local_group()
        return out

    def _record_compute_done(self) -> None:
        event = self.compute_done_event
        if event is not None and torch.cuda.is_current_stream_capturing():
            event.record()

    def install(self, replay: Callable[..., Any], sample: Sequence[torch.Tensor], graphs: GraphSet) -> None:
        """Hand the layer its captured replay function (``torch.cuda.make_graphed_callables``'s)."""
        self._replay = replay
        self._signature = InputSignature(sample)
        self._graphs = graphs
        self._captured_training = self.training

    def stats(self) -> dict[str, Any]:
        """What the layer's graphs offload per replay (bytes, tensors; captured copies are not timed)."""
        engine = self._engine
        return snapshot(
            self.counters,
            pinned_bytes_held=engine.arena.counters.bytes_held if engine else 0,
            native=engine.transport.use_native if engine else False,
            transport=engine.transport.name if engine else "none",
            host_budget_bytes=engine.arena.budget_bytes if engine else 0,
            host_budget_source=engine.arena.budget_source if engine else "",
        )


def _warm_up(layers: Sequence[GraphedLayer], samples: Sequence[tuple[torch.Tensor, ...]], iterations: int, allow_unused_input: bool) -> None:
    # All forwards first, then the backwards in reverse, as they will be captured: every
    # offloading layer then holds its own host block at once, and those blocks are what the
    # captures reuse. A side stream keeps warm-up work out of the caller's stream, as torch does.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(iterations):
            outputs = [_pytree.tree_leaves(layer(*args)) for layer, args in zip(layers, samples)]
            for layer, args, outs in reversed(list(zip(layers, samples, outputs))):
                needing = tuple(o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad)
                inputs = tuple(a for a in args if a.requires_grad) + tuple(p for p in layer.parameters() if p.requires_grad)
                if needing and inputs:
                    torch.autograd.grad(
                        needing, inputs, grad_outputs=tuple(torch.zeros_like(o) for o in needing),
                        allow_unused=allow_unused_input,
                    )
            del outputs
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


def make_graphed_callables(
    callables: Any,
    sample_args: Any,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Any = None,
    *,
    offload: Any = None,
    pre_warmup_hook: Optional[Callable[[], None]] = None,
    post_warmup_hook: Optional[Callable[[], None]] = None,
    **unknown: Any,
) -> Union[GraphedLayer, tuple[GraphedLayer, ...]]:
    """Graph layers with ``torch.cuda.make_graphed_callables``, optionally offloading inside.

    ``callables`` / ``sample_args`` / ``num_warmup_iters`` / ``allow_unused_input`` / ``pool`` are
    torch's. ``offload``: an offload context (``get_cpu_offload_context``'s first element or an
    ``OffloadActivations``) whose engine offloads each layer's saved tensors inside its graphs
    (None: the graphs do not offload). ``pre_warmup_hook`` / ``post_warmup_hook`` run once,
    before the first and after the last warm-up iteration.

    Returns a :class:`GraphedLayer` per callable (one, not a tuple, for a single callable).
    """
    reject_unknown("make_graphed_callables", unknown, parameter_names(make_graphed_callables))
    single, funcs, samples = _normalize(callables, sample_args)
    for name, hook in (("pre_warmup_hook", pre_warmup_hook), ("post_warmup_hook", post_warmup_hook)):
        if hook is not None and not callable(hook):
            raise TypeError(f"offload: {name} must be callable or None, got {type(hook).__name__}")
    if not isinstance(num_warmup_iters, int) or num_warmup_iters < 0:
        raise ValueError(f"offload: num_warmup_iters must be an integer >= 0, got {num_warmup_iters!r}")
    engine = _engine_of(offload)
    if not torch.cuda.is_available():
        raise RuntimeError("offload: make_graphed_callables needs CUDA, which is not available here")
    for i, args in enumerate(samples):
        if any(not a.is_cuda for a in args):
            raise ValueError(f"offload: sample_args of callable {i} must all be CUDA tensors")

    layers = tuple(GraphedLayer(func, i, engine) for i, func in enumerate(funcs))
    if pre_warmup_hook is not None:
        pre_warmup_hook()
    _warm_up(layers, samples, num_warmup_iters, allow_unused_input)
    if post_warmup_hook is not None:
        post_warmup_hook()
    for layer in layers:  # the figures of the capture are those of every replay
        layer.counters = StepCounters(step=0, mode="graphed layer", captured=True)
    # torch captures each forward, then each backward in reverse, into one shared pool; our
    # warm-up already ran, so torch's own is skipped.
    captured = torch.cuda.make_graphed_callables(layers, samples, num_warmup_iters=0, allow_unused_input=allow_unused_input, pool=pool)
    graphs = GraphSet()
    for layer, args in zip(captured, samples):
        # torch replaced ``forward`` by its replaying function; ours wraps it with the checks.
        replay = layer.forward
        del layer.forward  # back to GraphedLayer.forward, which calls ``replay``
        layer.install(replay, args, graphs)
    return captured[0] if single else tuple(captured)


# -- whole step ----------------------------------------------------------------------------------
class StepGraph:
    """A whole training step (forward and backward, offloading inside) captured once, replayed.

    ``step_fn(*inputs)`` runs one step on its inputs and returns what the caller wants to read
    (loss, outputs); it should set parameter gradients to None before its backward, so that the
    captured backward writes fresh gradients on every replay instead of accumulating.
    ``sample_args`` fix the input shapes; ``warmup_steps`` eager steps run first (on a side
    stream) so the offload arena holds the pinned blocks the capture needs.

    Call it with new inputs: they are copied into the graph's static inputs and the graph is
    replayed; the returned tensors are the graph's static outputs (overwritten by the next
    replay: clone what you keep).
    """

    def __init__(self, step_fn: Callable[..., Any], sample_args: Sequence[torch.Tensor], *, warmup_steps: int = 2, pool: Any = None, **unknown: Any) -> None:
        reject_unknown("StepGraph", unknown, parameter_names(StepGraph.__init__))
        if not callable(step_fn):
            raise TypeError(f"offload: step_fn must be callable, got {type(step_fn).__name__}")
        sample = tuple(sample_args)
        if any(not isinstance(a, torch.Tensor) for a in sample):
            raise TypeError("offload: StepGraph sample_args must be tensors")
        if not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(
                f"offload: warmup_steps must be an integer >= 1, got {warmup_steps!r}: the eager "
                "steps create the pinned host blocks the capture reuses"
            )
        if not torch.cuda.is_available():
            raise RuntimeError("offload: StepGraph needs CUDA, which is not available here")
        self.signature = InputSignature(sample)
        self.static_inputs = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in sample)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup_steps):
                step_fn(*self.static_inputs)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.static_outputs = step_fn(*self.static_inputs)

    def __call__(self, *args: torch.Tensor) -> Any:
        """Copy ``args`` into the static inputs and replay the step; returns the static outputs."""
        self.signature.check(args, "the captured step")
        with torch.no_grad():
            for static, new in zip(self.static_inputs, args):
                if static.data_ptr() != new.data_ptr():
                    static.copy_(new)
        self.graph.replay()
        return self.static_outputs
