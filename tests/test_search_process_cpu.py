"""Plans made ahead searched in a process of their own (issue 50 s2): a background thread's search
slows a training step's op dispatch many times over (each torch op gives the interpreter away, and
the search keeps it for its slice), a search in another process does not. The child makes the
plans the thread would, bitwise steps follow them, the search's own errors come back as they were
raised, and a child that died leaves the thread to make the plans."""

from __future__ import annotations

import os
import select
import sys
import time
import types
import warnings

import pytest
import torch

import offload
from offload.planner import ahead
from offload.planner.ahead import PlansAhead, make_ahead
from offload.planner.search import BudgetError
from offload.planner import search_process
from offload.planner.search_process import SearchProcess, SearchProcessError, process_wanted
from offload.planner.shapes import StepShape

from _util import assert_bitwise, make_gpt_layers, oa_step, plain_reference, train_step


def _raise_budget_error(message: str) -> None:
    raise BudgetError(message)


@pytest.fixture(scope="module")
def process() -> SearchProcess:
    child = SearchProcess()
    yield child
    child.close()


def _profile() -> tuple[offload.planner.StepProfile, int]:
    layers = make_gpt_layers(4)
    profile = offload.planner.profile_step(layers, lambda: train_step(layers, torch.randn(2, 32, 64)), device="cpu",
                                           min_offload_bytes=0)
    return profile, offload.planner.lowest_peak(profile).prediction.peak_bytes * 3 // 2


def test_the_search_runs_in_the_child_and_makes_the_threads_plan(process: SearchProcess) -> None:
    assert process.make(os.getpid) == process.pid != os.getpid()
    profile, budget = _profile()
    args = (profile, StepShape(2, 32), budget, None, None, 1 << 40, "")
    there, here = process.make(make_ahead, *args), make_ahead(*args)
    assert there.plan == here.plan and there.host_bytes == here.host_bytes


def _warn_and_return(message: str) -> int:
    warnings.warn(message, UserWarning)
    return 7


def test_a_warning_of_the_search_is_warned_here(process: SearchProcess) -> None:
    # Under the parent's filters (an error filter makes it raise, as a search on a thread would),
    # not printed by the child past them.
    with pytest.warns(UserWarning, match="within the cost model's error, in the child"):
        assert process.make(_warn_and_return, "within the cost model's error, in the child") == 7
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="as an error"):
            process.make(_warn_and_return, "as an error")
    assert process.make(os.getpid) == process.pid  # and the child goes on


def test_an_error_of_the_search_is_raised_as_it_was(process: SearchProcess) -> None:
    with pytest.raises(BudgetError, match="no plan fits, in the child"):
        process.make(_raise_budget_error, "no plan fits, in the child")
    assert process.make(os.getpid) == process.pid  # and the child goes on


def test_the_child_is_forked_with_the_parents_modules() -> None:
    # A module made at run time exists only in this interpreter: a child started afresh could
    # not unpickle its function (and would take a second or two importing torch first).
    module = types.ModuleType("offload_test_made_here")
    exec("import os\ndef pid_and_parent():\n    return os.getpid(), os.getppid()\n", module.__dict__)
    sys.modules[module.__name__] = module
    try:
        child = SearchProcess()
        try:
            assert child.make(module.pid_and_parent) == (child.pid, os.getpid())
        finally:
            child.close()
    finally:
        del sys.modules[module.__name__]


def test_the_child_holds_none_of_the_parents_other_files() -> None:
    # Else a pipe of the parent (another child's, a DataLoader's) would never see its end.
    read_end, write_end = os.pipe()
    child = SearchProcess()
    try:
        assert child.make(os.getpid) == child.pid  # (it has closed them by now)
        os.close(write_end)
        assert select.select([read_end], [], [], 5.0)[0] and os.read(read_end, 1) == b""
    finally:
        os.close(read_end)
        child.close()


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_a_child_whose_parent_was_killed_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    # The parent is killed outright while another process still holds its pipe to the child
    # (a DataLoader worker forked before): the pipe never closes, and the child sees its parent gone.
    monkeypatch.setattr(search_process, "_PARENT_CHECK_S", 0.05)
    report_read, report_write = os.pipe()
    middle = os.fork()
    if middle == 0:  # the parent to be killed
        try:
            child = SearchProcess()
            holder = os.fork()
            if holder == 0:  # the holder: the pipes' ends, open, for a while
                time.sleep(30)
                os._exit(0)
            os.write(report_write, f"{child.pid} {holder}\n".encode())
            time.sleep(30)
        finally:
            os._exit(1)
    os.close(report_write)
    pid, holder = map(int, os.read(report_read, 64).decode().split())
    os.close(report_read)
    os.kill(middle, 9)
    os.waitpid(middle, 0)
    try:
        deadline = time.monotonic() + 10
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(pid) and not _gone(holder)  # (the pipe stayed open: the child saw its parent gone)
    finally:
        os.kill(holder, 9)


