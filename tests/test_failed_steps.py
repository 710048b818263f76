"""A step that fails, or a forward that never gets its backward, gives everything back.

An out-of-memory retry loop (a batch-size finder, a sweep, the planner's own probing) must find
the memory of the failed step free again: no saved tensor, group, reload buffer, host region or
claim may outlive it, in any schedule or call shape. Each case below fails one way, checks that
nothing is left, then retries with the same context and compares the gradients bit for bit with
the plain run. The layers save their own outputs (sigmoid, rsqrt), the case that used to leave a
reference cycle through autograd's graph.

Also here: in-place changes of saved tensors after their group was released (v1 releases early),
and the layer count of TransformerEngine's call shape when a layer runs under a reentrant
checkpoint.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
import weakref
from typing import Any, Callable, Optional

import pytest
import torch
import torch.utils.checkpoint as checkpoint
from torch import nn

import offload
from offload.engine.entry_table import empty_keeping_versions, own_alias
from offload.engine.group import Group
from offload.planner import Action, LayerPlan, plan_for

from _util import hooks_installed

N_LAYERS = 6
WIDTH = 64
FAILING_LAYER = 3   # "in_layer": raises inside this layer, after part of it has run
BOOM_LAYER = 2      # "backward_raises": its output's backward raises, after later layers' ran

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


class Boom(torch.autograd.Function):
    """Identity forward; a backward that raises (backward failing halfway through the model)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backward failed")


class RMS(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # rsqrt saves its output


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.sigmoid(self.up(x)))  # sigmoid saves its output


