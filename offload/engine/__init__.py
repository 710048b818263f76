"""The engine: one model's offloading during a step, below every entry point.

Its one job: take the tensors autograd saves, move the chosen ones to pinned host memory on side
streams while compute goes on, and hand them back in backward. The parts, one module each:

- ``core``: ``OffloadEngine``, which owns the parts below and the step state;
- ``lifecycle``: the step state machine (``ForwardState``: which step and layer are open, one
  checked transition per event) and the engine methods that drive it;
- ``packing``: the saved-tensor hooks, the per-tensor hot path;
- ``copies``: the primitives a schedule calls to move a group to the host and back;
- ``step``: one step's groups, counters and micro-batches in flight;
- ``group``: one layer's saved tensors: their states, layout and copies' bookkeeping;
- ``entry_table``: a group's per-tensor records and typed-view restore (C++ in
  ``offload._entries`` where built, this Python reference otherwise);
- ``policy`` and ``marks``: which tensors leave the GPU (the one selection policy);
- ``transport``: the copies themselves, on side streams, with their events;
- ``schedules/``: when each group is offloaded, released and reloaded (v1, v2, planned);
- ``stats``, ``diagnose``, ``eager``: per-step figures, their warnings, hooks that run eagerly.

It sits on ``offload.host`` (pinned memory) and under everything else; it imports nothing from
the front (``offload.api``, ``offload.activations``), the planner's search or the integrations.
"""

from .core import OffloadEngine

__all__ = ["OffloadEngine"]
