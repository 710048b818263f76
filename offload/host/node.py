"""What the node's memory can give: its total and what is available now, less a floor for others.

Why: pinned memory cannot be swapped out, and a node is shared (several single-GPU jobs, notebooks,
dataloader workers). A budget taken from the node's *total* lets two independent jobs each think
they own most of it; the kernel's OOM killer then ends one of them, with no message (issue 48: a
run held 140 GB of a 252 GiB node while its plan needed 45 GiB, and died when a second job
started). So the host memory offload may hold is read from what the node has *available* whenever
the pool grows, and a floor is left for the OS and everyone else:

    floor     = max(NODE_FLOOR_FRACTION x total, min(NODE_FLOOR_BYTES, NODE_FLOOR_MAX_FRACTION x total))
                (10% of the node, and at least 8 GiB where that is under a quarter of it)
    may hold  = available + what this process holds already - floor

What this process holds counts as its own: ``available`` is read with those bytes already taken.

Where the figures come from (:class:`SystemNode`): ``psutil.virtual_memory()`` (total, and
available: free memory plus the page cache the kernel can drop), bounded by the memory cgroup the
process runs in, if it has a limit (a container, a Slurm job): cgroup v2 ``memory.max`` less
``memory.current`` (its page cache's ``inactive_file`` counted back as available), or v1
``memory.limit_in_bytes`` less ``memory.usage_in_bytes``.

Tests and benchmarks replace only the source of the numbers (:class:`SimulatedNode`): a node of a
given size shared by the processes that name the same directory, each publishing what its ledger
holds, so that a second process sees the first's bytes through ``available`` as it would on a
real node. ``OFFLOAD_SIMULATED_NODE=<total bytes>:<directory>`` turns it on for a process (and its
children).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Protocol

import psutil

NODE_FLOOR_FRACTION = 0.10
NODE_FLOOR_BYTES = 8 << 30
NODE_FLOOR_MAX_FRACTION = 0.25
SIMULATED_NODE_ENV_VAR = "OFFLOAD_SIMULATED_NODE"
_CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 writes "no limit" as a huge number (the largest page-aligned int64).
_NO_LIMIT = 1 << 60


def node_floor(total_bytes: int) -> int:
    """The bytes left for the OS and the node's other processes (see the module docstring)."""
    return int(max(NODE_FLOOR_FRACTION * total_bytes, min(NODE_FLOOR_BYTES, NODE_FLOOR_MAX_FRACTION * total_bytes)))


@dataclass(frozen=True)
class NodeMemory:
    """The node's memory as read once: ``total_bytes`` (the cgroup's limit where lower),
    ``available_bytes`` now, the ``floor_bytes`` left for others, and where they came from."""

    total_bytes: int
    available_bytes: int
    source: str

    @property
    def floor_bytes(self) -> int:
        return node_floor(self.total_bytes)

    def describe(self) -> str:
        """E.g. ``node 251.5 GiB, 180.2 GiB available, floor 25.2 GiB (psutil)``."""
        return (f"node {size_text(self.total_bytes)}, {size_text(self.available_bytes)} available, "
                f"floor {size_text(self.floor_bytes)} ({self.source})")


def size_text(nbytes: int) -> str:
    """``nbytes`` in GiB, or MiB below 1 GiB (a simulated node). (The engine's ``format_bytes``
    sits above this layer.)"""
    return f"{nbytes / (1 << 30):.1f} GiB" if nbytes >= 1 << 30 else f"{nbytes / (1 << 20):.1f} MiB"


class NodeSource(Protocol):
    """Where a ledger reads the node's memory. ``note_held(nbytes)`` is told what this process
    holds after every change (a real node knows it already; a simulated one publishes it)."""

    def read(self) -> NodeMemory: ...

    def note_held(self, nbytes: int) -> None: ...


