"""The short probe's step (:mod:`offload.layers.model_form`): a causal-LM call cut to a few tokens
a sequence and run as one whole training step, forward and backward, that nothing the user can
observe sees.

Why invisible. It runs inside the user's own call, two or three times before the call itself: a
gradient, hook call or freed graph it left behind would change the user's step (issue 49: an
optimizer stepping in ``register_post_accumulate_grad_hook`` took three extra updates). So:

- **the inputs are the probe's own**: each tensor argument is cut to the probe's length and
  detached (a new leaf, requiring grad as the argument did), so the probe's backward neither
  reaches nor frees the caller's graph (``inputs_embeds`` built from a trainable tensor) and puts
  nothing into a leaf ``inputs_embeds``' ``.grad``;
- **no gradient is accumulated**: the backward is ``torch.autograd.grad`` over the graph's leaves
  (the parameters and those inputs), which runs every node ``loss.backward()`` runs but returns the
  gradients instead of adding them to ``.grad``, so ``register_post_accumulate_grad_hook`` and
  DDP's gradient hooks do not fire. The parameters' ``.grad`` are set aside meanwhile (the probe
  measures the weight gradients a first step allocates) and put back after;
- **gradient hooks are hidden**: the parameters' tensor hooks and post-accumulate-grad hooks and the
  modules' backward hooks are emptied in place for the probe and put back, in order, after it;
- **state is given back**: the random number generators (``fork_rng``) and any buffer the forward
  changed in place (running statistics);
- **FSDP2's hooks run**: they are part of the computation (they all-gather each module's
  parameters for its call and reshard them after), and what they leave is what an FSDP2
  iteration leaves: the probe's backward accumulates no gradient, so they reduce-scatter none and
  the sharded ``.grad`` stay as they were. An FSDP2 root is probed ahead of its own hooks, each
  probe step a whole call of the model (``through_module``; :mod:`offload.layers.model_form` says
  why); a root whose hooks ran already (``fully_shard`` applied after the context was made) is
  refused;
- **observers run**: a hook (function or object) with a true ``offload_probe_observer`` attribute
  says it computes nothing and may see the probe steps' calls (a progress line, a timer:
  ``benchmarks/cp_long_step.py``'s clock), so it does not send the batch to a full-length probe;
- **what cannot be hidden is refused**, and the step is probed at its full length instead (its
  probe step is then the user's own step): other forward hooks and pre-hooks on the model's modules
  (they may compute, as weight norm's or PEFT's do, so they cannot be skipped, and a hook
  that counts calls would count the probe's), global module hooks (other models share them), and
  an argument that cannot be cut to the probe's length or would be written to (a cache, packed
  sequences' offsets, a tensor whose layout is not one of those below).

What is cut: every tensor argument whose dims carry the call's length ``T``: ``(B or 1, T, ...)``
on dim 1 (``input_ids``, ``labels``, 2-D masks, ``position_ids`` of HF's ``(1, T)`` layout,
``token_type_ids``, ``inputs_embeds``), 4-D masks ``(B or 1, heads or 1, T, T)`` on both last
dims, ``(T,)`` on its one dim (``cache_position``), and ``(k, B or 1, T)`` on its last
(multimodal RoPE's position ids).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional

import torch

from ..planner.shapes import StepShape

__all__ = ["ShortStep", "cut_dims", "is_fsdp2_root"]

# Scalars and options a call may carry beside its tensors: passed through as they are.
_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)
# Packed sequences' offsets (flash attention's kwargs): they index the uncut batch.
_PACKED = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def cut_dims(value: torch.Tensor, shape: StepShape) -> Optional[tuple[int, ...]]:
    """The dims of ``value`` to cut to the probe's length (empty: none carries the length), or
    None where a dim of the call's length sits in a layout the probe does not know."""
    batch, length, dims = shape.batch, shape.length, tuple(value.shape)
    if length not in dims:
        return ()
    if len(dims) == 1:
        return (0,)
    if len(dims) == 4 and dims[0] in (1, batch) and dims[2] == dims[3] == length:
        return (2, 3)
    if dims[0] in (1, batch) and dims[1] == length:
        return (1,)
    if len(dims) == 3 and dims[1] in (1, batch) and dims[2] == length:
        return (2,)
    return None


