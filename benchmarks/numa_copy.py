"""NUMA: per-GPU D2H and H2D GB/s to pinned memory on the GPU's own node and on another node.

Each GPU copies ``--mib`` MiB (in ``--chunks`` copies, so that the launches of two GPUs overlap
fully) between device memory and a pinned host buffer allocated the way the engine's arena
allocates it (``offload._C.PinnedBuffer``: mmap, the node's policy set by ``mbind`` before the
first touch, touched, registered), on the native copy path the engine uses. Measured:

  1 GPU     GPU 0 alone
  2 GPUs    GPUs 0 and 1 at once (the host's memory system is shared), each GPU's own GB/s

each with the buffer on the GPU's own node (``local``: what the engine does, ``offload.host.numa``)
and, where the host has more than one node, on another node (``remote``). The node the kernel
really put the buffer on is read back (``get_mempolicy``) and printed. On a host with a single
NUMA node there is no remote: the script says so, and shows that the placement path ran (the
buffer asked on node 0, the node read back, what the engine would decide and why).

    python benchmarks/numa_copy.py              # every GPU up to 2, one process
    python benchmarks/numa_copy.py --cpu-smoke  # checks the script on a CPU (host memcpy)

Writes benchmarks/results/numa_copy.json (smoke: results/smoke/).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Env, exit_status, make_parser, print_table, setup, write_json  # noqa: E402

from offload.host import native  # noqa: E402
from offload.host.numa import online_nodes, placement_for_gpu  # noqa: E402


class HostBuffer:
    """A host buffer of the arena's kind on ``node`` (None: no policy), and where it landed."""

    def __init__(self, nbytes: int, node: Optional[int], pinned: bool) -> None:
        ext = native.extension()
        self.raw = ext.PinnedBuffer(nbytes, "register_huge" if pinned else "mapped", numa_node=-1 if node is None else node)
        self.tensor = torch.frombuffer(self.raw, dtype=torch.uint8)
        self.asked = node
        self.bound = self.raw.numa_node if self.raw.numa_node >= 0 else None
        self.error = self.raw.numa_error
        self.landed = ext.node_of_address(self.tensor.data_ptr())  # touched already: it is placed


def copy_rates(env: Env, gpus: list[int], hosts: dict[int, HostBuffer], nbytes: int, chunks: int) -> dict[int, dict[str, float]]:
    """Median GB/s each way for every GPU in ``gpus``, all of them copying at once."""
    ext = native.extension()
    reps = env.args.steps
    out: dict[int, dict[str, list[float]]] = {g: {"d2h": [], "h2d": []} for g in gpus}
    if not env.cuda:  # smoke: host to host through the same native entry point, no stream
        for g in gpus:
            src = torch.ones(nbytes, dtype=torch.uint8)
            for direction in ("d2h", "h2d"):
                a, b = (hosts[g].tensor, src) if direction == "d2h" else (src, hosts[g].tensor)
                for _ in range(reps):
                    t0 = time.perf_counter()
                    ext.copy_batch([a.data_ptr()], [b.data_ptr()], [nbytes], None, False)
                    out[g][direction].append(nbytes / (time.perf_counter() - t0) / 1e9)
        return {g: {k: statistics.median(v) for k, v in d.items()} for g, d in out.items()}
    device_bufs, streams = {}, {}
    for g in gpus:
        with torch.cuda.device(g):
            device_bufs[g] = torch.ones(nbytes, dtype=torch.uint8, device=f"cuda:{g}")
            streams[g] = torch.cuda.Stream(g)
    step = nbytes // chunks
    for direction in ("d2h", "h2d"):
        for rep in range(env.args.warmup + reps):
            events = {}
            for g in gpus:  # launch every GPU's copies back to back: they run at once
                host, dev = hosts[g].tensor.data_ptr(), device_bufs[g].data_ptr()
                dst, src = (host, dev) if direction == "d2h" else (dev, host)
                with torch.cuda.device(g):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(streams[g])
                    ext.copy_batch([dst + i * step for i in range(chunks)], [src + i * step for i in range(chunks)],
                                   [step] * chunks, streams[g].cuda_stream, False)
                    end.record(streams[g])
                events[g] = (start, end)
            for g in gpus:
                torch.cuda.synchronize(g)
            if rep >= env.args.warmup:
                for g, (start, end) in events.items():
                    out[g][direction].append(step * chunks / start.elapsed_time(end) / 1e6)
    return {g: {k: statistics.median(v) for k, v in d.items()} for g, d in out.items()}


