"""offload.engine.eager.run_eagerly: the mechanism that keeps Dynamo out of offload's code (CPU).

``tests/test_compile.py`` checks the behaviour with the real entry points; these tests check the
mechanism itself: the function comes back unwrapped (no per-call cost), compiled code breaks the
graph at it, and neither it nor anything it calls is compiled, also when autograd calls it as a
saved-tensor hook under a compiled frame.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from offload.engine import eager
from offload.engine.eager import GRAPH_BREAK_REASON, run_eagerly

MARKERS = pytest.mark.skipif(eager._mark_skipped is None, reason="this torch lacks Dynamo's code markers")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _callee(x: torch.Tensor) -> torch.Tensor:
    return x.sin() + 1


def _frames_compiled() -> int:
    return counters["frames"]["total"]


@MARKERS
def test_a_function_comes_back_itself_marked() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x

    assert run_eagerly(fn) is fn
    assert fn._torchdynamo_disable is True and fn._torchdynamo_disable_msg == GRAPH_BREAK_REASON

    class Holder:
        def method(self, x: torch.Tensor) -> torch.Tensor:
            return x

    bound = Holder().method
    assert run_eagerly(bound) is bound  # a bound method: its function is marked
    assert Holder.method._torchdynamo_disable is True


def test_what_cannot_be_marked_is_wrapped() -> None:
    class Callable:
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            return x

    obj = Callable()
    wrapped = run_eagerly(obj)
    assert wrapped is not obj and getattr(wrapped, "_torchdynamo_disable", False)
    assert torch.equal(wrapped(torch.ones(2)), torch.ones(2))


@pytest.mark.parametrize("marked", [True, False])
def test_compiled_code_breaks_the_graph_and_compiles_nothing_below(marked: bool) -> None:
    # The control (marked=False) shows the test can fail: unmarked, Dynamo inlines the function
    # and its callee into one graph (one frame, no graph break).
    def entry(x: torch.Tensor) -> torch.Tensor:
        return _callee(x) * 2

    if marked:
        entry = run_eagerly(entry)

    @torch.compile(backend="eager")
    def model(x: torch.Tensor) -> torch.Tensor:
        return entry(x.cos()).exp()

    x = torch.randn(4)
    assert torch.equal(model(x), ((x.cos().sin() + 1) * 2).exp())
    breaks = sum(counters["graph_break"].values())
    if marked:
        # model's frame and its resume after the break; entry and _callee ran uncompiled.
        assert breaks == 1 and _frames_compiled() == 2
        assert any("offload: offloading runs eagerly" in reason for reason in counters["graph_break"])
    else:
        assert breaks == 0 and _frames_compiled() == 1


@MARKERS
def test_hooks_run_by_a_backward_inside_compiled_code_are_not_compiled() -> None:
    # A backward called inside a compiled function is a graph break that runs eagerly under
    # Dynamo's frame callback, and on CPU autograd runs it in this thread: the hooks of an eager
    # forward's nodes are then called while the callback is installed. Nothing below them may be
    # compiled. (Whether Dynamo would compile them unmarked depends on its version; the graph
    # break test above is the control that the marks take effect.)
    def record(t: torch.Tensor) -> torch.Tensor:
        return t + 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        record(t)
        return t

    @torch.compile(backend="aot_eager")
    def backward(loss: torch.Tensor) -> None:
        loss.backward()

    x = torch.randn(8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(run_eagerly(pack), run_eagerly(unpack)):
        loss = (x.sin() * x).sum()
    backward(loss)
    assert torch.equal(x.grad, (x.sin() + x * x.cos()).detach())
    compiled = {ref().co_name for ref in torch._dynamo.convert_frame.input_codes.seen if ref() is not None}
    assert "backward" in compiled  # Dynamo did run here
    assert not compiled & {"pack", "unpack", "record"}, compiled


@MARKERS
def test_import_leaves_dynamo_alone_and_marks_hold_once_it_loads() -> None:
    # In a fresh interpreter: ``import offload`` does not import torch._dynamo (a second of
    # start-up), and functions marked before Dynamo loads still break the graph and run eagerly.
    import subprocess
    import sys

    script = """
import sys, torch, offload
from offload.engine.eager import run_eagerly
assert "torch._dynamo" not in sys.modules, "import offload imported torch._dynamo"
def inner(x): return x.sin() + 1
def entry(x): return inner(x) * 2
run_eagerly(entry)
from torch._dynamo.utils import counters
@torch.compile(backend="eager")
def model(x): return entry(x.cos()).exp()
model(torch.randn(4))
assert counters["frames"]["total"] == 2 and sum(counters["graph_break"].values()) == 1, dict(counters["frames"])
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