def _cut(value: torch.Tensor, dims: tuple[int, ...], length: int) -> torch.Tensor:
    for dim in dims:
        value = value.narrow(dim, 0, length)
    # A leaf of the probe's own: its backward stops here, short of the caller's graph and .grad.
    return value.detach().requires_grad_(value.requires_grad)


def _argument_problem(name: str, value: Any, shape: StepShape) -> str:
    if name in _PACKED and value is not None:
        return f"{name} is given (packed sequences): its offsets index the whole batch, which the probe cuts"
    if isinstance(value, torch.Tensor):
        if cut_dims(value, shape) is None:
            return (f"{name} has shape {tuple(value.shape)}, with a dim of the call's length ({shape.length}) "
                    "in a layout the probe cannot cut")
        return ""
    if isinstance(value, _PLAIN):
        return ""
    return (f"{name} is a {type(value).__name__}: the probe can neither cut it to its length nor promise to leave "
            "it unchanged (a cache would be written to)")


# Whose module hooks the probe runs: ours, and FSDP2's (its home since torch 2.6, and before).
_KNOWN_HOOKS = ("offload.", "torch.distributed.fsdp._fully_shard.", "torch.distributed._composable.fsdp.")


def _is_known(hook: Any) -> bool:
    owner = getattr(hook, "__self__", hook)
    if getattr(hook, "offload_probe_observer", False) or getattr(owner, "offload_probe_observer", False):
        return True
    return str(getattr(owner, "__module__", "") or type(owner).__module__).startswith(_KNOWN_HOOKS)


