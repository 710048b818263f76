"""Tests of the native extension ``offload._C`` and its Python face ``offload.host.native``.

CPU tests run everywhere (CI builds the extension with ``pip install -e .`` and sets
``OFFLOAD_REQUIRE_NATIVE=1``, so a missing build fails there instead of skipping). Tests marked
``cuda`` need a GPU and skip cleanly without one.
"""

from __future__ import annotations

import importlib
import os
import random
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import offload.host.native as native
from offload.host.layout import plan_layout_py

REQUIRE_NATIVE = os.environ.get("OFFLOAD_REQUIRE_NATIVE", "") == "1"


def _import_ext():
    try:
        return importlib.import_module("offload._C"), ""
    except ImportError as exc:
        return None, str(exc)


EXT, EXT_ERROR = _import_ext()
needs_ext = pytest.mark.skipif(
    EXT is None, reason=f"offload._C is not built ({EXT_ERROR}); run `pip install -e .`"
)
HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.fixture
def native_on(monkeypatch):
    """The extension live for one test, whatever the environment says; restored afterwards."""
    monkeypatch.delenv("OFFLOAD_NATIVE", raising=False)
    native.reload_native_setting()
    yield
    monkeypatch.undo()
    native.reload_native_setting()


# ---- build / import ---------------------------------------------------------------------------


def test_extension_builds_and_imports():
    if EXT is None:
        if REQUIRE_NATIVE:
            pytest.fail(f"OFFLOAD_REQUIRE_NATIVE=1 but offload._C does not import: {EXT_ERROR}")
        pytest.skip(f"offload._C is not built ({EXT_ERROR}); run `pip install -e .`")
    for name in ("plan_layout", "copy_batch", "cuda_copy_path", "cuda_copy_info"):
        assert callable(getattr(EXT, name)), name


@needs_ext
def test_native_available_by_default(native_on):
    assert native.native_available()
    assert native.native_reason() == "live"


@needs_ext
def test_offload_native_0_forces_fallback(monkeypatch):
    try:
        for value in ("0", "false", "off"):
            monkeypatch.setenv("OFFLOAD_NATIVE", value)
            assert native.reload_native_setting() is False
            assert not native.native_available()
            assert "OFFLOAD_NATIVE" in native.native_reason()
            # The layout still works (Python reference), copies refuse clearly, the path says so.
            assert native.plan_layout([1, 2, 0, 300]) == plan_layout_py([1, 2, 0, 300])
            assert native.cuda_copy_path() == "unavailable"
            with pytest.raises(RuntimeError, match="not live"):
                native.copy_batch([], [], [], None)
        monkeypatch.setenv("OFFLOAD_NATIVE", "1")
        assert native.reload_native_setting() is True
    finally:
        monkeypatch.undo()
        native.reload_native_setting()


# ---- layout -----------------------------------------------------------------------------------


def _random_sizes(rng: random.Random) -> list[int]:
    n = rng.choice([0, 1, 2, 3, 7, 16, 64, 257])
    kinds = [
        lambda: 0,
        lambda: rng.randint(1, 17),
        lambda: rng.randrange(1, 4096, 2),  # odd
        lambda: rng.randint(1, 1 << 20),
        lambda: rng.choice([256, 512, 65536, 1 << 20]),  # already aligned
        lambda: rng.randint(1, 1 << 34),  # large (16 GiB)
    ]
    return [rng.choice(kinds)() for _ in range(n)]


@needs_ext
def test_layout_matches_reference_random():
    rng = random.Random(1234)
    alignments = [1 << k for k in range(0, 21)]  # 1 .. 1 MiB
    for trial in range(3000):
        sizes = _random_sizes(rng)
        alignment = rng.choice(alignments)
        expected = plan_layout_py(sizes, alignment)
        got = EXT.plan_layout(sizes, alignment)
        assert got == expected, (trial, sizes, alignment)
        assert isinstance(got, tuple) and isinstance(got[0], list) and isinstance(got[1], int)


@needs_ext
def test_layout_edge_cases(native_on):
    cases = [[], [0], [0, 0, 0], [1], [255], [256], [257], [1, 0, 1], [0, 5, 0, 0, 3]]
    for sizes in cases:
        for alignment in (1, 2, 16, 256, 4096):
            assert EXT.plan_layout(sizes, alignment) == plan_layout_py(sizes, alignment)
            assert native.plan_layout(sizes, alignment) == plan_layout_py(sizes, alignment)
    # Default alignment is 256, tuples and generators are taken like the reference takes them.
    assert EXT.plan_layout([3, 5]) == plan_layout_py([3, 5]) == ([0, 256], 512)
    assert native.plan_layout((3, 5)) == plan_layout_py((3, 5))
    assert native.plan_layout(s for s in [3, 5]) == plan_layout_py([3, 5])


