"""What a probe step wraps around modules to see inside a layer.

Two wrappers stand in for a module's ``forward`` during probe steps only (installed by
:class:`~offload.planner.probe.ProbeStep` at its start, removed at its forward's end, innermost
first out):

- :class:`CandidateForward` around each selective-recompute candidate (a layer's MLP), and
  :class:`FixedSelectiveInside` inside each module the user runs under
  ``offload.selective_recompute`` already. While it runs, the probe
  files the tensors saved inside it apart (``ProbeStep.inside``), counts its positional tensor
  inputs (what a selective checkpoint saves through the hooks instead), and counts, with
  :class:`ExpensiveOutputs`, the GEMM outputs selective recompute would cache and the time their
  kernels take (the rest of the module's time is what its backward recomputes).
- :class:`CheckpointedLayer` around every layer in a low-memory ("recompute") probe step: the
  layer runs under non-reentrant checkpointing, so the step fits wherever checkpointing fits;
  inside it a :class:`CountingPack` hook sees each tensor the layer saves (and hands it on to the
  checkpoint's own hook, which drops it), and in backward the recompute is timed, so the plain
  backward can be told from it. A KV cache among the layer's arguments is left as the plain step
  leaves it (the checkpoint goes through :func:`~offload.forwards.recompute.checkpoint_call`, see
  :mod:`offload.forwards.stateful`); the candidates run once, as in the plain step.

Both hold the probe weakly: a wrapper left behind by an exception must not keep the probe alive.
Both run eagerly (:mod:`offload.engine.eager`): in a compiled model a probed module runs eagerly, since
its timing marks, dispatch mode and counting hooks cannot be traced.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import set_checkpoint_early_stop

from ..engine.eager import run_eagerly
from ..forwards.recompute import checkpoint_call
from ..forwards.selective import EXPENSIVE_OPS

class ProbeStep(Protocol):
    """What the wrappers call on the probe step that installed them
    (:class:`offload.planner.probe.ProbeStep`; a protocol, so that this module, which the probe
    imports, does not import it back)."""

    active: bool

    def run_candidate(self, fn: Callable[..., Any], fixed: bool, args: Any, kwargs: Any) -> Any: ...

    def count_saved(self, t: torch.Tensor) -> None: ...

    def mark_recompute(self, start: bool) -> None: ...


class ExpensiveOutputs(TorchDispatchMode):
    """Counts the distinct storages that :data:`offload.forwards.selective.EXPENSIVE_OPS` output (what
    selective recompute's cache would hold) and marks each such kernel's start and end on the
    probe's clock.

    It holds the storages it counted until it is dropped: a GEMM output freed inside the module
    could otherwise give its address to the next one, which would then not be counted.
    """

    def __init__(self, mark: Callable[[], Any]) -> None:
        super().__init__()
        self.mark = mark
        self.nbytes = 0
        self.spans: list[tuple[Any, Any]] = []
        self._storages: dict[int, Any] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func not in EXPENSIVE_OPS:
            return func(*args, **(kwargs or {}))
        start = self.mark()
        out = func(*args, **(kwargs or {}))
        self.spans.append((start, self.mark()))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.data_ptr() not in self._storages:
                    self._storages[storage.data_ptr()] = storage
                    self.nbytes += storage.nbytes()
        return out


class _Wrapper:
    """A module's ``forward`` stand-in that can be taken off again (see :meth:`remove`)."""

    __slots__ = ("probe", "module", "fn", "previous")

    def __init__(self, probe: ProbeStep, module: torch.nn.Module) -> None:
        self.probe = weakref.ref(probe)
        self.module = module
        self.fn = module.forward
        # An instance attribute set by other code (a selective wrapper, a plan's recompute
        # wrapper) comes back at removal; otherwise the class's forward does.
        self.previous = module.__dict__.get("forward")
        module.forward = self

    def remove(self) -> None:
        """Put back what the module's ``forward`` was."""
        if self.module.__dict__.get("forward") is self:
            if self.previous is not None:
                self.module.forward = self.previous
            else:
                del self.module.forward


class CandidateForward(_Wrapper):
    """Runs a selective candidate while the probe files what it saves apart (see the module
    notes)."""

    __slots__ = ()

    @run_eagerly
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        probe = self.probe()
        if probe is None:
            return self.fn(*args, **kwargs)
        return probe.run_candidate(self.fn, False, args, kwargs)


class FixedSelectiveInside:
    """For a module the user made selective (``offload.selective_recompute``): the probe's
    candidate run goes *inside* its ``SelectiveForward``, around the function it checkpoints, so
    that the dispatch mode counting GEMM outputs runs under selective checkpointing's own mode
    rather than around the checkpoint (measured on the H100: around it, the layers' forward time
    read 1.6-6x too long on LLAMA-2B)."""

    __slots__ = ("probe", "wrapper", "fn")

    def __init__(self, probe: ProbeStep, wrapper: Any) -> None:
        self.probe = weakref.ref(probe)
        self.wrapper = wrapper
        self.fn = wrapper.fn
        wrapper.fn = self

    @run_eagerly
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        probe = self.probe()
        if probe is None:
            return self.fn(*args, **kwargs)
        return probe.run_candidate(self.fn, True, args, kwargs)

    def remove(self) -> None:
        """Give the selective wrapper its function back."""
        if self.wrapper.fn is self:
            self.wrapper.fn = self.fn


class CountingPack:
    """The saved-tensor pack hook inside a checkpointed layer's forward: the probe counts the
    tensor, then the checkpoint's own pack hook (the one in force below this one) takes it.

    ``inside_checkpoint`` tells :mod:`offload.forwards.selective` that a whole-layer checkpoint is
    running, so selective modules inside run plainly, as in a recomputed layer."""

    __slots__ = ("probe", "outer")
    inside_checkpoint = True

    def __init__(self, probe: ProbeStep, outer: Callable[[torch.Tensor], Any]) -> None:
        self.probe = probe
        self.outer = outer

    @run_eagerly
    def __call__(self, t: torch.Tensor) -> Any:
        self.probe.count_saved(t)
        return self.outer(t)


class CheckpointedLayer(_Wrapper):
    """Runs a layer under non-reentrant checkpointing for a low-memory probe step (see the
    module notes). ``timed``: early stop off, so that the recompute in backward runs the whole
    forward and its end can be timed (a calibration step keeps torch's early stop, as a plan's
    recomputed layers run)."""

    __slots__ = ("timed",)

    def __init__(self, probe: ProbeStep, module: torch.nn.Module, timed: bool = True) -> None:
        super().__init__(probe, module)
        self.timed = timed

    @run_eagerly
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        probe = self.probe()
        if probe is None or not probe.active:
            return self.fn(*args, **kwargs)
        if not self.timed:
            return checkpoint_call(self.fn, args, kwargs)
        with set_checkpoint_early_stop(False):
            return checkpoint_call(self._run, args, kwargs)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        probe = self.probe()
        if probe is None:
            return self.fn(*args, **kwargs)
        if torch._C._current_graph_task_id() != -1:  # the recompute, in backward
            probe.mark_recompute(start=True)
            out = self.fn(*args, **kwargs)
            probe.mark_recompute(start=False)
            return out
        outer: Optional[tuple[Any, Any]] = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if outer is None:  # not under the checkpoint's hooks: nothing to count through
            return self.fn(*args, **kwargs)
        with torch.autograd.graph.saved_tensors_hooks(CountingPack(probe, outer[0]), outer[1]):
            return self.fn(*args, **kwargs)