def is_fsdp2_root(model: torch.nn.Module) -> bool:
    """Whether ``model`` is an FSDP2 module (``fully_shard``), whose hooks unshard it per call."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without distributed
        return False
    return isinstance(model, FSDPModule)


def _hook_problem(model: torch.nn.Module, through_module: bool) -> str:
    from torch.nn.modules import module as nn_module

    for kind in ("forward_pre", "forward", "backward_pre", "backward"):
        if any(not _is_known(h) for h in getattr(nn_module, f"_global_{kind}_hooks").values()):
            return (f"a global module {kind.replace('_', ' ')} hook is registered (torch.nn.modules.module."
                    "register_module_..._hook): it is shared with every module, so the probe cannot hide it")
    if not through_module and is_fsdp2_root(model):
        return (f"{type(model).__name__} is an FSDP2 root whose hooks ran before the probe could (fully_shard "
                "was applied after OffloadActivations(..., model=) was made): make the context after fully_shard")
    for name, module in model.named_modules():
        if module is model and not through_module:
            continue  # the probe calls the model's forward itself, not the module: its hooks never run
        for kind, hooks in (("forward pre-hook", module._forward_pre_hooks), ("forward hook", module._forward_hooks)):
            theirs = [h for h in hooks.values() if not _is_known(h)]
            if theirs:
                what = getattr(theirs[0], "__qualname__", type(theirs[0]).__name__)
                where = f"{type(model).__name__}.{name}" if name else f"{type(model).__name__} itself"
                return (f"{where} has a {kind} ({what}); it may be part of the computation, so "
                        "the probe cannot skip it, and running it would show it the probe steps' calls")
    return ""


@contextlib.contextmanager
def _gradient_hooks_hidden(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> Iterator[None]:
    # Emptied in place, so the handles the user holds (weak references to these dicts) still
    # remove their hooks after; put back in their order.
    dicts = [d for m in model.modules() for d in (m._backward_hooks, m._backward_pre_hooks)]
    dicts += [d for p in params for d in (p._backward_hooks, p._post_accumulate_grad_hooks) if d is not None]
    saved = [(d, list(d.items())) for d in dicts if d]
    for d, _ in saved:
        d.clear()
    try:
        yield
    finally:
        for d, items in saved:
            d.clear()
            d.update(items)


@contextlib.contextmanager
def _state_given_back(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> Iterator[None]:
    grads = [p.grad for p in params]
    buffers = [(b, b._version, b.clone()) for b in model.buffers()]
    # Every CUDA device the model is on (not only its trainable parameters': a frozen model
    # trained through a leaf inputs_embeds has none).
    devices = list(dict.fromkeys(p.device for p in model.parameters() if p.device.type == "cuda"))
    for p in params:
        p.grad = None
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for p, g in zip(params, grads):
            p.grad = g
        with torch.no_grad():
            for b, version, before in buffers:
                if b._version != version:
                    b.copy_(before)


def _graph_leaves(root: torch.Tensor) -> list[torch.Tensor]:
    """The tensors ``root.backward()`` would accumulate gradients into (its graph's leaves)."""
    leaves: list[torch.Tensor] = []
    seen: set[Any] = set()
    stack = [root.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node's leaf
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        stack.extend(child for child, _ in node.next_functions)
    return leaves


class ShortStep:
    """One whole training step of a causal-LM call cut to ``length`` tokens a sequence
    (``step(length)``), invisible to the user (see the module notes). ``refused``: why the call
    cannot be probed so (empty when it can); ``failed``: what the step raised, if it did."""

    def __init__(self, model: torch.nn.Module, fn: Callable[..., Any], arguments: dict[str, Any],
                 shape: StepShape, through_module: bool = False) -> None:
        self.model, self.fn, self.arguments, self.shape = model, fn, arguments, shape
        self.through_module = through_module  # calls the model itself, hooks and all (an FSDP2 root)
        self.failed: Optional[BaseException] = None
        self.length = 0

    @functools.cached_property
    def refused(self) -> str:
        """Why this call cannot be probed short unseen (empty when it can); asked only of a call
        long enough to be (it walks the model's modules)."""
        problems = (_argument_problem(name, value, self.shape) for name, value in self.arguments.items())
        return next((p for p in problems if p), "") or _hook_problem(self.model, self.through_module)

    def __call__(self, length: int) -> None:
        self.length = length
        call = {}
        for name, value in self.arguments.items():
            dims = cut_dims(value, self.shape) if isinstance(value, torch.Tensor) else None
            call[name] = _cut(value, dims, length) if dims is not None else value
        params = [p for p in self.model.parameters() if p.requires_grad]
        try:
            with _state_given_back(self.model, params), _gradient_hooks_hidden(self.model, params):
                out = (self.model if self.through_module else self.fn)(**call)
                loss = out.loss if hasattr(out, "loss") else out[0]
                # The logits must not outlive the forward (as in a loop that keeps the loss
                # only): held through backward, the probe would count them as the head's.
                del out
                leaves = _graph_leaves(loss) if isinstance(loss, torch.Tensor) else []
                if leaves:
                    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
                    del grads
                else:
                    loss.backward()  # nothing needs a gradient: raises as the step itself would
        except BaseException as exc:
            self.failed = exc
            raise

    def refusal_warning(self, probe_tokens: int) -> str:
        """The warning that the first batch is probed at its full length, and why."""
        return (f"offload: the first batch ({self.shape}) is probed at its full length, not cut to {probe_tokens} "
                f"tokens: {self.refused}. The short probe runs only where it changes nothing the step can observe; "
                "a step probed at its full length takes as long (and as much memory) as a plain step")

    def explain(self, exc: BaseException) -> BaseException:
        """``exc`` (from the probe steps) as the user should read it: a failure of this short
        step is named as the short probe's, with how to turn it off."""
        failed = self.failed
        if failed is None or (exc is not failed and exc.__cause__ is not failed):
            return exc
        if isinstance(failed, torch.OutOfMemoryError):
            return exc
        error = RuntimeError(
            f"offload: the short probe (this call cut to {self.length} tokens a sequence, {self.shape} given) "
            f"raised {type(failed).__name__}: {str(failed).rstrip('.')}. The call itself has not run yet. If the step runs without "
            "offload, the probe could not cut its inputs: pass OffloadActivations(..., short_probe=False) to probe "
            "the first batch at its full length instead (and tell us the inputs it could not cut)"
        )
        error.__cause__ = failed
        return error