def _read_int(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _own_cgroup(controller: str) -> Optional[str]:
    # The process's cgroup path for ``controller`` ("" for v2's unified line) in /proc/self/cgroup.
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == controller or controller in controllers.split(","):
                return path.lstrip("/")
    except (OSError, ValueError):
        pass
    return None


def _v2_dirs(root: Path) -> list[Path]:
    # The process's own cgroup and its ancestors up to the mount's root (a limit may sit on any
    # of them: a Slurm job's, a systemd slice's); a container sees its own cgroup as the root.
    own = _own_cgroup("")
    start = root / own if own and (root / own / "memory.max").exists() else root
    dirs = [start]
    while dirs[-1] != root and root in dirs[-1].parents:
        dirs.append(dirs[-1].parent)
    return [d for d in dirs if (d / "memory.max").exists()]


def cgroup_limit(root: Path = _CGROUP_ROOT) -> Optional[tuple[int, int, str]]:
    """(limit, available within it, which files) of the tightest memory cgroup over the process
    (its own or an ancestor's), or None when none has a limit (or none can be read)."""
    tightest: Optional[tuple[int, int, str]] = None
    for d in _v2_dirs(root):
        limit, used = _read_int(d / "memory.max"), _read_int(d / "memory.current")
        if limit is None or used is None:
            continue
        available = max(0, limit - used + _stat_value(d / "memory.stat", "inactive_file"))
        if tightest is None or available < tightest[1]:
            tightest = (limit, available, f"cgroup v2 {d / 'memory.max'}")
    if tightest is not None or (root / "cgroup.controllers").exists():
        return tightest
    own = _own_cgroup("memory")
    v1 = root / "memory" / own if own and (root / "memory" / own / "memory.limit_in_bytes").exists() else root / "memory"
    limit, used = _read_int(v1 / "memory.limit_in_bytes"), _read_int(v1 / "memory.usage_in_bytes")
    if limit is None or used is None:
        return None
    # v1 keeps the limit over its ancestors in memory.stat (0 or absent where there is none).
    limit = min(limit, _stat_value(v1 / "memory.stat", "hierarchical_memory_limit") or limit)
    if limit >= _NO_LIMIT:
        return None
    cache = _stat_value(v1 / "memory.stat", "total_inactive_file")
    return limit, max(0, limit - used + cache), f"cgroup v1 {v1 / 'memory.limit_in_bytes'}"


class SystemNode:
    """The real node: psutil, bounded by the memory cgroup's limit (see the module docstring)."""

    def __init__(self, cgroup_root: Path = _CGROUP_ROOT) -> None:
        self.cgroup_root = cgroup_root

    def read(self) -> NodeMemory:
        vm = psutil.virtual_memory()
        total, available, source = int(vm.total), int(vm.available), "psutil"
        cgroup = cgroup_limit(self.cgroup_root)
        if cgroup is not None and cgroup[0] < total:
            total, available, source = cgroup[0], min(available, cgroup[1]), cgroup[2]
        return NodeMemory(total, available, source)

    def note_held(self, nbytes: int) -> None:
        """Nothing to do: the kernel counts the process's pages itself."""


class SimulatedNode:
    """A node of ``total_bytes`` shared by the processes that name the same ``directory``.

    Each process writes what its ledger holds into ``directory/<pid>`` on every change;
    ``available`` is the total less what every process there holds (this one included, as the
    kernel counts it). For tests and benchmarks on a machine larger (or more crowded) than the
    node they stand for; real runs read :class:`SystemNode`.
    """

    def __init__(self, total_bytes: int, directory: str) -> None:
        if total_bytes <= 0:
            raise ValueError(f"offload: a simulated node needs a size in bytes > 0, got {total_bytes}")
        self.total_bytes = int(total_bytes)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._mine = self.directory / str(os.getpid())

    def read(self) -> NodeMemory:
        held = 0
        for path in self.directory.iterdir():
            if path.name.startswith("."):
                continue  # another process's file being written
            try:
                held += int(path.read_text() or 0)
            except (OSError, ValueError):
                continue  # being written, or gone: counted at the next read
        return NodeMemory(self.total_bytes, max(0, self.total_bytes - held), f"simulated, {self.directory}")

    def note_held(self, nbytes: int) -> None:
        """Publish what this process holds (written whole, then renamed: readers see either)."""
        tmp = self._mine.with_name(f".{self._mine.name}.tmp")
        tmp.write_text(str(int(nbytes)))
        os.replace(tmp, self._mine)


def node_source_from_env(environ: Optional[Mapping[str, str]] = None) -> NodeSource:
    """:class:`SimulatedNode` when ``OFFLOAD_SIMULATED_NODE=<total bytes>:<directory>`` is set,
    else the real node (:class:`SystemNode`)."""
    environ = os.environ if environ is None else environ
    text = environ.get(SIMULATED_NODE_ENV_VAR, "").strip()
    if not text:
        return SystemNode()
    size, sep, directory = text.partition(":")
    try:
        total = int(size)
    except ValueError:
        total = 0
    if not sep or not directory or total <= 0:
        raise ValueError(
            f"offload: {SIMULATED_NODE_ENV_VAR}={text!r} is not '<total bytes>:<directory>' (a "
            "simulated node for tests and benchmarks); unset it to read the real node"
        )
    return SimulatedNode(total, directory)