@needs_ext
@pytest.mark.parametrize("alignment", [0, -1, -256, 3, 6, 100, 255, 257, (1 << 20) + 1])
def test_layout_bad_alignment(alignment):
    with pytest.raises(ValueError) as ref:
        plan_layout_py([1, 2], alignment)
    with pytest.raises(ValueError) as got:
        EXT.plan_layout([1, 2], alignment)
    assert str(got.value) == str(ref.value)
    # Checked before the sizes, as in the reference, even for an empty list.
    with pytest.raises(ValueError):
        EXT.plan_layout([], alignment)


@needs_ext
@pytest.mark.parametrize("sizes", [[-1], [5, -1], [0, 10, -300, 4], [-(1 << 40)]])
def test_layout_negative_size(sizes):
    with pytest.raises(ValueError) as ref:
        plan_layout_py(sizes)
    with pytest.raises(ValueError) as got:
        EXT.plan_layout(sizes)
    assert str(got.value) == str(ref.value)


@needs_ext
def test_layout_overflow_is_an_error_not_a_wrong_total():
    with pytest.raises(OverflowError):
        EXT.plan_layout([(1 << 63) - 10, 1 << 20])


# ---- host copies ------------------------------------------------------------------------------


def _host_plan(rng: random.Random, n: int, max_size: int):
    """Entries of odd sizes (and some zero) at scattered, unaligned offsets in src and dst."""
    sizes = [rng.choice([0, 1, 3, rng.randrange(1, max_size, 2), rng.randint(1, max_size)]) for _ in range(n)]
    src_offsets, dst_offsets, cursor = [], [], 7
    for size in sizes:
        src_offsets.append(cursor)
        cursor += size + rng.randint(0, 13)
    src_total = cursor + 5
    order = list(range(n))
    rng.shuffle(order)  # destinations in another order than sources
    dst_cursor = 3
    dst_offsets = [0] * n
    for i in order:
        dst_offsets[i] = dst_cursor
        dst_cursor += sizes[i] + rng.randint(0, 9)
    return sizes, src_offsets, dst_offsets, src_total, dst_cursor + 11


@needs_ext
def test_host_copy_round_trip_exact(native_on):
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    for trial in range(20):
        sizes, so, do, src_total, dst_total = _host_plan(rng, rng.choice([1, 5, 64, 300]), 5000)
        src = torch.randint(0, 256, (src_total,), dtype=torch.uint8, generator=gen)
        dst = torch.zeros(dst_total, dtype=torch.uint8)
        back = torch.zeros(src_total, dtype=torch.uint8)
        sp, dp, bp = src.data_ptr(), dst.data_ptr(), back.data_ptr()
        EXT.copy_batch([dp + o for o in do], [sp + o for o in so], sizes, None)
        expected = torch.zeros(dst_total, dtype=torch.uint8)
        for size, s_off, d_off in zip(sizes, so, do):
            expected[d_off : d_off + size] = src[s_off : s_off + size]
        assert torch.equal(dst, expected), trial
        # And back again, through the Python face: the entries' bytes round-trip exactly.
        native.copy_batch([bp + o for o in so], [dp + o for o in do], sizes, None)
        for size, s_off in zip(sizes, so):
            assert torch.equal(back[s_off : s_off + size], src[s_off : s_off + size])


@needs_ext
def test_host_copy_zero_size_entries_skipped():
    src = torch.arange(16, dtype=torch.uint8)
    dst = torch.zeros(16, dtype=torch.uint8)
    # Zero-size entries may carry any pointer, even 0: they are never touched.
    EXT.copy_batch([0, dst.data_ptr(), 12345], [0, src.data_ptr(), 0], [0, 16, 0], None)
    assert torch.equal(dst, src)
    EXT.copy_batch([], [], [], None)


