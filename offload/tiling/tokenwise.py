"""Token-wise modules (an MLP) run over chunks of tokens, forward and backward, so that their wide
intermediate (``T x intermediate``, several of them in a SwiGLU MLP) never exists whole.

Why. At long context an MLP's intermediates are the largest transients of a layer: a Llama-8B
MLP at 32k tokens holds ``gate(x)``, ``up(x)``, ``silu(gate(x))`` and their product, each
``32768 x 14336`` bf16 (0.9 GiB). A module whose every output row depends only on its own input
row can run on a few thousand rows at a time; backward recomputes each chunk from the module's
input and differentiates it alone, so only one chunk's intermediates exist at any moment.

How. :func:`tiled_tokenwise` is one ``torch.autograd.Function``:

- forward runs the chunks without grad and writes them into one output; the module's input is
  the one tensor it saves (``save_for_backward``, so it passes through the saved-tensor hooks:
  an offload context may move it to host, a non-reentrant checkpoint may drop it);
- backward recomputes each chunk under grad (and under the autocast state of the forward, as
  ``torch.utils.checkpoint`` does), takes its gradients with ``torch.autograd.grad``, writes the
  input's gradient rows into one tensor and sums each parameter's gradient in float32 in chunk
  order, cast to the parameter's dtype at the end;
- the parameters are the Function's inputs, so autograd accumulates their gradients once per
  backward: DDP/FSDP gradient hooks and ``register_post_accumulate_grad_hook`` fire once, not
  once per chunk.

Numbers. One chunk (tokens <= chunk) is bitwise the plain module. Several chunks: each output
and input-gradient row is the same computation on the same row, but a GEMM's kernel (and so its
rounding) may depend on how many rows it gets; weight gradients are summed chunk by chunk, in
another order than one big GEMM sums them. A tiled step is bitwise repeatable, and bitwise equal
with and without offload or a checkpoint around it.

What cannot be checked: that the module is token-wise. That is the caller's promise;
:func:`tokenwise_support` refuses only what it can see (active dropout, whose recompute would
draw other random numbers). Attention, or anything mixing tokens, gives wrong results here.

:func:`tile_tokenwise` installs :class:`TiledForward` as a module's ``forward`` (an instance
attribute, like ``offload.selective_recompute``); it tiles only calls with one tensor of more
rows than the chunk while grad is enabled, and calls the module plainly otherwise.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import weakref
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from ..forwards.instance import InstalledForwards, check_own_forward, module_list
from ..forwards.stateful import StatefulArgumentError, stateful_arguments

__all__ = ["tiled_tokenwise", "tokenwise_support", "TiledForward", "TiledTokenwise", "tile_tokenwise"]

Chunk = Union[int, Callable[[], int]]


def _check_chunk(where: str, chunk_tokens: object) -> int:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int):
        raise TypeError(f"offload: {where}: chunk_tokens must be an int >= 1 (tokens per chunk), got {chunk_tokens!r}")
    if chunk_tokens < 1:
        raise ValueError(f"offload: {where}: chunk_tokens must be >= 1 (tokens per chunk), got {chunk_tokens}")
    return chunk_tokens


def _autocast_state(device_type: str) -> list[tuple[str, dict[str, Any]]]:
    # The autocast settings in force, to re-enter in backward: backward runs outside the
    # forward's `with torch.autocast`, and a recompute without it would compute other values
    # (and dtypes) than the forward did. Recorded as torch.utils.checkpoint records them.
    cache = torch.is_autocast_cache_enabled()
    kinds = [device_type] if device_type == "cpu" else [device_type, "cpu"]
    return [
        (kind, {"enabled": torch.is_autocast_enabled(kind), "dtype": torch.get_autocast_dtype(kind), "cache_enabled": cache})
        for kind in kinds if torch.amp.is_autocast_available(kind)
    ]


def _row_chunks(x: Tensor, chunk_tokens: int) -> list[tuple[int, int]]:
    rows = math.prod(x.shape[:-1])
    return [(start, min(start + chunk_tokens, rows)) for start in range(0, rows, chunk_tokens)]


def _chunk_view(flat: Tensor, start: int, stop: int, ndim: int) -> Tensor:
    # A chunk keeps the input's number of dims ((1, rows, H) for a (B, T, H) input), so that a
    # module checking its input's rank sees what it would see untiled.
    return flat[start:stop].view((1,) * (ndim - 2) + (stop - start, flat.shape[-1]))


def _call(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    y = fn(x)
    if not isinstance(y, Tensor):
        raise TypeError(f"offload: tiled_tokenwise: the function must return one tensor, got {type(y).__name__}")
    if y.dim() != x.dim() or y.shape[:-1] != x.shape[:-1]:
        raise ValueError(
            f"offload: tiled_tokenwise: the function turned an input of shape {tuple(x.shape)} into "
            f"{tuple(y.shape)}; a token-wise function keeps every dim but the last"
        )
    return y


class _TiledTokenwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable[[Tensor], Tensor], chunk_tokens: int, x: Tensor, *params: Tensor) -> Tensor:
        ctx.fn, ctx.chunk_tokens = fn, chunk_tokens
        ctx.autocast = _autocast_state(x.device.type)
        # x is the one tensor saved through the hooks. The parameters are held as they are: they
        # live in the module anyway, and the hooks (an offload context) have no business with
        # weights. Their versions stand in for the check save_for_backward would make.
        ctx.save_for_backward(x)
        ctx.params = params
        ctx.versions = [p._version for p in params]
        spans = _row_chunks(x, chunk_tokens)
        if len(spans) <= 1:
            # The whole input in its own shape: bitwise the plain module's forward.
            y = _call(fn, x)
            # An output aliasing the input (a module returning x) would make autograd treat it
            # as a view of this Function's input; a copy keeps the two apart.
            return y.clone() if y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() else y
        flat = x.reshape(-1, x.shape[-1])
        out = out_flat = None
        for start, stop in spans:
            y = _call(fn, _chunk_view(flat, start, stop, x.dim()))
            if out is None:
                out = y.new_empty(x.shape[:-1] + y.shape[-1:])
                out_flat = out.view(-1, y.shape[-1])
            out_flat[start:stop].copy_(y.reshape(-1, y.shape[-1]))
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:
        (x,) = ctx.saved_tensors
        params: tuple[Tensor, ...] = ctx.params
        for i, (p, version) in enumerate(zip(params, ctx.versions)):
            if p._version != version:
                raise RuntimeError(
                    f"offload: tiled_tokenwise: parameter {i} (shape {tuple(p.shape)}) was modified in place "
                    "between forward and backward; backward recomputes from the parameters, so it would "
                    "differentiate other weights than the forward used (step the optimizer after backward)"
                )
        need_x = ctx.needs_input_grad[2]
        need = [i for i in range(len(params)) if ctx.needs_input_grad[3 + i]]
        wanted = [params[i] for i in need]
        spans = _row_chunks(x, ctx.chunk_tokens)
        one = len(spans) <= 1
        width = x.shape[-1]
        flat = x.reshape(-1, width)
        grad_flat = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = x.new_empty(x.shape) if need_x and not one else None
        sums: list[Optional[Tensor]] = [None] * len(wanted)
        with torch.enable_grad(), contextlib.ExitStack() as autocast:
            for kind, kwargs in ctx.autocast:
                autocast.enter_context(torch.autocast(kind, **kwargs))
            for start, stop in spans:
                x_c = (x if one else _chunk_view(flat, start, stop, x.dim())).detach().requires_grad_(need_x)
                y = _call(ctx.fn, x_c)
                g_c = grad_out if one else grad_flat[start:stop].view(y.shape)
                inputs = ([x_c] if need_x else []) + wanted
                if y.requires_grad:
                    grads = list(torch.autograd.grad(y, inputs, g_c, allow_unused=True))
                else:  # the output depends on nothing that needs a gradient
                    grads = [None] * len(inputs)
                del y  # this chunk's graph (its intermediates) goes before the next is built
                if need_x:
                    gx = grads.pop(0)
                    if one:
                        grad_x = gx
                    elif gx is None:
                        grad_x.view(-1, width)[start:stop].zero_()
                    else:
                        grad_x.view(-1, width)[start:stop].copy_(gx.reshape(-1, width))
                for k, g in enumerate(grads):
                    if g is None:
                        continue
                    if one:
                        sums[k] = g  # as autograd gave it: bitwise the plain module's
                    elif sums[k] is None:
                        sums[k] = g.float() if g.dtype != torch.float32 else g.clone()
                    else:
                        # Float32, in fixed chunk order: deterministic, and bf16 partial sums
                        # would round away the later chunks' small contributions.
                        sums[k].add_(g)
        grad_params: list[Optional[Tensor]] = [None] * len(params)
        for k, i in enumerate(need):
            if sums[k] is not None:
                grad_params[i] = sums[k].to(params[i].dtype)
        return (None, None, grad_x, *grad_params)


def tiled_tokenwise(fn: Callable[[Tensor], Tensor], x: Tensor, params: Sequence[Tensor], chunk_tokens: int) -> Tensor:
    """``fn(x)``, run over chunks of ``chunk_tokens`` rows of ``x`` in forward and recomputed chunk
    by chunk in backward (see the module notes).

    ``fn``: a token-wise function (each output row depends only on its own input row of the last
    dim; the caller's promise, nothing checks it) returning one tensor of ``x``'s leading shape.
    ``x``: at least 2 dims; its rows are all dims but the last, flattened. ``params``: every
    tensor ``fn`` uses that may need a gradient (a module's parameters); their gradients reach
    autograd's accumulation once per backward. A tensor ``fn`` uses but ``params`` omits gets no
    gradient. ``chunk_tokens``: rows per chunk (the last chunk may be shorter); with one chunk
    the result and every gradient are bitwise those of ``fn(x)``.

    Backward recomputes from ``x`` and the parameters as they are then: a parameter changed in
    place in between (an optimizer step before backward) raises ``RuntimeError``. An ``x`` whose
    rows cannot be flattened as a view (a transposed batch) is copied once in forward and backward.
    """
    _check_chunk("tiled_tokenwise", chunk_tokens)
    if not isinstance(x, Tensor) or x.dim() < 2:
        raise ValueError(
            "offload: tiled_tokenwise: x must be a tensor of at least 2 dims (tokens..., features), got "
            f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}"
        )
    params = list(params)
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"offload: tiled_tokenwise: params item {i} is a {type(p).__name__}, not a tensor")
    return _TiledTokenwise.apply(fn, chunk_tokens, x, *params)


def _dropout_like(module: nn.Module) -> bool:
    # torch's dropouts share _DropoutNd; other libraries' dropouts are recognised by name and p.
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return True
    return "dropout" in type(module).__name__.lower() and isinstance(getattr(module, "p", None), (int, float))


def tokenwise_support(module: nn.Module) -> tuple[bool, str]:
    """Whether ``module`` may run under :func:`tiled_tokenwise`, and why (or why not).

    Refused: a module with an active dropout (a dropout-like submodule with ``p > 0`` in training
    mode): backward recomputes each chunk and would draw other random numbers than the forward.
    Everything else is accepted, but nothing here can verify that the module is token-wise (each
    output row depending only on its own input row): that is the caller's promise, and a module
    that mixes tokens (attention, a convolution over the sequence) gives wrong results tiled.
    """
    if not isinstance(module, nn.Module):
        return False, f"{type(module).__name__} is not a torch.nn.Module"
    for name, sub in module.named_modules():
        if _dropout_like(sub) and sub.training and float(getattr(sub, "p", 0.0)) > 0:
            where = f"submodule {name!r}" if name else "the module itself"
            return False, (
                f"{where} ({type(sub).__name__}, p={sub.p}) drops out in training mode; backward's recompute "
                "would draw other random numbers than the forward (set p=0 or call .eval() on it)"
            )
    return True, "no active dropout; that every output row depends only on its own input row is the caller's promise"


class TiledForward:
    """Stands in for a module's ``forward`` (an instance attribute) and runs it through
    :func:`tiled_tokenwise` when that is worth it and safe: grad enabled, the call is one
    positional tensor of at least 2 dims (no tensor keyword arguments; others are passed on),
    and its rows exceed the chunk. Otherwise it calls ``fn`` unchanged.

    ``module``: the module (held weakly: the bound ``fn`` holds it already). ``fn``: its original
    forward. ``chunk``: rows per chunk, or a zero-argument callable giving them for each call
    (0: run plainly). The parameters are the module's parameters that require grad, read at each
    call, so freezing one later is respected. A copy (``copy.deepcopy``, pickling) carries a
    working wrapper: an int chunk is kept, a callable one becomes 0 (plain), as a plan's wrappers
    become inert in a copy.
    """

    __slots__ = ("fn", "chunk", "_module")

    def __init__(self, module: nn.Module, fn: Callable[..., Any], chunk: Chunk) -> None:
        if not callable(chunk) and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0):
            raise ValueError(f"offload: TiledForward: chunk must be an int >= 0 (0: run plainly) or a callable, got {chunk!r}")
        self._module = weakref.ref(module)
        self.fn = fn
        self.chunk = chunk

    @property
    def module(self) -> Optional[nn.Module]:
        """The wrapped module (None once it is garbage collected)."""
        return self._module()

    def _chunk_now(self) -> int:
        chunk = self.chunk() if callable(self.chunk) else self.chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise ValueError(f"offload: TiledForward: the chunk callable must return an int >= 0 (0: run plainly), got {chunk!r}")
        return chunk

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        if (
            module is None or not torch.is_grad_enabled() or len(args) != 1 or not isinstance(args[0], Tensor)
            or args[0].dim() < 2 or any(isinstance(v, Tensor) for v in kwargs.values())
        ):
            return self.fn(*args, **kwargs)
        x = args[0]
        chunk = self._chunk_now()
        if chunk == 0 or math.prod(x.shape[:-1]) <= chunk:
            return self.fn(*args, **kwargs)
        ok, why = tokenwise_support(module)
        if not ok:
            # Checked per call too: a module wrapped in eval mode may be trained later.
            raise RuntimeError(f"offload: a tiled {type(module).__name__} cannot run tiled now: {why}")
        states = stateful_arguments((), kwargs)
        if states:
            # Backward replays each chunk with the same arguments: a cache would be updated once
            # per chunk and again per replay (and a module reading one mixes tokens anyway).
            raise StatefulArgumentError(
                f"offload: a tiled {type(module).__name__} was called with a KV cache "
                f"({', '.join(name for name, _ in states)}); a module that reads one is not token-wise: "
                "tile only modules like the MLP, or pass use_cache=False to the model"
            )
        fn = functools.partial(self.fn, **kwargs) if kwargs else self.fn
        params = [p for p in module.parameters() if p.requires_grad]
        return _TiledTokenwise.apply(fn, chunk, x, *params)

    def __deepcopy__(self, memo: dict[int, Any]) -> "TiledForward":
        module = self._module()
        if module is None:
            raise RuntimeError("offload: cannot copy a TiledForward whose module is gone")
        # Copied with the model, the module is in memo already: the copy wraps the copied module.
        chunk = self.chunk if not callable(self.chunk) else 0
        return TiledForward(copy.deepcopy(module, memo), copy.deepcopy(self.fn, memo), chunk)

    def __reduce__(self) -> tuple[Any, ...]:
        chunk = self.chunk if not callable(self.chunk) else 0
        return (TiledForward, (self._module(), self.fn, chunk))


class TiledTokenwise(InstalledForwards):
    """What :func:`tile_tokenwise` returns: the wrapped modules; :meth:`remove` unwraps."""

    wrapper = TiledForward


def tile_tokenwise(modules: Union[nn.Module, Iterable[nn.Module]], chunk_tokens: int) -> TiledTokenwise:
    """Run each module over chunks of ``chunk_tokens`` tokens, forward and backward, until
    ``remove()`` (see the module notes and :class:`TiledForward` for when a call is tiled).

    ``modules``: a module or an iterable of modules that work token by token, e.g.
    ``[l.mlp for l in model.model.layers]`` for a HuggingFace Llama; that they are token-wise is
    the caller's promise (:func:`tokenwise_support`). Usable as a context manager. Raises
    ``TypeError`` for something that is not a module or a ``chunk_tokens`` that is not an int,
    and ``ValueError`` for ``chunk_tokens < 1``, a module listed twice, wrapped already, with a
    ``forward`` set on the instance by other code, or refused by :func:`tokenwise_support`.
    """
    where = "tile_tokenwise"
    chunk_tokens = _check_chunk(where, chunk_tokens)
    chosen = module_list(modules, f"offload: {where}")
    for i, module in enumerate(chosen):
        check_own_forward(module, TiledForward, f"offload: {where}: item {i} ({type(module).__name__})", "is tiled already",
                          "tile the module it calls instead, or remove that override first")
        ok, why = tokenwise_support(module)
        if not ok:
            raise ValueError(f"offload: {where}: item {i} ({type(module).__name__}) cannot be tiled: {why}")
    if len({id(m) for m in chosen}) != len(chosen):
        raise ValueError(f"offload: {where}: a module is listed twice")
    for module in chosen:
        # An instance attribute: nn.Module.__call__ reads self.forward, so hooks and the class
        # stay as they are, and deleting it restores the class's forward.
        module.forward = TiledForward(module, module.forward, chunk_tokens)
    return TiledTokenwise(chosen)
