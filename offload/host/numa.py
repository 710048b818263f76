"""NUMA placement of the host arena: each rank's pinned blocks on its GPU's own node.

On a host with several sockets, every GPU hangs off the PCIe root of one socket. A copy between
the GPU and pinned memory on the *other* socket crosses the inter-socket link and loses
bandwidth, and pinned memory lands wherever the allocating thread happens to run. So the arena
asks the kernel to place its blocks on the GPU's node:

- the GPU's PCI bus id comes from torch's device properties where they carry it, else from the
  CUDA driver (``cuDeviceGetPCIBusId``, through the native extension);
- its node is ``/sys/bus/pci/devices/<domain:bus:device.function>/numa_node`` (``-1`` when the
  platform does not say);
- the extension gives each new block a preferred-node policy (``mbind``) before its first touch
  (see ``csrc/host_memory.h``).

No binding, and the stats say why (``host_numa_node`` None, ``host_numa_source``), when the host
has a single node, sysfs names no node for the GPU, the transport is the host one (no GPU), the
extension is not live, or ``OFFLOAD_NUMA=0`` (also ``false``/``no``/``off``). A node the kernel
refuses (a container without the right, a node gone offline) is reported the same way, and the
blocks are allocated anyway: placement is a speed matter, never a reason to fail.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from . import native

SYSFS = "/sys"
NUMA_ENV_VAR = "OFFLOAD_NUMA"

PathLike = Union[str, "os.PathLike[str]"]


@dataclass
class NumaPlacement:
    """Where the arena's blocks go: ``node`` (None: not bound) and ``source``, why."""

    node: Optional[int]
    source: str

    def refused(self, error: str) -> None:
        """The kernel would not apply the node (the block was allocated without it)."""
        if self.node is not None:
            self.source = f"node {self.node} asked for, refused by the kernel ({error}): not bound"
            self.node = None


def parse_node_list(text: str) -> list[int]:
    """A sysfs node list (``"0"``, ``"0-1"``, ``"0,2-3"``) as node numbers."""
    nodes: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        first, _, last = part.partition("-")
        nodes.extend(range(int(first), int(last or first) + 1))
    return nodes


def online_nodes(sysfs: PathLike = SYSFS) -> Optional[list[int]]:
    """The host's online NUMA nodes, or None when sysfs does not list them."""
    try:
        return parse_node_list(Path(sysfs, "devices/system/node/online").read_text())
    except (OSError, ValueError):
        return None


def normalize_pci_bus_id(bus_id: str) -> str:
    """``domain:bus:device.function`` as sysfs names it: lower case, a 4-digit domain
    (the driver may give ``00000000:1B:00.0``)."""
    try:
        domain, bus, rest = bus_id.strip().split(":")
        device, _, function = rest.partition(".")
        return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}.{int(function or '0', 16):x}"
    except ValueError:
        raise ValueError(f"offload: {bus_id!r} is not a PCI bus id (domain:bus:device.function)") from None


def pci_numa_node(bus_id: str, sysfs: PathLike = SYSFS) -> Optional[int]:
    """The NUMA node sysfs gives the PCI device, or None (``-1``, no such file, unreadable)."""
    try:
        node = int(Path(sysfs, "bus/pci/devices", normalize_pci_bus_id(bus_id), "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def gpu_pci_bus_id(index: int) -> str:
    """The PCI bus id of CUDA device ``index``: torch's device properties where they carry it
    (``pci_domain_id``, ``pci_bus_id``, ``pci_device_id``), else the driver's."""
    import torch

    props = torch.cuda.get_device_properties(index)
    parts = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if all(isinstance(p, int) for p in parts):
        domain, bus, device = parts
        return f"{domain:04x}:{bus:02x}:{device:02x}.0"
    ext = native.extension()
    if ext is None:
        raise RuntimeError(f"torch does not give the PCI bus id and the native extension is not live ({native.native_reason()})")
    return normalize_pci_bus_id(ext.pci_bus_id(index))


def numa_disabled(environ: Optional[dict[str, str]] = None) -> bool:
    """Whether ``OFFLOAD_NUMA`` turns the placement off."""
    environ = os.environ if environ is None else environ  # type: ignore[assignment]
    return environ.get(NUMA_ENV_VAR, "1").strip().lower() in native.OFF_VALUES  # type: ignore[union-attr]


def placement_for_gpu(
    index: Optional[int], *, sysfs: PathLike = SYSFS, bus_id: Optional[str] = None,
    environ: Optional[dict[str, str]] = None,
) -> NumaPlacement:
    """Where the arena of CUDA device ``index`` should put its blocks (None: the host transport).

    ``bus_id`` skips asking the device (tests pass a fake sysfs and a bus id).
    """
    if index is None or index < 0:
        return NumaPlacement(None, "cpu transport: no GPU to be near")
    if numa_disabled(environ):
        return NumaPlacement(None, f"disabled by {NUMA_ENV_VAR}=0")
    nodes = online_nodes(sysfs)
    if nodes is None:
        return NumaPlacement(None, "sysfs lists no NUMA nodes: not bound")
    if len(nodes) <= 1:
        return NumaPlacement(None, f"single NUMA node ({','.join(map(str, nodes))}): nothing to choose")
    if native.extension() is None:
        return NumaPlacement(None, f"native extension not live ({native.native_reason()}): not bound")
    try:
        bus = normalize_pci_bus_id(bus_id) if bus_id is not None else gpu_pci_bus_id(index)
    except (RuntimeError, ValueError, AttributeError) as exc:
        return NumaPlacement(None, f"PCI bus id of GPU {index} unknown ({exc}): not bound")
    node = pci_numa_node(bus, sysfs)
    if node is None:
        return NumaPlacement(None, f"sysfs gives GPU {index} ({bus}) no NUMA node: not bound")
    if node not in nodes:
        return NumaPlacement(None, f"GPU {index} ({bus}) is on node {node}, which is not online: not bound")
    return NumaPlacement(node, f"GPU {index} ({bus}) is on node {node} of {len(nodes)}")