def test_a_child_that_died_leaves_the_plans_to_the_thread() -> None:
    plans = PlansAhead(lambda plan: [], lambda sizes: True, process=True)
    child = plans.process
    assert child is not None and child.make(os.getpid) == child.pid
    os.kill(child.pid, 9)
    with pytest.raises(SearchProcessError, match="stopped: .* \\(the child was killed by SIGKILL\\)"):
        child.make(os.getpid)
    plans.process = child  # (as if it had died during a making)
    profile, budget = _profile()
    args = (profile, StepShape(2, 32), budget, None, None, 1 << 40, "")
    with pytest.warns(RuntimeWarning, match="searched on a thread of this process from here"):
        made = plans.make(*args)
    assert made.plan == make_ahead(*args).plan and plans.process is None
    assert "searched on a thread" in plans.log[-1]


def test_a_child_that_exits_says_its_code() -> None:
    child = SearchProcess()
    try:
        with pytest.raises(SearchProcessError, match=r"the pipe closed.*\(the child exited with code 3\)"):
            child.make(os._exit, 3)
    finally:
        child.close()


class _DiesInAChild:
    """Garbage the parent had not collected when it forked: freed in the child, it ends the child
    (as freeing a CUDA tensor or event there aborts it)."""

    def __init__(self, parent: int) -> None:
        self.parent, self.cycle = parent, self

    def __del__(self) -> None:
        if os.getpid() != self.parent:
            os._exit(7)


def test_the_parents_garbage_is_never_collected_in_the_child() -> None:
    import gc

    gc.collect()
    gc.disable()  # the cycle stays uncollected in the parent until the fork
    try:
        _DiesInAChild(os.getpid())
        child = SearchProcess()
    finally:
        gc.enable()
    try:
        # The child's collector runs (a search's allocations would run it sooner or later).
        assert child.make(gc.collect) >= 0
        assert child.make(os.getpid) == child.pid
    finally:
        child.close()
        gc.collect()  # (here, in the parent, its __del__ does nothing)


def test_the_process_is_used_on_cuda_unless_the_environment_says(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OFFLOAD_PLAN_PROCESS", raising=False)
    assert process_wanted(True) and not process_wanted(False)
    monkeypatch.setenv("OFFLOAD_PLAN_PROCESS", "0")
    assert not process_wanted(True)
    monkeypatch.setenv("OFFLOAD_PLAN_PROCESS", "1")
    assert process_wanted(False)
    monkeypatch.setenv("OFFLOAD_PLAN_PROCESS", "yes")
    with pytest.raises(ValueError, match="OFFLOAD_PLAN_PROCESS must be 0 or 1"):
        process_wanted(True)


@pytest.mark.usefixtures("deterministic")
def test_a_stream_planned_in_the_child_is_bitwise_and_follows_the_threads_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each plan the child made is the plan the thread makes of the same arguments (this run's
    # profile), and every step is bitwise the plain run's.
    monkeypatch.setenv("OFFLOAD_PLAN_PROCESS", "1")
    made: list[tuple] = []
    real = PlansAhead.make

    def recorded(self: PlansAhead, *args: object) -> object:
        assert self.process is not None  # (no fallback: the child made it)
        result = real(self, *args)
        made.append((args, result))
        return result

    monkeypatch.setattr(PlansAhead, "make", recorded)
    layers = make_gpt_layers(4)
    _, budget = _profile()
    oa = offload.OffloadActivations(layers, memory_budget_bytes=budget, device="cpu", min_offload_bytes=0,
                                    plan_ahead=True)
    kinds = []
    for step, length in enumerate([16, 16, 16, 16, 32, 32, 24, 32, 24, 24]):
        x = torch.randn(2, length, 64, generator=torch.Generator().manual_seed(step))
        assert_bitwise(plain_reference(layers, x), oa_step(layers, x, oa))
        for entry in oa._planned._ahead.started:
            if entry.future is not None:
                entry.future.exception(timeout=60)  # made before the next step
        kinds.append(oa._planned.last_plan.get("plan"))
    assert "own" in kinds[5:] and len(made) >= 3
    for args, result in made:
        assert result.plan == make_ahead(*args).plan
