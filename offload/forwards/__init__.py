"""Forward stand-ins: replacements of a module's ``forward`` that a plan installs per layer.

Its one job: run a layer the way its plan says (recomputed, selectively recomputed, tiled),
with gradients bitwise equal to the plain forward's.

- ``instance``: the check that a forward set on an instance is ours, and the handle that removes
  a set of stand-ins;
- ``recompute``: a layer recomputed in backward (checkpointing that our hooks see through);
- ``stateful``: a KV cache among a recomputed call's arguments, left as one plain run leaves it;
- ``selective``: keep the GEMM outputs, recompute the cheap ops;
- ``plan_wrappers``: the per-layer wrappers that follow a plan, tiling replayed in recompute.
"""