def main() -> int:
    """Place, measure, print the table, write the JSON; exit status 1 if a measurement failed."""
    parser = make_parser(__doc__, warmup=2, steps=5, smoke_warmup=0, smoke_steps=2)
    parser.add_argument("--mib", type=int, default=None, help="MiB each GPU copies per measurement (default 1024; 16 with --cpu-smoke)")
    parser.add_argument("--chunks", type=int, default=8, help="copies per measurement (launches of the GPUs overlap)")
    env = setup(parser)
    if native.extension() is None:
        print(f"numa_copy.py needs the native extension: {native.native_reason()}", file=sys.stderr)
        return 2
    nbytes = (env.args.mib or (16 if env.smoke else 1024)) << 20
    nbytes -= nbytes % env.args.chunks
    nodes = online_nodes() or []
    gpus = list(range(min(2, torch.cuda.device_count()))) if env.cuda else [0]
    # Where the engine would put each GPU's arena, and why (the decision the arena follows).
    decisions = {g: placement_for_gpu(g if env.cuda else None) for g in gpus}
    single = len(nodes) <= 1
    print(f"NUMA nodes online: {nodes or 'unknown'}; GPUs: {gpus}")
    for g, d in decisions.items():
        print(f"  GPU {g}: engine's placement: node {d.node} ({d.source})")
    if single:
        print("This host has a single NUMA node: local and remote are the same memory, so only "
              "'local' is measured. The placement path still runs: each buffer is asked on node "
              f"{nodes[0] if nodes else 0} through mbind and the node it landed on is read back.")

    def local_node(g: int) -> Optional[int]:
        node = decisions[g].node
        return node if node is not None else (nodes[0] if nodes else 0)

    placements = [("local", local_node)]
    if not single:
        placements.append(("remote", lambda g: next(n for n in nodes if n != local_node(g))))
    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    for label, node_of in placements:
        hosts: dict[int, HostBuffer] = {}
        for g in gpus:
            if env.cuda:
                torch.cuda.set_device(g)  # the buffer registers in this device's context
            hosts[g] = HostBuffer(nbytes, node_of(g), pinned=env.cuda)
        for count in sorted({1, len(gpus)}):
            try:
                rates = copy_rates(env, gpus[:count], hosts, nbytes, env.args.chunks)
            except Exception as exc:  # noqa: BLE001 - report it, measure the rest
                failed.append(f"{label} x{count}: {type(exc).__name__}: {exc}")
                continue
            for g, r in rates.items():
                h = hosts[g]
                rows.append({"gpus_at_once": count, "placement": label, "gpu": g, "node_asked": h.asked,
                             "node_bound": h.bound, "node_landed": h.landed, "numa_error": h.error or None,
                             "d2h_gbps": r["d2h"], "h2d_gbps": r["h2d"]})
        del hosts
    print_table("per-GPU copy rate to pinned host memory (GB/s, 1e9 B/s)", rows, [
        ("placement", "placement", ""), ("gpus_at_once", "GPUs at once", "d"), ("gpu", "GPU", "d"),
        ("node_asked", "node asked", ""), ("node_landed", "node landed", ""), ("d2h_gbps", "D2H", ".1f"),
        ("h2d_gbps", "H2D", ".1f"),
    ])
    for row in rows:
        if row["numa_error"]:
            print(f"  GPU {row['gpu']} {row['placement']}: the kernel refused the node: {row['numa_error']}")
    write_json("numa_copy", env, {
        "nodes": nodes, "single_node": single, "copy_bytes": nbytes, "chunks": env.args.chunks,
        "decisions": {g: {"node": d.node, "source": d.source} for g, d in decisions.items()}, "rows": rows,
        "failed": failed,
    })
    return exit_status(failed)


if __name__ == "__main__":
    sys.exit(main())
