"""A new sequence length's cuDNN attention backward, built while the forward runs.

cuDNN's attention kernels are built per problem shape: the first call at a new batch, head count,
length or head size builds an execution plan, and torch caches the plans per thread
(``aten/src/ATen/native/cudnn/MHA.cpp``: one thread-local cache for the forward, one for the
backward; there is no API to fill them). The forward's plan is built on the thread that runs the
forward, the backward's on autograd's device thread, which runs every CUDA backward node. So the
first step at a new length pays two builds, each on its critical path: LLAMA-1B's HF model, batch
4, a plain step's first time at 2048 tokens took 232-296 ms on the H200 against 133 after, about
half of the extra in its forward and half in its backward (docs/benchmarks.md). An SFT stream with
dynamic padding meets a new length at every new bucket.

The backward's build need not wait for the backward: autograd's device thread is idle while the
forward runs. While the first layer of a forward whose input has a shape this context has not
seen runs, :class:`AttentionGraphs` notes the layout of its first attention call (sizes, strides,
dtypes, the call's options); at that layer's exit it runs the same call on zeros of that layout
(the forward's plan is cached on this thread by now: only the kernel runs) and hands that
output's backward to a short-lived thread. Autograd runs it on its device thread, which builds
and caches the backward's plan while this thread goes on with the forward; the real backward
finds it built (on the H200, plain first steps at 2048-4096 tokens shorter in 16 of 18 pairs on
three hosts, by up to 136 ms; HF-checkpointed ones at 2048-6144 in 14 of 16 pairs on three
hosts, by up to 121 ms: docs/benchmarks.md). Not inside the layer: a recomputed layer that keeps
attention runs under a selective checkpoint whose cache would keep a copy's output until the
layer's backward. Not the forward's plan on the device thread as well (a recomputed layer runs
its forward there again): built there first, it held the backward's build back, and first steps
were no shorter; built after it (a gradient hook on the copy's query), for steps whose backward
re-runs attention only, HF-checkpointed first steps over four rounds moved -29, -17 and +11 ms at
2048, 4096 and 6144 tokens against the backward's plan alone: within their spread, so not kept
(docs/benchmarks.md).

What it costs, once per new shape: the attention's forward and backward at that length on the GPU
(a few ms at 8192 tokens), and the copy's inputs, output and gradients (about twice the inputs'
bytes and a query's more) until that backward is done. The forward waits for it at its last
layer's entry, so those bytes are gone before the last layer, the head and the loss, where a
step's peak lies.

It runs only where it can help and cannot change a result: torch's
``scaled_dot_product_attention``, for which torch chooses cuDNN, without dropout (a copy would draw
random numbers) and without an attention mask that requires grad; grad enabled; a CUDA device
with the copy's bytes free twice over; no CUDA graph being captured; nothing compiled by Dynamo in
the process (the watching ``TorchFunctionMode`` would make Dynamo guard on it); plain tensors
(not a subclass, DTensor or fake); no other torch function or dispatch mode on at the layer's exit
(it would see, or cache, the copy). The copy's saved tensors bypass offload's saved-tensor hooks. A failure is one warning, and it is not tried again.
``OFFLOAD_ATTENTION_GRAPHS=0`` (read when a context is made) turns it off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import warnings
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..engine.entry_table import storage_extent_bytes
from ..engine.transport import device_room_bytes
from ..forwards.recompute import checkpoint_inputs
from .args import dynamo_compiled_code

__all__ = ["AttentionGraphs", "attention_graphs_wanted"]

_SDPA = F.scaled_dot_product_attention
_SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
_CUDNN = int(SDPBackend.CUDNN_ATTENTION.value)


def attention_graphs_wanted(device: torch.device) -> bool:
    """Whether a context on ``device`` builds a new length's attention backward ahead: CUDA, and
    ``OFFLOAD_ATTENTION_GRAPHS`` not ``0``."""
    return device.type == "cuda" and os.environ.get("OFFLOAD_ATTENTION_GRAPHS", "1") != "0"


def _call_arguments(args: Sequence[Any], kwargs: dict[str, Any]) -> Optional[dict[str, Any]]:
    # The call's arguments by name (None: not a form this module knows).
    if len(args) > len(_SDPA_NAMES) or any(name not in _SDPA_NAMES for name in kwargs):
        return None
    named = dict(_SDPA_DEFAULTS, **dict(zip(_SDPA_NAMES, args)), **kwargs)
    return named if all(name in named for name in _SDPA_NAMES[:3]) else None


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A tensor's size, strides, dtype and device: what cuDNN's plan cache keys on."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    extent: int  # elements of the storage its strides reach (a view's gaps included)

    @classmethod
    def of(cls, t: torch.Tensor) -> "_Layout":
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.requires_grad,
                   storage_extent_bytes(t) // t.element_size())

    @property
    def nbytes(self) -> int:
        return self.extent * self.dtype.itemsize

    def zeros(self) -> torch.Tensor:
        # Same size and strides on fresh storage (expanded dimensions too): the plan's key, not
        # the real values, which may be gone by now (a recomputed layer saves none).
        flat = torch.zeros(self.extent, dtype=self.dtype, device=self.device)
        return flat.as_strided(self.size, self.stride).requires_grad_(self.requires_grad)


def _detached(t: torch.Tensor) -> torch.Tensor:
    # The copy's saved tensors stay as they are (not offloaded, not counted). Detached: a saved
    # output kept as itself would hold its own grad_fn.
    return t.detach()


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _run_backward(output: torch.Tensor, failures: list[BaseException]) -> None:
    """On the short-lived thread: autograd runs the copy's backward node on its device thread,
    which builds and caches cuDNN's backward plan there. The output's own values are its incoming
    gradient: the output's layout, which torch's cuDNN backward brings any incoming gradient to
    first, so the plan is the real backward's."""
    try:
        with torch.cuda.device(output.device) if output.is_cuda else contextlib.nullcontext():
            torch.autograd.backward(output, output.detach())
    except BaseException as exc:  # an optimisation: a failure is reported, never raised
        failures.append(exc)


