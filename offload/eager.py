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

So every entry point into offload's code from user code is wrapped with
``torch.compiler.disable``: Dynamo breaks the graph at the call and runs it, and everything it
calls, eagerly. A compiled model then runs as compiled regions between layer boundaries, and
the saved tensors of each compiled region reach the hooks at run time as real tensors, when
AOTAutograd's compiled function saves them for backward (AOTAutograd switches saved-tensor hooks
off while it traces, and inlines only hooks that are ``torch.fx.GraphModule`` s, which ours are not).

Costs: a disabled call costs about 0.4 us more than a plain one (torch 2.13, CPU). The layer
boundaries pay it a few times per layer; the saved-tensor hooks once per saved tensor each way.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

GRAPH_BREAK_REASON = (
    "offload: offloading runs eagerly between compiled regions (a graph break at each layer "
    "boundary, its layers compiled on their own). To compile with fullgraph=True, compile each "
    "layer (torch.compile(layer)) and keep the offload context outside the compiled region."
)


def run_eagerly(fn: F) -> F:
    """``fn``, which Dynamo never traces: compiled code calling it breaks the graph there, and
    ``fn`` runs (with everything it calls) eagerly. Outside compiled code it is just ``fn``."""
    return torch.compiler.disable(fn, reason=GRAPH_BREAK_REASON)  # type: ignore[return-value]


def saved_tensors_hooks(
    pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], Any]
) -> torch.autograd.graph.saved_tensors_hooks:
    """The ``saved_tensors_hooks`` context of ``pack`` and ``unpack``, both run eagerly (autograd
    may call them under a compiled frame, where Dynamo would otherwise compile them)."""
    return torch.autograd.graph.saved_tensors_hooks(run_eagerly(pack), run_eagerly(unpack))