@needs_ext
@pytest.mark.parametrize(
    "case",
    ["short_dst", "short_src", "short_sizes", "negative_last", "negative_first", "null_dst", "null_src"],
)
def test_bad_arguments_refused_before_any_copy(case):
    n = 8
    src = torch.randint(1, 256, (n * 100,), dtype=torch.uint8)
    dst = torch.zeros(n * 100, dtype=torch.uint8)
    dsts = [dst.data_ptr() + 100 * i for i in range(n)]
    srcs = [src.data_ptr() + 100 * i for i in range(n)]
    sizes = [100] * n
    if case == "short_dst":
        dsts = dsts[:-1]
    elif case == "short_src":
        srcs = srcs[:-1]
    elif case == "short_sizes":
        sizes = sizes[:-1]
    elif case == "negative_last":
        sizes[-1] = -1
    elif case == "negative_first":
        sizes[0] = -100
    elif case == "null_dst":
        dsts[-1] = 0
    elif case == "null_src":
        srcs[-1] = 0
    for force_loop in (False, True):
        with pytest.raises(ValueError):
            EXT.copy_batch(dsts, srcs, sizes, None, force_loop)
        # A CUDA stream handle too: validation comes before any driver work, GPU or not.
        with pytest.raises(ValueError):
            EXT.copy_batch(dsts, srcs, sizes, 0x1234, force_loop)
    assert torch.count_nonzero(dst).item() == 0  # nothing copied


@needs_ext
def test_error_messages_name_the_problem():
    with pytest.raises(ValueError, match="same length, got 2, 1 and 1"):
        EXT.copy_batch([1, 2], [1], [1], None)
    with pytest.raises(ValueError, match=r"sizes\[1\] must be >= 0, got -3"):
        EXT.copy_batch([1, 2], [1, 2], [0, -3], None)


# ---- CUDA path introspection (no GPU needed) --------------------------------------------------