class _FirstAttention(TorchFunctionMode):
    """Pushed for the first layer's forward: notes its first attention call's layout."""

    def __init__(self, graphs: "AttentionGraphs") -> None:
        super().__init__()
        self._graphs = graphs

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Optional[dict] = None) -> Any:
        # The mode is off while this runs: the calls below do not come back here.
        out = func(*args, **(kwargs or {}))
        if func is _SDPA and self._graphs.noted is None:
            self._graphs.note(args, kwargs or {}, out)
        return out


class AttentionGraphs:
    """Builds, on autograd's device thread, the cuDNN attention backward of each new input shape
    while its forward runs (see the module notes). The context calls :meth:`before_layer` at the
    first layer's entry and, while a copy runs, at each later one; :meth:`first_layer_done` at
    the first layer's exit; :meth:`wait` at the ``with``'s exit."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.watching: Optional[_FirstAttention] = None  # pushed for the first layer's forward
        self.noted: Optional[dict[str, Any]] = None  # its first attention call's layout and options
        self.thread: Optional[threading.Thread] = None  # the copy's, running or done
        self.built: list[tuple[int, ...]] = []  # the query sizes whose backward was built ahead
        self._seen: set[tuple[Any, ...]] = set()
        self._failures: list[BaseException] = []

    def before_layer(self, position: Optional[int], count: int, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Layer ``position`` of ``count`` begins, called with ``args``/``kwargs``: the first
        layer's attention is watched when its input shape is new to this context; at the last
        layer's entry the copy is waited for, so its bytes are gone before the last layer, the
        head and the loss."""
        if position == 0:
            self.first_layer(checkpoint_inputs(args, kwargs))
        elif self.thread is not None and position == count - 1:
            self.wait()

    def first_layer(self, inputs: Sequence[torch.Tensor]) -> None:
        """The forward's first layer begins (``inputs``: its tensor arguments): watch its
        attention when its input shape is new to this context."""
        hidden = next((t for t in inputs if t.dim() >= 2), None)
        if not self.enabled or hidden is None or not torch.is_grad_enabled():
            return
        shape = (tuple(hidden.shape), hidden.dtype, hidden.device)
        if shape in self._seen:
            return
        self._seen.add(shape)
        if (hidden.is_cuda and torch.cuda.is_current_stream_capturing()) or dynamo_compiled_code():
            return
        self.watching = _FirstAttention(self)
        self.watching.__enter__()

    def note(self, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
        """The first layer's first attention call ``args``/``kwargs`` returned ``out``: note its
        layout where a copy can help and cannot change a result (module notes)."""
        call = _call_arguments(args, kwargs)
        if call is None or not isinstance(out, torch.Tensor) or out.grad_fn is None or \
                any(type(call[name]) is not torch.Tensor for name in ("query", "key", "value")):
            return  # (a tensor subclass, DTensor or fake, is left to its own dispatch)
        mask = call["attn_mask"]
        if call["dropout_p"] or (isinstance(mask, torch.Tensor) and mask.requires_grad) or \
                not self._cudnn_chosen(call):
            return
        # The layouts, not the tensors: a recomputed layer frees its own at its exit.
        self.noted = dict(call, **{name: _Layout.of(call[name]) for name in ("query", "key", "value")})

    def first_layer_done(self) -> None:
        """The first layer's forward ended (or failed): stop watching, and run the noted call
        once more here, outside the layer's forward (a selective checkpoint's cache inside it
        would keep the copy's output until the layer's backward), its backward on another thread."""
        if self.watching is None:
            return
        mode, self.watching = self.watching, None
        mode.__exit__(None, None, None)
        call, self.noted = self.noted, None
        if call is None or _get_current_dispatch_mode() is not None or torch._C._len_torch_function_stack() > 0:
            return  # (another mode would see, or cache, the copy)
        layouts = [call[name] for name in ("query", "key", "value")]
        if not self._room_for(layouts):
            return
        try:
            copy = dict(call, **{name: layout.zeros() for name, layout in zip(("query", "key", "value"), layouts)})
            # The forward's plan is cached on this thread by now (the real call built it).
            with torch.autograd.graph.saved_tensors_hooks(_detached, _same):
                output = _SDPA(**copy)
        except Exception as exc:
            self._give_up(exc)
            return
        self.built.append(layouts[0].size)
        self.thread = threading.Thread(target=_run_backward, args=(output, self._failures),
                                       name="offload-attention-backward", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        """Wait for the copy (its bytes are freed then); stop watching."""
        if self.watching is not None:
            self.first_layer_done()
        if self.thread is None:
            return
        self.thread.join()
        self.thread = None
        if self._failures:
            self._give_up(self._failures[0])
            self._failures.clear()

    @staticmethod
    def _cudnn_chosen(call: dict[str, Any]) -> bool:
        # The backend torch picks for this call (the same inputs, so the same pick as the real
        # call's): only cuDNN builds per shape.
        try:
            choice = torch._fused_sdp_choice(call["query"], call["key"], call["value"], call["attn_mask"],
                                             call["dropout_p"], call["is_causal"], scale=call["scale"],
                                             enable_gqa=call["enable_gqa"])
        except Exception:
            return False
        return int(choice) == _CUDNN

    @staticmethod
    def _room_for(layouts: Sequence[_Layout]) -> bool:
        # The copy's inputs, output and gradients (twice the inputs, and the output at the query's
        # size) free twice over, cached blocks counted: never a copy that could run the device out
        # of memory (a planner reads out-of-memory counts as its step's).
        device = layouts[0].device
        if device.type != "cuda":
            return True
        need = 2 * (2 * sum(layout.nbytes for layout in layouts) + layouts[0].nbytes)
        return device_room_bytes(device)[0] >= need

    def _give_up(self, exc: BaseException) -> None:
        self.enabled = False
        warnings.warn(f"offload: building a new length's attention backward ahead failed ({type(exc).__name__}: "
                      f"{exc}); the backward builds it itself, and this is not tried again", RuntimeWarning,
                      stacklevel=2)
