"""torch.compile: offload's code always runs eagerly, between compiled regions.

What the engine does is host-side bookkeeping with side effects (groups, arena regions, streams,
events, counters); none of it belongs in a graph. Left to itself, Dynamo traces into it wherever
compiled code reaches it, and that goes wrong in several ways (torch 2.11 and 2.13):

- a layer context (``with ctx``, ``OffloadActivations``' module hooks, ``sync_function``) called
  from a compiled frame is traced: CUDA events recorded there are rebuilt by Dynamo, so the
  stats read events that never ran ("Both events must be recorded"), and ``Group(...)`` traced
  there makes Dynamo build an example object with ``object.__new__``, whose ``__del__`` then
  runs on a group that never ran ``__init__`` ("Exception ignored ... no attribute 'on_free'");
- the saved-tensor hooks are Python frames that autograd calls. Where they run under a compiled
  frame's eval-frame callback (an op Dynamo left to eager in a compiled forward, a backward run
  inside a compiled function on CPU) Dynamo compiles them, tracing the policy on fake tensors
  with symbolic shapes (``t.nbytes`` then fails, among others).

So every entry point into offload's code from user code is excluded from Dynamo: compiled code
calling it breaks the graph there, and it runs, with everything it calls, eagerly. A compiled
model then runs as compiled regions between layer boundaries, and the saved tensors of each
compiled region reach the hooks at run time as real tensors, when AOTAutograd's compiled function
saves them for backward (AOTAutograd switches saved-tensor hooks off while it traces, and inlines
only hooks that are ``torch.fx.GraphModule`` s, which ours are not).

How, and why not ``torch.compiler.disable``. That wrapper swaps Dynamo's frame callback out and
back in Python on every call: about 4-5 us a call on our H100 host (an ablation), paid by every
saved tensor twice and by each layer boundary. Replacing it (and the tensor hooks of the
backward markers by node pre-hooks) took SMALL's offload overhead from 4.86 to 4.28 ms a step
(medians of an interleaved A/B on the H100). The same two effects cost nothing per call when
they are set once on the function:
- Dynamo's frame evaluator keeps a per-code-object strategy; "skip this frame, and every frame
  it calls" (``FrameAction.SKIP`` for both) is what ``disable`` does at run time, decided once.
  Outside compiled code no frame evaluator is installed at all, so the call is a plain call.
- Dynamo's tracer refuses to inline a function that carries ``_torchdynamo_disable`` (the
  attribute ``disable`` sets on its wrapper) and breaks the graph at the call instead.
Both are torch internals (present in torch 2.11 and 2.13); where either is missing,
:func:`run_eagerly` falls back to ``torch.compiler.disable``. ``tests/test_compile.py`` checks
the behaviour (graph breaks, nothing traced, no noise) and ``tests/test_eager.py`` the mechanism.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Optional, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

GRAPH_BREAK_REASON = (
    "offload: offloading runs eagerly between compiled regions (a graph break at each layer "
    "boundary, its layers compiled on their own). To compile with fullgraph=True, compile each "
    "layer (torch.compile(layer)) and keep the offload context outside the compiled region."
)


def _skip_recursively() -> Optional[Callable[[Any], None]]:
    # The code-object marker of the module notes, or None where this torch lacks it.
    # The C types themselves (torch._dynamo.types re-exports them): importing the torch._dynamo
    # package would add about a second to ``import offload``.
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:
        return None
    strategy = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
    return lambda code: set_code_exec_strategy(code, strategy)


_mark_skipped = _skip_recursively()


def run_eagerly(fn: F) -> F:
    """``fn``, which Dynamo never traces: compiled code calling it breaks the graph there, and
    ``fn`` runs (with everything it calls) eagerly. Outside compiled code it is just ``fn``.

    A plain function (or a bound method, whose function is marked) comes back itself, marked
    (see the module notes), and so does a C function, unmarked; anything else, or a torch
    without the markers, is wrapped with ``torch.compiler.disable``.
    """
    if isinstance(fn, types.BuiltinFunctionType):
        # A C function (the native saved-tensor hooks) has no frame for Dynamo to trace or
        # compile; what it calls in Python is marked on its own.
        return fn
    function = getattr(fn, "__func__", fn)
    code = getattr(function, "__code__", None)
    if _mark_skipped is None or code is None or not isinstance(function, types.FunctionType):
        return torch.compiler.disable(fn, reason=GRAPH_BREAK_REASON)  # type: ignore[return-value]
    _mark_skipped(code)
    function._torchdynamo_disable = True  # type: ignore[attr-defined]
    function._torchdynamo_disable_msg = GRAPH_BREAK_REASON  # type: ignore[attr-defined]
    return fn


def saved_tensors_hooks(
    pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], Any]
) -> torch.autograd.graph.saved_tensors_hooks:
    """The ``saved_tensors_hooks`` context of ``pack`` and ``unpack``, both run eagerly (autograd
    may call them under a compiled frame, where Dynamo would otherwise compile them)."""
    return torch.autograd.graph.saved_tensors_hooks(run_eagerly(pack), run_eagerly(unpack))
