"""Python face of the native extension ``offload._C``, with a pure-Python fallback.

The extension plans a group's byte layout (same result as :func:`offload.host.layout.plan_layout_py`),
submits a batch of copies in one call (on a CUDA stream through the CUDA driver API, or host to
host with ``memcpy``), and, for the CUDA transport and the arena, provides pooled events
(``record_event``, ``submit_copies``: a group's whole copy in one call) and pinned host buffers
(``PinnedBuffer``); :func:`extension` hands those to the engine directly.

A second extension, ``offload._entries``, holds a group's per-tensor bookkeeping against torch's
C++ API (``offload.engine.entry_table``). It is built only where torch's headers were there at
build time, against that exact torch, so :func:`entries_extension` hands it out only when the
running torch is the one it was built with; otherwise the engine uses the Python reference.

``OFFLOAD_NATIVE=0`` (also ``false``/``no``/``off``) turns both extensions off: :func:`plan_layout`
then uses the Python reference and :func:`copy_batch` refuses, so the engine's transport takes its
torch-based path. The variable is read when this module is imported and again by
:func:`reload_native_setting` (tests flip it that way).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any, Sequence

from offload.host.layout import ALIGNMENT, plan_layout_py

__all__ = [
    "native_available",
    "native_reason",
    "extension",
    "entries_extension",
    "entries_reason",
    "reload_native_setting",
    "plan_layout",
    "copy_batch",
    "cuda_copy_path",
    "cuda_copy_info",
]

# The values of an environment switch that turn a part off (OFFLOAD_NATIVE, OFFLOAD_NUMA,
# OFFLOAD_NATIVE_HOOKS).
OFF_VALUES = frozenset({"0", "false", "no", "off"})


def _import(name: str, how_to_build: str) -> tuple[ModuleType | None, str]:
    """Return ``(module or None, reason)``: off under ``OFFLOAD_NATIVE=0``, else imported."""
    setting = os.environ.get("OFFLOAD_NATIVE", "1").strip().lower()
    if setting in OFF_VALUES:
        return None, f"disabled by OFFLOAD_NATIVE={os.environ['OFFLOAD_NATIVE']!r}"
    try:
        # importlib rather than ``from offload import _C``: works whether or not the package has
        # an __init__.py, and a missing build is an ordinary, reportable state, not a crash.
        return importlib.import_module(name), "live"
    except ImportError as exc:
        return None, f"extension {name} is not importable ({exc}); {how_to_build}"


def _load() -> tuple[ModuleType | None, str]:
    """Return ``(offload._C or None, reason)`` for the current environment."""
    return _import("offload._C", "build it with `pip install -e .`")


def _load_entries() -> tuple[ModuleType | None, str]:
    """Return ``(offload._entries or None, reason)``: live only for the torch it was built with."""
    module, reason = _import(
        "offload._entries", "build it against this torch with `pip install --no-build-isolation -e .`"
    )
    if module is None:
        return None, reason
    import torch  # here, not at the top: offload._C and the layout need no torch

    if module.TORCH_VERSION != torch.__version__:
        # A different torch's ABI: calling into it could corrupt memory rather than fail.
        return None, (
            f"offload._entries was built for torch {module.TORCH_VERSION}, this is torch "
            f"{torch.__version__}; rebuild with `pip install --no-build-isolation -e .`"
        )
    return module, "live"


# The cached results: (extension module or None, why). Rebound only by reload_native_setting().
_STATE: tuple[ModuleType | None, str] = _load()
_ENTRIES: tuple[ModuleType | None, str] = _load_entries()


def reload_native_setting() -> bool:
    """Re-read ``OFFLOAD_NATIVE`` (and retry the import); return :func:`native_available`."""
    global _STATE, _ENTRIES
    _STATE = _load()
    _ENTRIES = _load_entries()
    return _STATE[0] is not None


def extension() -> ModuleType | None:
    """The live extension module (``offload._C``), or None: for the engine's hot paths, which call
    its functions directly (events, copy submission, pinned buffers)."""
    return _STATE[0]


def entries_extension() -> ModuleType | None:
    """``offload._entries`` when live (built for the running torch, not disabled), else None."""
    return _ENTRIES[0]


def entries_reason() -> str:
    """``"live"``, or why ``offload._entries`` is not used (for reports and skip messages)."""
    return _ENTRIES[1]


def native_available() -> bool:
    """Whether the extension is importable and not disabled by ``OFFLOAD_NATIVE=0``."""
    return _STATE[0] is not None


def native_reason() -> str:
    """``"live"``, or why the extension is not used (for reports and skip messages)."""
    return _STATE[1]


def plan_layout(sizes: Sequence[int], alignment: int = ALIGNMENT) -> tuple[list[int], int]:
    """Return ``(offsets, total)``: each entry's byte offset in its group region, and the size.

    Every entry starts on an ``alignment`` boundary (a positive power of two); zero-size entries
    take no space; the total is rounded up to the alignment. The extension's when live, else
    :func:`offload.host.layout.plan_layout_py`; both give identical results and raise ``ValueError``
    for a negative size or a bad alignment.
    """
    ext = _STATE[0]
    if ext is None:
        return plan_layout_py(sizes, alignment)
    if not isinstance(sizes, (list, tuple)):
        # The reference takes any iterable; the binding takes sequences. Materialise once.
        sizes = list(sizes)
    return ext.plan_layout(sizes, alignment)


def copy_batch(
    dst_ptrs: Sequence[int],
    src_ptrs: Sequence[int],
    sizes: Sequence[int],
    stream: int | None,
    *,
    force_loop: bool = False,
) -> None:
    """Copy ``sizes[i]`` bytes from ``src_ptrs[i]`` to ``dst_ptrs[i]`` for every entry, in one call.

    ``stream=None``: host to host with ``memcpy`` (GIL released); done when this returns. Both
    pointers must then be host memory: a device pointer here would crash the process.

    Otherwise ``stream`` is a CUDA stream handle (``torch.cuda.Stream.cuda_stream``) and the copies
    are only *submitted* on it (asynchronous: synchronise on the stream or an event before reading
    the destination, and keep both buffers alive until then). Pointers are device or pinned host
    pointers (``tensor.data_ptr()``); the driver infers each copy's direction. The submission is one
    ``cuMemcpyBatchAsync`` where the driver has it, else a C++ loop of ``cuMemcpyAsync``. The loop is
    also used for the legacy default stream (handle 0, which the batch call refuses), while the
    stream is being captured into a CUDA graph, and with ``force_loop=True`` (benchmarks, tests).
    Sources are read in stream order, so make the stream wait on the producer first.

    Zero-size entries are skipped. ``ValueError`` for mismatched lengths, a negative size or a null
    pointer with a non-zero size, raised before anything is copied. ``RuntimeError`` naming the CUDA
    error and the failing call for driver errors, when no CUDA context is current on this thread
    (let torch initialise CUDA first), or when the extension is not live.
    """
    ext = _STATE[0]
    if ext is None:
        raise RuntimeError(
            f"offload.host.native.copy_batch needs the native extension, which is not live: {_STATE[1]}"
        )
    ext.copy_batch(dst_ptrs, src_ptrs, sizes, stream, force_loop)


def cuda_copy_path() -> str:
    """Which CUDA submission path is live: ``"batch"``, ``"loop"`` or ``"unavailable"``.

    ``"unavailable"`` when the extension is not live or the CUDA driver cannot be loaded. The
    first call loads the driver library (it does not initialise CUDA). The reason is in
    :func:`cuda_copy_info`.
    """
    ext = _STATE[0]
    if ext is None:
        return "unavailable"
    return ext.cuda_copy_path()


def cuda_copy_info() -> dict[str, Any]:
    """The live path, why, the driver version, the ABI ``cuMemcpyBatchAsync`` is bound with, and
    process-wide counters: ``batch_calls``, ``loop_calls``, ``batch_fallbacks`` (batch refused,
    retried as a loop), ``capture_loop_calls``, ``legacy_stream_loop_calls``, ``last_batch_error``.
    """
    ext = _STATE[0]
    if ext is None:
        return {"path": "unavailable", "reason": _STATE[1]}
    return ext.cuda_copy_info()
