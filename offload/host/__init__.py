"""Host memory: pinned blocks for offloaded groups, and the native extension's Python face.

Its one job: have pinned host memory ready where and when the engine asks, within a budget.

- ``arena``: the blocks groups are copied into, reused across steps, tagged with the event of
  their last copy so a writer waits on the GPU rather than on the host;
- ``pinning``: pinning blocks (in the background when asked);
- ``numa``: which NUMA node the GPU sits on, and binding blocks there;
- ``ledger``: every pinned byte the process holds, across contexts;
- ``layout``: the one layout function (byte offsets of a group's slots, 256-byte aligned);
- ``native``: the built extension ``offload._C`` or its pure-Python fallback.

It imports nothing from the rest of the package.
"""
