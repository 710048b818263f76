"""Host memory: pinned blocks for offloaded groups, and the native extension's Python face.

Its one job: have pinned host memory ready where and when the engine asks, within a budget and
what the node can spare.

- ``arena``: the blocks groups are copied into, reused across steps, tagged with the event of
  their last copy so a writer waits on the GPU rather than on the host;
- ``pinning``: pinning blocks (in the background when asked);
- ``numa``: which NUMA node the GPU sits on, and binding blocks there;
- ``blocks``, ``idle``: a lent block's bookkeeping, and the idle blocks (which serves a request,
  which goes first when the arena shrinks);
- ``ledger``: every pinned byte the process holds, across contexts, within the process's budget
  and the node's room;
- ``node``: what the node's memory can give (available, less a floor for others; the memory
  cgroup's limit), or a simulated node for tests and benchmarks;
- ``room``: the bound the plans' needs set on what is held, and the one host figure plans read;
- ``layout``: the one layout function (byte offsets of a group's slots, 256-byte aligned);
- ``native``: the built extension ``offload._C`` or its pure-Python fallback.

It imports nothing from the rest of the package.
"""
