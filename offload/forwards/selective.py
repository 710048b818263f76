"""Selective recompute: keep the outputs of a module's GEMMs, recompute its cheap ops in backward.

Why. Most of the bytes an MLP saves for backward come from cheap pointwise ops. A Llama MLP,
``down(silu(gate(x)) * up(x))``, saves ``x``, ``gate(x)``, ``silu(gate(x))``, ``up(x)`` and the
product: four tensors of the intermediate width, two of them (the SiLU output and the product)
one pointwise op away from the other two. Recomputing those two in backward frees about 40% of
the layer's saved bytes for a few hundred microseconds of memory-bound work. Measured on our H100
on HF Llama-1B (16 layers, seq 4096, batch 4), every layer's MLP wrapped:

- plain: 302 ms, peak 34.8 GiB; wrapped: 310 ms (1.02x), peak 27.8 GiB;
- with 4 layers offloaded too: 432 ms at 28.1 GiB becomes 310 ms at 25.1 GiB: the offloaded
  layers have fewer bytes to move, and their copies hide under compute again;
- whole-layer recompute (HF checkpointing) frees about 1.6 GiB a layer for 5 ms of recompute; the
  same policy around whole Llama layers (norms, rotary embeddings and attention inputs recomputed
  too) freed 0.8 GiB a layer for 2.5 ms: the cheapest bytes are the MLP's.

How. Each wrapped module runs under non-reentrant ``torch.utils.checkpoint`` with torch's
selective policy (``create_selective_checkpoint_contexts``): the outputs of matrix products and
fused attention kernels (:data:`EXPENSIVE_OPS`) are kept from the forward, everything else is
recomputed from them in backward, by the same kernels on the same inputs, so the gradients are
bitwise those of the plain module.

Where the kept outputs live: torch's selective-checkpoint cache holds them on the GPU, outside
the saved-tensor hooks, so an offload context never sees (or offloads) them; it sees the module's
inputs, which checkpoint saves through the hooks. Wrap the part of a layer whose cheap ops are
worth recomputing (the MLP), not the whole layer: a whole layer's kept GEMM outputs would then
all stay resident.

Inside a whole-layer checkpoint (HF ``activation_checkpointing_enable``, an offload plan's
``RECOMPUTE`` layers) a wrapped module runs plainly: the outer checkpoint already drops
everything and recomputes it, and the selective cache would only hold memory the outer one frees.

Under ``torch.compile`` the checkpoint becomes a graph region whose policy AOTAutograd applies:
gradients are bitwise those of the same compiled model without it (aot_eager and inductor,
tested on CPU); the cache is not counted there.

Plans (``OffloadActivations(memory_budget_bytes=...)``, ``offload.plan``) count the cache: the
probe step counts, per layer, the outputs of :data:`EXPENSIVE_OPS` inside each wrapped module
(``LayerProfile.cached_bytes``), and the cost model holds them on the GPU from the layer's
forward to its backward unless the plan recomputes the layer. Wrap the modules before the plan's
probe steps run (before the first step, or before ``offload.plan``). Plans can also choose
selective recompute per layer themselves (their ``selective=`` argument): see
``offload.planner``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .instance import InstalledForwards, check_own_forward, module_list
from .recompute import checkpoint_call
from .stateful import refuse_stateful_compiled

aten = torch.ops.aten


def _expensive_ops() -> frozenset[Any]:
    # Matrix products (FLOP-bound: worth their bytes) and the fused attention kernels (their
    # backward needs their output and logsumexp anyway). Ops this torch build lacks are skipped.
    names = (
        "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_cudnn_attention", "_efficient_attention_forward", "_flash_attention_forward",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


# The ops whose outputs a selectively recomputed module keeps from its forward.
EXPENSIVE_OPS = _expensive_ops()


def keep_expensive(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective policy: keep the outputs of :data:`EXPENSIVE_OPS`, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if func in EXPENSIVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# The policy's contexts as a plain partial: what torch.compile accepts as ``context_fn``.
_policy_contexts = functools.partial(create_selective_checkpoint_contexts, keep_expensive)

# The fused attention kernels among them: what a recomputed layer planned ``keep_attention``
# keeps. At long lengths attention is most of a layer's forward (its FLOPs grow with the length
# squared, the rest with the length) while its output is one hidden-sized tensor and a logsumexp,
# so a recompute that skips it costs the layer's matrix products and cheap ops only.
ATTENTION_OPS = frozenset(op for op in EXPENSIVE_OPS if "attention" in op.name())


def keep_attention(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The policy of a recompute that keeps attention: keep :data:`ATTENTION_OPS`' outputs from
    the forward, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if func in ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# As _policy_contexts, for a plan's RECOMPUTE layers that keep attention (plan_wrappers.py).
attention_kept_contexts = functools.partial(create_selective_checkpoint_contexts, keep_attention)


def _inside_checkpoint() -> bool:
    # A checkpoint recomputing in backward (reentrant or not): a backward is running on this
    # thread. The forward of a non-reentrant checkpoint: the saved-tensor hooks in force are
    # its own (torch.utils.checkpoint defines them inside _checkpoint_hook). A reentrant
    # checkpoint runs its forward without grad, which the caller sees first.
    if torch._C._current_graph_task_id() != -1:
        return True
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        return False
    if getattr(hooks[0], "inside_checkpoint", False):  # a planner probe's checkpointed layer
        return True
    name = getattr(hooks[0], "__qualname__", "")
    return "_checkpoint_hook" in name


class SelectiveForward:
    """Stands in for a module's ``forward``: runs it under the selective policy when it builds a
    graph for backward, and plainly otherwise (no grad, or inside a whole-layer checkpoint).

    ``when`` (a plan's per-layer choice, see ``OffloadActivations``): called at each forward;
    the module runs selectively only when it returns True. None: always.
    """

    __slots__ = ("fn", "when")

    def __init__(self, fn: Callable[..., Any], when: Optional[Callable[[], bool]] = None) -> None:
        self.fn = fn
        self.when = when

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.when is not None and not self.when():
            return self.fn(*args, **kwargs)
        if torch.compiler.is_compiling():
            # Dynamo turns the checkpoint into a graph region whose policy AOTAutograd applies
            # when it partitions the graph: it wants a plain context function. Its recompute is
            # traced into the graph, where a KV cache's Python state cannot be put back.
            refuse_stateful_compiled(self.fn, args, kwargs)
            return checkpoint(self.fn, *args, use_reentrant=False, context_fn=_policy_contexts, **kwargs)
        if not torch.is_grad_enabled() or _inside_checkpoint():
            return self.fn(*args, **kwargs)
        return checkpoint_call(self.fn, args, kwargs, context_fn=_policy_contexts)


def always_selective(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs under :func:`selective_recompute` (not a plan's per-layer choice)."""
    wrapper = module.__dict__.get("forward")
    return isinstance(wrapper, SelectiveForward) and wrapper.when is None


class SelectiveRecompute(InstalledForwards):
    """What :func:`selective_recompute` returns: the wrapped modules; :meth:`remove` unwraps."""

    wrapper = SelectiveForward


def selective_recompute(modules: Union[torch.nn.Module, Iterable[torch.nn.Module]]) -> SelectiveRecompute:
    """Run each module under selective recompute (see the module notes) until ``remove()``.

    ``modules``: a module or an iterable of modules, e.g. ``[l.mlp for l in model.model.layers]``
    for a HuggingFace Llama. Usable as a context manager. Raises ``TypeError`` for something
    that is not a module, and ``ValueError`` for a module wrapped already or one whose
    ``forward`` was replaced on the instance by someone else (wrapping it would hide theirs).
    """
    where = "offload.selective_recompute"
    chosen = module_list(modules, where)
    for i, module in enumerate(chosen):
        check_own_forward(module, SelectiveForward, f"{where}: item {i} ({type(module).__name__})", "is wrapped already",
                          "wrap the module it calls instead, or remove that override first")
    if len({id(m) for m in chosen}) != len(chosen):
        raise ValueError("offload.selective_recompute: a module is listed twice")
    for module in chosen:
        # An instance attribute: nn.Module.__call__ reads self.forward, so hooks and the class
        # stay as they are, and deleting it restores the class's forward.
        module.forward = SelectiveForward(module.forward)
    return SelectiveRecompute(chosen)


# What a plan may run selectively in each layer when not told (``selective=None``): HF-style
# decoder layers keep their MLP under this name (Llama, Mistral, Qwen, Gemma, GPT-2's ``mlp``).
DEFAULT_CANDIDATES = ("mlp",)

Candidates = Union[
    None, bool, str, Sequence[str], torch.nn.Module, Iterable[torch.nn.Module],
    Callable[[torch.nn.Module], Iterable[torch.nn.Module]],
]


def describe_candidates(value: object) -> str:
    """``selective=`` in a few words, for error messages."""
    # Short: a list of 16 LlamaMLP blocks printed whole would fill the screen.
    if isinstance(value, (list, tuple, torch.nn.ModuleList)):
        kinds = sorted({type(v).__name__ for v in value})
        more = ", ..." if len(kinds) > 3 else ""
        return f"a {type(value).__name__} of {len(value)} ({', '.join(kinds[:3])}{more})"
    text = repr(value) if not isinstance(value, torch.nn.Module) else f"a {type(value).__name__} module"
    return text if len(text) <= 80 else text[:77] + "..."


def _given_modules(layers: Sequence[torch.nn.Module], modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    # Candidates given as modules (what offload.selective_recompute takes): each must sit inside
    # one of the layers, where the plan decides per layer.
    inside = {id(m) for layer in layers for m in layer.modules()}
    for i, m in enumerate(modules):
        if id(m) not in inside:
            raise ValueError(
                f"offload: selective= item {i} (a {type(m).__name__}) is inside none of the layers; "
                "pass submodules of the layers (e.g. [layer.mlp for layer in model.layers])"
            )
    return modules


def selective_candidates(layers: Sequence[torch.nn.Module], selective: Candidates) -> list[torch.nn.Module]:
    """The modules a plan may run under selective recompute, layer by layer.

    ``selective``: None or True: each layer's submodules named in :data:`DEFAULT_CANDIDATES`
    (layers without one have none); False: none; a name or names (dotted paths inside a layer,
    e.g. ``"mlp"`` or ``["mlp", "self_attn.o_proj"]``): those, in every layer (a layer lacking one
    is an error); a module or modules inside the layers (as :func:`selective_recompute` takes
    them, e.g. ``[layer.mlp for layer in model.layers]``); a callable: ``selective(layer)`` gives
    the modules. Modules made selective by :func:`selective_recompute` already stay so and are
    left out.
    """
    if selective is False:
        return []
    names: Optional[Sequence[str]] = None
    given: Optional[list[torch.nn.Module]] = None
    required = True
    if selective is None or selective is True:
        names, required = DEFAULT_CANDIDATES, False
    elif isinstance(selective, str):
        names = [selective]
    elif isinstance(selective, torch.nn.Module) and not isinstance(selective, torch.nn.ModuleList):
        # One module, a Sequential MLP included (a ModuleList of them is a list, below).
        given = _given_modules(layers, [selective])
    elif not callable(selective) or isinstance(selective, torch.nn.ModuleList):  # (a ModuleList is callable)
        try:
            items = list(selective)  # type: ignore[arg-type]
        except TypeError:
            items = None
        if items is not None and items and all(isinstance(m, torch.nn.Module) for m in items):
            given = _given_modules(layers, items)
        elif items is not None and all(isinstance(n, str) for n in items):
            names = items
        else:
            raise TypeError(
                "offload: selective= takes None (each layer's 'mlp'), False, a submodule name or names "
                "(e.g. 'mlp'), modules inside the layers, or a callable layer -> modules; got "
                f"{describe_candidates(selective)}"
            )
    if given is not None:
        return [m for m in dict.fromkeys(given) if not always_selective(m)]
    out: dict[torch.nn.Module, None] = {}
    for i, layer in enumerate(layers):
        if names is None:
            found = list(selective(layer))  # type: ignore[operator]
        else:
            found = []
            for name in names:
                try:
                    found.append(layer.get_submodule(name))
                except AttributeError:
                    if required:
                        raise ValueError(
                            f"offload: selective={describe_candidates(selective)}: layer {i} ({type(layer).__name__}) has no "
                            f"submodule {name!r}; name a submodule every layer has, or pass a callable"
                        ) from None
        for m in found:
            if not isinstance(m, torch.nn.Module):
                raise TypeError(f"offload: selective candidates must be modules, got {type(m).__name__} in layer {i}")
            if m is layer:
                raise ValueError(
                    f"offload: selective candidate of layer {i} is the layer itself; whole layers are "
                    "the plan's RECOMPUTE action, selective candidates are parts of them (its MLP)"
                )
            if not always_selective(m):
                out[m] = None
    return list(out)