def _driver_version_from_ctypes():
    """The CUDA driver version as ctypes finds it, or None when libcuda.so.1 does not load."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return version.value


@needs_ext
def test_cuda_copy_path_reports(native_on):
    # The path the extension reports must follow from the driver this machine has, found here
    # independently of the extension.
    path = native.cuda_copy_path()
    info = native.cuda_copy_info()
    assert info["path"] == path and isinstance(info["reason"], str) and info["reason"]
    driver = _driver_version_from_ctypes()
    if driver is None:
        assert path == "unavailable", info
        assert info["reason"].startswith(("dlopen(libcuda.so.1) failed", "cuDriverGetVersion")), info
    else:
        assert info["driver_version"] == driver
        if driver < 12080:
            assert path == "loop" and "needs >= 12.8" in info["reason"], info
        elif info["batch_fallbacks"] == 0 and not info["last_batch_error"]:
            assert path == "batch", info  # the batch call is only given up after it failed
        else:
            assert path in ("batch", "loop"), info
    for key in ("batch_calls", "loop_calls", "batch_fallbacks", "capture_loop_calls"):
        assert isinstance(info[key], int)
    if path == "batch":
        assert info["batch_abi"] == 12080 and info["driver_version"] >= 12080
    else:
        assert info["batch_abi"] is None


@needs_ext
def test_cuda_copy_without_driver_is_a_clear_error():
    if EXT.cuda_copy_path() != "unavailable":
        pytest.skip("checks the error on a machine without a loadable CUDA driver")
    src = torch.zeros(4, dtype=torch.uint8)
    dst = torch.zeros(4, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="CUDA"):
        EXT.copy_batch([dst.data_ptr()], [src.data_ptr()], [4], 0x1234)


# ---- GPU --------------------------------------------------------------------------------------

N_TENSORS = 256
TENSOR_BYTES = 64 * 1024


def _loop_modes():
    return [
        pytest.param(False, id="batch"),
        pytest.param(True, id="loop"),
    ]


def _cuda_case(force_loop: bool):
    if EXT is None:
        pytest.skip(f"offload._C is not built ({EXT_ERROR})")
    torch.cuda.init()
    if not force_loop and EXT.cuda_copy_path() != "batch":
        pytest.skip(f"batch path not live: {EXT.cuda_copy_info()['reason']}")


def _counters():
    info = EXT.cuda_copy_info()
    return {k: info[k] for k in ("batch_calls", "loop_calls", "batch_fallbacks")}


def _check_path_used(before, force_loop):
    after = _counters()
    if force_loop:
        assert after["loop_calls"] == before["loop_calls"] + 1
        assert after["batch_calls"] == before["batch_calls"]
    else:
        # One batch call, accepted first time (no silent per-call fallback to the loop).
        assert after["batch_calls"] == before["batch_calls"] + 1, EXT.cuda_copy_info()
        assert after["batch_fallbacks"] == before["batch_fallbacks"], EXT.cuda_copy_info()


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("force_loop", _loop_modes())
def test_cuda_d2h_then_h2d_bitwise(force_loop, native_on):
    _cuda_case(force_loop)
    total = N_TENSORS * TENSOR_BYTES
    gen = torch.Generator(device="cuda").manual_seed(11)
    dev = torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda", generator=gen)
    host = torch.zeros(total, dtype=torch.uint8, pin_memory=True)
    back = torch.zeros(total, dtype=torch.uint8, device="cuda")
    # Scatter: tensor i goes to slot perm[i], so a copy landing in the wrong place is caught.
    perm = torch.randperm(N_TENSORS, generator=torch.Generator().manual_seed(3)).tolist()
    sizes = [TENSOR_BYTES] * N_TENSORS
    dev_ptrs = [dev.data_ptr() + i * TENSOR_BYTES for i in range(N_TENSORS)]
    host_ptrs = [host.data_ptr() + perm[i] * TENSOR_BYTES for i in range(N_TENSORS)]
    back_ptrs = [back.data_ptr() + i * TENSOR_BYTES for i in range(N_TENSORS)]

    side = torch.cuda.Stream()
    compute = torch.cuda.current_stream()
    side.wait_stream(compute)  # dev was written on the compute stream
    before = _counters()
    native.copy_batch(host_ptrs, dev_ptrs, sizes, side.cuda_stream, force_loop=force_loop)
    _check_path_used(before, force_loop)
    side.synchronize()
    expected = dev.view(N_TENSORS, TENSOR_BYTES).cpu()
    got = host.view(N_TENSORS, TENSOR_BYTES)
    assert torch.equal(got[perm], expected)

    # H2D back into another device buffer on the side stream, read on the compute stream.
    before = _counters()
    native.copy_batch(back_ptrs, host_ptrs, sizes, side.cuda_stream, force_loop=force_loop)
    _check_path_used(before, force_loop)
    compute.wait_stream(side)
    assert torch.equal(back, dev)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("force_loop", _loop_modes())
def test_cuda_mixed_directions_and_odd_sizes(force_loop, native_on):
    _cuda_case(force_loop)
    rng = random.Random(5)
    sizes = [rng.choice([0, 1, 17, 255, 4097, 65535]) for _ in range(64)]
    offsets, total = plan_layout_py(sizes)
    gen = torch.Generator(device="cuda").manual_seed(2)
    dev_src = torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda", generator=gen)
    host_src = torch.randint(0, 256, (total,), dtype=torch.uint8).pin_memory()
    dev_dst = torch.zeros(total, dtype=torch.uint8, device="cuda")
    host_dst = torch.zeros(total, dtype=torch.uint8, pin_memory=True)
    # Even entries D2H, odd entries H2D, in one call: the driver infers each direction.
    dsts, srcs = [], []
    for i, off in enumerate(offsets):
        if i % 2 == 0:
            dsts.append(host_dst.data_ptr() + off)
            srcs.append(dev_src.data_ptr() + off)
        else:
            dsts.append(dev_dst.data_ptr() + off)
            srcs.append(host_src.data_ptr() + off)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    native.copy_batch(dsts, srcs, sizes, side.cuda_stream, force_loop=force_loop)
    side.synchronize()
    dev_src_cpu, dev_dst_cpu = dev_src.cpu(), dev_dst.cpu()
    for i, (off, size) in enumerate(zip(offsets, sizes)):
        sl = slice(off, off + size)
        if i % 2 == 0:
            assert torch.equal(host_dst[sl], dev_src_cpu[sl]), i
        else:
            assert torch.equal(dev_dst_cpu[sl], host_src[sl]), i


@pytest.mark.cuda
@needs_cuda
def test_cuda_legacy_default_stream_uses_loop(native_on):
    _cuda_case(True)
    dev = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    host = torch.zeros(1 << 20, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.default_stream().cuda_stream  # 0: the legacy NULL stream
    before = _counters()
    native.copy_batch([host.data_ptr()], [dev.data_ptr()], [1 << 20], stream)
    assert _counters()["loop_calls"] == before["loop_calls"] + 1
    torch.cuda.default_stream().synchronize()
    assert torch.equal(host, dev.cpu())


@pytest.mark.cuda
@needs_cuda
def test_cuda_copies_capture_into_a_graph(native_on):
    _cuda_case(True)
    n, size = 32, 4096
    dev = torch.randint(0, 256, (n * size,), dtype=torch.uint8, device="cuda")
    host = torch.zeros(n * size, dtype=torch.uint8, pin_memory=True)
    dsts = [host.data_ptr() + i * size for i in range(n)]
    srcs = [dev.data_ptr() + i * size for i in range(n)]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    before = EXT.cuda_copy_info()["capture_loop_calls"]
    with torch.cuda.graph(graph):
        native.copy_batch(dsts, srcs, [size] * n, torch.cuda.current_stream().cuda_stream)
    if EXT.cuda_copy_path() == "batch":
        assert EXT.cuda_copy_info()["capture_loop_calls"] == before + 1
    for fill in (7, 201):
        dev.fill_(fill)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(host, dev.cpu())


@pytest.mark.cuda
@needs_cuda
def test_cuda_no_current_context_is_a_clear_error():
    _cuda_case(True)
    dev = torch.zeros(16, dtype=torch.uint8, device="cuda")
    host = torch.zeros(16, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    errors: list[BaseException] = []

    def worker():  # a fresh thread: torch has made no CUDA call here, no context is current
        try:
            EXT.copy_batch([host.data_ptr()], [dev.data_ptr()], [16], stream.cuda_stream)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            errors.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError), errors
    assert "initialised by torch" in str(errors[0])


_BAD_COPY_SCRIPT = textwrap.dedent(
    """
    import sys, torch, offload._C as C
    force_loop = sys.argv[1] == "1"
    torch.cuda.init()
    # A fresh 32 MiB allocation (its own cudaMalloc segment) and a copy 1 GiB long: the driver
    # must refuse a range that runs past the end of both allocations.
    src = torch.zeros(32 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.zeros(32 << 20, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    try:
        C.copy_batch([dst.data_ptr()], [src.data_ptr()], [1 << 30], stream.cuda_stream, force_loop)
        stream.synchronize()
    except RuntimeError as exc:
        print("RAISED:", exc)
    else:
        print("NO ERROR")
    """
)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("force_loop", _loop_modes())
def test_cuda_driver_error_names_the_cuda_error(force_loop):
    _cuda_case(force_loop)
    # In a child process: should a driver ever accept the bad copy, the GPU fault it causes
    # poisons the CUDA context, which must not take the rest of this test session with it.
    proc = subprocess.run(
        [sys.executable, "-c", _BAD_COPY_SCRIPT, "1" if force_loop else "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "RAISED:" in out, out
    assert "CUDA_ERROR_" in out and "cuMemcpy" in out, out


@needs_ext
def test_host_blocks_are_not_inherited_by_a_fork(native_on):
    """A forked child (a DataLoader's worker, the plan search's process) does not get the arena's
    mapped blocks: a DMA-pinned private page is copied into the child at the fork on recent
    kernels, or left copy-on-write under the device's copies on older ones (MADV_DONTFORK)."""
    ext = native.extension()
    buffer = ext.PinnedBuffer(4 << 20, "mapped")  # the mmap path the registered blocks take, unpinned
    block = torch.frombuffer(buffer, dtype=torch.uint8)
    block.fill_(7)
    start = block.data_ptr()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            with open("/proc/self/maps") as maps:
                spans = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in maps]
            os.write(write_end, b"mapped" if any(lo <= start < hi for lo, hi in spans) else b"absent")
        finally:
            os._exit(0)
    os.close(write_end)
    seen = os.read(read_end, 16)
    os.close(read_end)
    os.waitpid(pid, 0)
    assert seen == b"absent"
    assert int(block[-1]) == 7  # and still ours


@needs_ext
def test_a_buffer_locked_later_makes_no_driver_call_first_and_a_refused_lock_gives_its_pages_back(native_on):
    """``PinnedBuffer(..., lock_now=False)`` faults its pages in with no driver call (so it works on
    a machine without one), and ``lock_pages()`` pins them; a refused lock releases the pages at
    once and leaves the buffer empty (a block the host refused must not keep what was refunded)."""
    ext = native.extension()
    nbytes = (8 << 20) + 123
    buffer = ext.PinnedBuffer(nbytes, "register_huge", lock_now=False)
    assert not buffer.locked and buffer.nbytes == nbytes and buffer.pinned_bytes == 10 << 20
    block = torch.frombuffer(buffer, dtype=torch.uint8)
    assert int(block.sum()) == 0  # faulted in: zeroed pages
    del block
    if torch.cuda.is_available():  # (the GPU suite round-trips one: test_native_events_gpu)
        buffer.lock_pages()
        assert buffer.locked
        return
    with pytest.raises(RuntimeError, match="driver|context"):
        buffer.lock_pages()
    assert not buffer.locked and buffer.nbytes == 0 and buffer.pinned_bytes == 0
    with pytest.raises(RuntimeError, match="refusal emptied it"):
        buffer.lock_pages()
