"""NUMA-local host memory: the GPU's node read from sysfs through its PCI bus id, blocks placed
on a node by the extension (mbind before first touch), and the stats saying where and why."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from offload.host import native
from offload.host.numa import (
    NumaPlacement, normalize_pci_bus_id, online_nodes, parse_node_list, pci_numa_node, placement_for_gpu,
)

from _util import cpu_context, make_mlp_layers, train_step

needs_native = pytest.mark.skipif(not native.native_available(), reason=f"native extension: {native.native_reason()}")
BUS = "0000:1b:00.0"


def fake_sysfs(root: Path, *, online: str | None = "0-1", gpu_node: str | None = "1") -> Path:
    """A sysfs tree with the node list and one GPU's numa_node (None: the file is absent)."""
    if online is not None:
        (root / "devices/system/node").mkdir(parents=True)
        (root / "devices/system/node/online").write_text(online + "\n")
    if gpu_node is not None:
        (root / "bus/pci/devices" / BUS).mkdir(parents=True)
        (root / "bus/pci/devices" / BUS / "numa_node").write_text(gpu_node + "\n")
    return root


def test_node_lists_and_bus_ids_are_read_as_sysfs_writes_them() -> None:
    assert parse_node_list("0\n") == [0]
    assert parse_node_list("0-1") == [0, 1]
    assert parse_node_list("0,2-3,5") == [0, 2, 3, 5]
    # The driver's form (8-digit domain, upper case) and sysfs' directory name agree.
    assert normalize_pci_bus_id("00000000:1B:00.0") == BUS
    assert normalize_pci_bus_id("0000:1B:00.0") == BUS
    with pytest.raises(ValueError, match="not a PCI bus id"):
        normalize_pci_bus_id("GPU-0")


@needs_native
def test_the_gpu_node_comes_from_its_pci_device_in_sysfs(tmp_path: Path) -> None:
    sysfs = fake_sysfs(tmp_path)
    assert online_nodes(sysfs) == [0, 1] and pci_numa_node(BUS, sysfs) == 1
    placement = placement_for_gpu(0, sysfs=sysfs, bus_id="0000:1B:00.0", environ={})
    assert placement.node == 1 and f"({BUS}) is on node 1 of 2" in placement.source, placement


@needs_native
@pytest.mark.parametrize("case, online, gpu_node, why", [
    ("no node for the device", "0-1", "-1", "no NUMA node"),
    ("no numa_node file", "0-1", None, "no NUMA node"),
    ("no node list", None, "1", "lists no NUMA nodes"),
    ("single node", "0", "0", "single NUMA node"),
    ("node offline", "0-1", "3", "not online"),
])
def test_without_a_usable_node_nothing_is_bound_and_the_reason_is_given(tmp_path: Path, case: str, online: str | None, gpu_node: str | None, why: str) -> None:
    placement = placement_for_gpu(0, sysfs=fake_sysfs(tmp_path, online=online, gpu_node=gpu_node), bus_id=BUS, environ={})
    assert placement.node is None and why in placement.source, (case, placement)


def test_the_switch_and_the_host_transport_bind_nothing(tmp_path: Path) -> None:
    sysfs = fake_sysfs(tmp_path)
    off = placement_for_gpu(0, sysfs=sysfs, bus_id=BUS, environ={"OFFLOAD_NUMA": "0"})
    assert off.node is None and "OFFLOAD_NUMA=0" in off.source
    host = placement_for_gpu(None, sysfs=sysfs)
    assert host.node is None and "cpu transport" in host.source


def test_a_refused_node_is_reported_and_unbinds() -> None:
    placement = NumaPlacement(1, "GPU 0 is on node 1 of 2")
    placement.refused("mbind: Operation not permitted")
    assert placement.node is None and "refused by the kernel" in placement.source


@needs_native
def test_a_block_placed_on_node_0_lives_on_node_0() -> None:
    """The extension's path (mbind before the first touch) on this machine's node 0; a node that
    does not exist is refused without failing the allocation."""
    ext = native.extension()
    buffer = ext.PinnedBuffer(4 << 20, "mapped", numa_node=0)
    if "not permitted" in buffer.numa_error:
        pytest.skip(f"this container may not set memory policies: {buffer.numa_error}")
    assert buffer.numa_node == 0 and buffer.numa_error == "", buffer.numa_error
    block = torch.frombuffer(buffer, dtype=torch.uint8)
    block.fill_(7)
    assert ext.node_of_address(block.data_ptr()) == 0
    assert ext.node_of_address(block.data_ptr() + block.numel() - 1) == 0
    missing = max(online_nodes() or [0]) + 1
    unplaced = ext.PinnedBuffer(1 << 20, "mapped", numa_node=missing)
    assert unplaced.numa_node == -1 and "mbind" in unplaced.numa_error
    torch.frombuffer(unplaced, dtype=torch.uint8).fill_(1)  # still good memory


def test_stats_and_report_say_where_host_memory_lives() -> None:
    layers = make_mlp_layers(2)
    ctx, sync = cpu_context(1, 2)
    train_step(layers, torch.randn(8, 64), ctx, sync)
    assert ctx.stats["host_numa_node"] is None and "cpu transport" in ctx.stats["host_numa_source"]
    assert "host NUMA node" in ctx.report() and "cpu transport" in ctx.report()


@pytest.mark.cuda
def test_a_gpu_arena_is_placed_where_sysfs_says() -> None:
    """On the GPU: the arena's blocks sit on the GPU's node when the host has several nodes,
    and the stats say so either way."""
    import offload

    layers = make_mlp_layers(3, device="cuda")
    ctx, sync = offload.get_cpu_offload_context(True, num_layers=2, model_layers=3, min_offload_bytes=0)
    train_step(layers, torch.randn(64, 64, device="cuda"), ctx, sync)
    expected = placement_for_gpu(torch.cuda.current_device())
    stats = ctx.stats
    assert (stats["host_numa_node"], stats["host_numa_source"]) == (expected.node, expected.source)
    if expected.node is not None:
        for region in ctx.engine.arena._free:
            assert native.extension().node_of_address(region.block.data_ptr()) == expected.node