class Layer(nn.Module):
    """A pre-norm residual block that can be told to fail in forward or in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RMS()
        self.mlp = MLP()
        self.fail_forward = False
        self.fail_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mlp(self.norm(x))
        if self.fail_forward:
            raise RuntimeError("the layer failed")  # after saving part of its tensors
        out = x + h
        return Boom.apply(out) if self.fail_backward else out


def make_layers(device: str) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(Layer() for _ in range(N_LAYERS)).to(device)


def run_plain(layers: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


# -- the forms: (wrapper around the forward, or a TE context) -------------------------------------
class Form:
    """One way of offloading: builds its context and runs one forward under it."""

    def __init__(self, name: str, make: Callable[[nn.ModuleList, str], Any], te: bool = False) -> None:
        self.name, self.make, self.te = name, make, te

    def forward(self, handle: Any, layers: nn.ModuleList, x: torch.Tensor, fail_after: bool) -> torch.Tensor:
        if self.te:
            ctx, sync = handle
            for layer in layers:
                with ctx:
                    x = layer(x)
                x = sync(x)
            if fail_after:
                raise RuntimeError("the head failed")
            return x
        with handle:
            x = run_plain(layers, x)
            if fail_after:
                raise RuntimeError("the head failed")
        return x

    def engine(self, handle: Any) -> Any:
        return handle[0].engine if self.te else handle.engine


def _options(device: str) -> dict[str, Any]:
    return {"device": device, "min_offload_bytes": 0}


def _planned(layers: nn.ModuleList, device: str) -> Any:
    x = torch.randn(4, 8, WIDTH, device=device)

    def step() -> None:
        run_plain(layers, x.requires_grad_()).sum().backward()

    profile = offload.planner.profile_step(layers, step, **_options(device))
    layers.zero_grad(set_to_none=True)
    actions = [Action.OFFLOAD, Action.RECOMPUTE, Action.OFFLOAD, Action.KEEP, Action.OFFLOAD, Action.KEEP]
    made = plan_for(profile, [LayerPlan(a) for a in actions])
    return offload.OffloadActivations(layers, plan=made, **_options(device))


FORMS = [
    Form("layers_k0", lambda layers, d: offload.OffloadActivations(layers, num_offload_layers=0, **_options(d))),
    Form("layers_k2", lambda layers, d: offload.OffloadActivations(layers, num_offload_layers=2, **_options(d))),
    Form("layers_k5", lambda layers, d: offload.OffloadActivations(layers, num_offload_layers=5, **_options(d))),
    Form("layers_v1", lambda layers, d: offload.OffloadActivations(
        layers, num_offload_layers=2, mode="v1", selection="auto", **_options(d))),
    Form("planned", _planned),
    Form("layerless", lambda layers, d: offload.OffloadActivations(group_bytes=1 << 14, **_options(d))),
    Form("te_v2", lambda layers, d: offload.get_cpu_offload_context(True, 4, N_LAYERS, **_options(d)), te=True),
    Form("te_v1", lambda layers, d: offload.get_cpu_offload_context(
        True, 2, N_LAYERS, mode="v1", selection="auto", **_options(d)), te=True),
    Form("te_v1_double_buffering", lambda layers, d: offload.get_cpu_offload_context(
        True, 2, N_LAYERS, mode="v1", selection="auto", double_buffering=True, **_options(d)), te=True),
]
FAILURES = ["in_layer", "after_last", "loss_dropped", "backward_raises"]


def _memory(device: str) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else 0


def _groups_of(engine: Any) -> list[Group]:
    return [o for o in gc.get_objects() if type(o) is Group and getattr(o.on_free, "__self__", None) is engine]


def _track_outputs(layers: nn.ModuleList) -> tuple[list[Any], list[Any]]:
    refs: list[Any] = []

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        refs.append((type(module).__name__, weakref.ref(output)))

    handles = [m.register_forward_hook(hook) for m in layers.modules() if m is not layers]
    return refs, handles


def _step(form: Form, handle: Any, layers: nn.ModuleList, x: torch.Tensor) -> list[torch.Tensor]:
    layers.zero_grad(set_to_none=True)
    xin = x.detach().requires_grad_(True)
    out = form.forward(handle, layers, xin * 1.0, fail_after=False)
    (out.float() ** 2).mean().backward()
    return [p.grad.clone() for p in layers.parameters()] + [xin.grad.clone()]


def _fail_once(form: Form, handle: Any, layers: nn.ModuleList, x: torch.Tensor, failure: str) -> None:
    layers.zero_grad(set_to_none=True)
    layers[FAILING_LAYER].fail_forward = failure == "in_layer"
    layers[BOOM_LAYER].fail_backward = failure == "backward_raises"
    try:
        xin = x.detach().requires_grad_(True)
        out = form.forward(handle, layers, xin * 1.0, fail_after=failure == "after_last")
        loss = (out.float() ** 2).mean()
        del out
        if failure == "backward_raises":
            with pytest.raises(RuntimeError, match="backward failed"):
                loss.backward()
        del loss  # "loss_dropped": a forward whose graph dies without a backward
    except RuntimeError as error:
        assert failure in ("in_layer", "after_last"), error
    finally:
        layers[FAILING_LAYER].fail_forward = False
        layers[BOOM_LAYER].fail_backward = False


@pytest.mark.parametrize("selective", [False, True], ids=["", "selective"])
@pytest.mark.parametrize("failure", FAILURES)
@pytest.mark.parametrize("form", FORMS, ids=[f.name for f in FORMS])
@pytest.mark.parametrize("device", DEVICES)
def test_a_failed_step_leaves_nothing_and_the_retry_is_exact(device: str, form: Form, failure: str, selective: bool) -> None:
    layers = make_layers(device)
    x = torch.randn(4, 8, WIDTH, device=device)
    regions = offload.selective_recompute([layer.mlp for layer in layers]) if selective else contextlib.nullcontext()
    with regions, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "offloaded nothing" of k=0, v1's count of a failed step
        expected = _step(Form("plain", lambda *_: None), contextlib.nullcontext(), layers, x)
        assert all(torch.equal(a, b) for a, b in zip(
            expected, _step(Form("plain", lambda *_: None), contextlib.nullcontext(), layers, x)
        )), "the plain run does not repeat itself"
        handle = form.make(layers, device)
        engine = form.engine(handle)
        _step(form, handle, layers, x)  # a good step first: blocks pinned, buffers made
        layers.zero_grad(set_to_none=True)
        gc.collect()
        before = _memory(device)
        refs, probes = _track_outputs(layers)
        _fail_once(form, handle, layers, x, failure)
        for probe in probes:
            probe.remove()
        gc.collect()

        alive = [name for name, ref in refs if ref() is not None]
        assert not alive, f"{form.name}, {failure}: activations outlived the failed step: {alive}"
        assert not _groups_of(engine), f"{form.name}, {failure}: groups outlived the failed step"
        assert engine.arena.claimed == 0 and engine.arena.counters.bytes_in_use == 0
        assert engine.forward.open_group is None and engine.forward.pending_group is None and not engine.forward.in_layer
        assert not hooks_installed()
        if failure in ("in_layer", "after_last") and not form.te:
            assert engine.step is None, "the failed forward's step is still the engine's"
        if device == "cuda":
            torch.cuda.synchronize()
            left = _memory(device) - before
            assert left < 1 << 20, f"{form.name}, {failure}: {left} bytes of GPU memory stayed allocated"

        for _ in range(2):  # the retry, twice: a step after it starts cleanly too
            got = _step(form, handle, layers, x)
            assert all(torch.equal(a, b) for a, b in zip(expected, got)), f"{form.name}: the retry's gradients differ"


@pytest.mark.parametrize("form", ["layers", "layerless", "te"])
def test_forwards_without_backward_do_not_grow_host_memory(form: str) -> None:
    # The validation pass left outside no_grad: its graph is dropped without a backward. Each one
    # used to keep its groups (and their pinned regions) for good.
    layers = make_layers("cpu")
    x = torch.randn(4, 8, WIDTH)
    if form == "te":
        ctx, sync = offload.get_cpu_offload_context(True, 4, N_LAYERS, **_options("cpu"))

        def forward() -> torch.Tensor:
            h = x
            for layer in layers:
                with ctx:
                    h = layer(h)
                h = sync(h)
            return h

        stats = lambda: ctx.stats  # noqa: E731
    else:
        oa = offload.OffloadActivations(layers if form == "layers" else None, **_options("cpu"),
                                        **({} if form == "layers" else {"group_bytes": 1 << 14}))

        def forward() -> torch.Tensor:
            with oa:
                return run_plain(layers, x.requires_grad_())

        stats = lambda: oa.stats  # noqa: E731
    held = []
    for _ in range(6):
        forward().float().mean().backward()
        forward().float().mean().item()  # gradients on, no backward
        gc.collect()
        held.append(stats()["pinned_bytes_held"])
    assert held[0] > 0 and held[-1] == held[1], f"host memory held grows without a backward: {held}"


# -- in-place changes after release -----------------------------------------------------------------
@pytest.mark.parametrize("mode", ["v1", "v2"])
def test_an_in_place_change_after_release_is_refused(mode: str) -> None:
    # v1 releases layer 0's group at the end of layer 0, before the change; the caller's object
    # then dies when ``h`` is rebound, so only an alias the group owns can still see it.
    ctx, sync = offload.get_cpu_offload_context(
        True, num_layers=2 if mode == "v1" else 1, model_layers=2, mode=mode, selection="auto", **_options("cpu")
    )
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    with ctx:
        h = torch.sigmoid(x @ w)  # sigmoid saves its output h
    h = sync(h)
    with ctx:
        h.mul_(2)
        h = h @ w
    h = sync(h)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        h.sum().backward()


def test_an_in_place_change_in_a_kept_layer_is_refused() -> None:
    # OffloadActivations' hooks see the layers it does not offload too; autograd skips its own
    # check for tensors saved through hooks, so the engine must make it.
    class Scale(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.mul_(2)
            return x

    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sigmoid(self.lin(x))

    layers = nn.ModuleList([Gate(), Scale()])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run_plain(layers, torch.randn(4, 8)).sum().backward()  # plain PyTorch refuses it
    oa = offload.OffloadActivations(layers, num_offload_layers=0, **_options("cpu"))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        with oa:
            out = run_plain(layers, torch.randn(4, 8))
        out.sum().backward()


def test_emptied_aliases_share_the_counter_and_hold_no_memory() -> None:
    base = torch.randn(64, 64)
    tensors = [base, base.t(), base[3:7], torch.randn(4, dtype=torch.cfloat).conj()]
    versions = [t._version for t in tensors]
    sentinels = [own_alias(t) for t in tensors]
    empty_keeping_versions(sentinels)
    assert [t._version for t in tensors] == versions, "emptying an alias changed the version"
    for sentinel, t in zip(sentinels, tensors):
        assert sentinel.untyped_storage().nbytes() == 0 and sentinel._base is None
        assert sentinel._version == t._version
    alias = base.view(-1)
    alias.add_(1)  # an in-place change through another alias of the same counter
    assert sentinels[0]._version == versions[0] + 1
    storage = weakref.ref(base)
    del base, tensors, alias
    gc.collect()
    assert storage() is None, "an emptied alias kept its tensor alive"


# -- layer counts under a reentrant checkpoint ------------------------------------------------------
def _te_with_reentrant_layers(wrapped: list[int]) -> tuple[Any, list[torch.Tensor], list[torch.Tensor], list[Any]]:
    torch.manual_seed(0)
    lins = [nn.Linear(32, 32) for _ in range(4)]
    ctx, sync = offload.get_cpu_offload_context(True, 3, 4, group_bytes=0, **_options("cpu"))  # a group per layer

    def layer(lin: nn.Linear, h: torch.Tensor, context: Any) -> torch.Tensor:
        with context:
            return torch.sigmoid(lin(h))

    def step(context: Any, sync_fn: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        for lin in lins:
            lin.zero_grad(set_to_none=True)
        x = torch.ones(8, 32, requires_grad=True)
        h = x
        for i, lin in enumerate(lins):
            if i in wrapped:
                h = sync_fn(checkpoint.checkpoint(layer, lin, h, context, use_reentrant=True))
            else:
                h = sync_fn(layer(lin, h, context))
        h.sum().backward()
        return [p.grad.clone() for lin in lins for p in lin.parameters()] + [x.grad.clone()]

    expected = step(contextlib.nullcontext(), lambda t: t)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = step(ctx, sync)
    return ctx, expected, got, caught


def test_a_reentrant_checkpointed_first_layer_keeps_its_number() -> None:
    ctx, expected, got, caught = _te_with_reentrant_layers(wrapped=[0])
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    engine = ctx.engine
    assert engine.step.layers_started == 4, "the reentrant checkpoint's layer was not counted"
    # Layers 0-2 are the offloaded ones; layer 0 saved nothing (no_grad inside the checkpoint).
    # (Before, layers 1-3 were numbered 0-2 and the model's last layer was offloaded: 3 groups.)
    assert ctx.stats["groups_offloaded"] == 2
    messages = [str(w.message) for w in caught]
    assert not any("layer contexts" in m for m in messages), messages


def test_every_layer_reentrant_checkpointed_is_one_step_that_says_it_offloaded_nothing() -> None:
    ctx, expected, got, caught = _te_with_reentrant_layers(wrapped=[0, 1, 2, 3])
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert ctx.engine.step is not None and ctx.engine.step.layers_started == 4
    messages = [str(w.message) for w in caught]
    assert any("offloaded nothing" in m and "no_grad" in m for m in messages), messages


def test_an_eval_forward_under_no_grad_starts_no_step() -> None:
    ctx, sync = offload.get_cpu_offload_context(True, 1, 2, **_options("cpu"))
    lin = nn.Linear(8, 8)
    with torch.no_grad():
        h = torch.randn(2, 8)
        for _ in range(2):
            with ctx:
                h = torch.sigmoid(lin(h))
            h = sync(h)
    assert ctx.engine.step is None


# -- the planner's probe steps ------------------------------------------------------------------------
def test_a_probe_step_that_fails_leaves_nothing() -> None:
    # A budget's third step is the probe; it fails here (as an out-of-memory error would), and
    # its activations must die with it. The next steps probe again and then follow a plan.
    layers = make_layers("cpu")
    x = torch.randn(4, 8, WIDTH)
    oa = offload.OffloadActivations(layers, memory_budget_bytes="lowest", **_options("cpu"))
    form = Form("budget", lambda *_: oa)
    for _ in range(2):  # warm-up and calibration
        _step(form, oa, layers, x)
    refs, probes = _track_outputs(layers)
    _fail_once(form, oa, layers, x, "after_last")
    for probe in probes:
        probe.remove()
    gc.collect()
    assert not [name for name, ref in refs if ref() is not None], "the failed probe step's activations live on"
    assert not hooks_installed()
    expected = _step(Form("plain", lambda *_: None), contextlib.nullcontext(), layers, x)
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(expected, _step(form, oa, layers, x)))
    assert oa.plan is not None, "the probe was not run again after the failed one"


def test_plan_with_a_failing_step_leaves_nothing() -> None:
    layers = make_layers("cpu")
    x = torch.randn(4, 8, WIDTH)
    refs, probes = _track_outputs(layers)

    def step() -> None:
        run_plain(layers, x.requires_grad_())
        raise RuntimeError("the head failed")

    with pytest.raises(RuntimeError, match="probe step raised"):  # no warm-up: the hooks are on
        offload.plan(layers, step, "lowest", warmup_steps=0, **_options("cpu"))
    for probe in probes:
        probe.remove()
    gc.collect()
    assert not [name for name, ref in refs if ref() is not None], "the failed probe step's activations live on"
    assert not hooks_installed()


def test_close_gives_the_idle_host_blocks_back() -> None:
    layers = make_layers("cpu")
    x = torch.randn(4, 8, WIDTH)
    oa = offload.OffloadActivations(layers, **_options("cpu"))
    form = Form("layers", lambda *_: oa)
    expected = _step(Form("plain", lambda *_: None), contextlib.nullcontext(), layers, x)
    _step(form, oa, layers, x)
    assert oa.stats["pinned_bytes_held"] > 0
    oa.close()
    assert oa.stats["pinned_bytes_held"] == 0, "close() kept the context's host blocks"
    assert all(torch.equal(a, b) for a, b in zip(expected, _step(form, oa, layers, x))), "a step after close()"


def test_no_pack_hook_hands_autograd_a_tensor_that_holds_its_node() -> None:
    # The rule behind the leaks: whatever a pack hook returns is kept by the node that saved the
    # tensor, so it must not hold that node (a tensor's grad_fn). Every pack path is asked here
    # for an output that carries its node, as sigmoid's saved output does.
    from offload.planner.make import probe_policy
    from offload.planner.probe import ProbeStep
    from offload.scope import _KeepPack
    from offload.engine.stats import StepCounters

    def output() -> torch.Tensor:
        return torch.sigmoid(torch.randn(4, 8, requires_grad=True))

    def tensors_in(handle: Any) -> list[torch.Tensor]:
        if isinstance(handle, torch.Tensor):
            return [handle]
        if isinstance(handle, tuple):
            return [t for t in handle if isinstance(t, torch.Tensor)]
        return []

    layers = make_layers("cpu")
    engine = offload.OffloadActivations(layers, num_offload_layers=0, **_options("cpu")).engine
    probe = ProbeStep(list(layers), probe_policy(torch.device("cpu"), 0), torch.device("cpu"))
    paths = {
        "pack outside any group": engine.pack,
        "keep region, step counted": lambda t: engine.pack_kept(t, "keep_on_gpu", StepCounters(step=1, mode="v2")),
        "keep region, no step": _KeepPack(engine, False),
        "probe": probe._pack,
    }
    for name, pack in paths.items():
        assert engine.step is None
        handle = pack(output())
        assert tensors_in(handle), f"{name}: no tensor in the handle: the test proves nothing"
        for t in tensors_in(handle):
            assert t.grad_fn is None, f"{name}: the handle holds a tensor with its node"
