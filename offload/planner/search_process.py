"""The plan search in a process of its own, for plans made ahead (:mod:`offload.planner.ahead`).

Why a process: a search on a background thread shares the interpreter with the training step,
and a step's threads release the interpreter in every torch op they dispatch. A search waiting
for it takes it at each such release and keeps it for its slice, so each op waits
(``benchmarks/plan_search.py --contention``: on this project's CPU host a step of small torch ops
took 0.134 s alone, 1.96 s beside searches giving way every millisecond, :class:`~offload.planner.ahead.Yielding`,
176 s beside searches that do not, and 0.137 s beside searches in their own process; on the H200,
the first planned step of ``benchmarks/varlen.py`` took 483 ms beside one 0.06 s search and
765-925 ms beside three). A search in another process takes
none of the step's interpreter, and the host has cores to spare.

:class:`SearchProcess` forks once, when the context is made, sends each making's arguments down
a pipe, and reads the made plan back: the planner's objects are plain dataclasses, pickled both
ways. Forked, not started afresh: a fresh interpreter imports torch and offload for a second or
two, and on the H200 that pushed ``benchmarks/varlen.py``'s first plans made ahead several steps
later; a fork has every module already. It is what a ``DataLoader`` does with its workers in a
CUDA process, and is safe for the same reason: the child never touches CUDA (torch marks a forked
child so that a slip raises rather than uses the parent's context), and the arena's host blocks
are not inherited at all (``MADV_DONTFORK``, ``csrc/host_memory.cpp``). An error of the search
itself (``BudgetError``) comes back and is raised as the making's error; a child that could not
start or died makes :meth:`SearchProcess.make` raise :class:`SearchProcessError`, and the caller
makes that plan, and every later one, on its own thread as before (so too where ``os.fork`` is
missing).

Used on CUDA by default; ``OFFLOAD_PLAN_PROCESS=0`` (or ``1``) says otherwise.
"""

from __future__ import annotations

import gc
import os
import pickle
import select
import signal
import struct
import sys
import threading
import time
import warnings
import weakref
from typing import IO, Any, Callable, Optional

__all__ = ["SearchProcess", "SearchProcessError", "process_wanted", "serve"]

_LENGTH = struct.Struct("<Q")
# How often an idle child checks that its parent is still there (a parent killed outright
# leaves the pipe open wherever another child of it holds a copy of its end).
_PARENT_CHECK_S = 5.0


class SearchProcessError(RuntimeError):
    """The search process could not start, or stopped answering (not an error of the search)."""


def process_wanted(cuda: bool) -> bool:
    """Whether plans made ahead are searched in a process of their own: ``OFFLOAD_PLAN_PROCESS``
    if set ("0" or "1"), else on CUDA (where the step's threads dispatch ops while it runs)."""
    value = os.environ.get("OFFLOAD_PLAN_PROCESS", "").strip()
    if value in ("0", "1"):
        return value == "1"
    if value:
        raise ValueError(f"offload: OFFLOAD_PLAN_PROCESS must be 0 or 1, got {value!r}")
    return cuda


def _send(stream: IO[bytes], value: Any) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError("the pipe closed")
    (size,) = _LENGTH.unpack(head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the pipe closed mid-message")
    return pickle.loads(data)


def _stop(pid: int, pipes: tuple[IO[bytes], IO[bytes]]) -> None:
    # (A finalizer: holds the pid and pipes, never the SearchProcess.) The child keeps no state
    # worth a clean exit, and waiting for it to read the pipe's end could take as long as a
    # search: it is killed, then reaped.
    for pipe in pipes:
        try:
            pipe.close()
        except OSError:
            pass
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


class SearchProcess:
    """A forked child that runs ``make_ahead`` calls one at a time (see the module notes).

    Forked at construction. Called from one thread at a time (the plans-ahead worker);
    :meth:`make` blocks that thread, which holds no interpreter lock while it waits on the pipe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pid: Optional[int] = None
        self._end: Callable[[], Any] = lambda: None  # stops and reaps the child (set once forked)
        self._pipes: Optional[tuple[IO[bytes], IO[bytes]]] = None  # (to the child, from the child)
        if not hasattr(os, "fork"):
            self.reason = "could not start: this platform has no os.fork"
            return
        to_child, from_parent = os.pipe()[::-1]  # (write end, read end)
        from_child, to_parent = os.pipe()
        for stream in (sys.stdout, sys.stderr):  # else the child would print what is buffered again
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        try:
            with warnings.catch_warnings():  # (3.12+: "this process is multi-threaded"; see the module notes)
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
        except OSError as exc:
            for fd in (to_child, from_parent, from_child, to_parent):
                os.close(fd)
            self.reason = f"could not start: {exc}"
            return
        if pid == 0:
            _child_main(from_parent, to_parent, parent=os.getppid())
        os.close(from_parent)
        os.close(to_parent)
        self.pid, self.reason = pid, ""
        self._pipes = (os.fdopen(to_child, "wb"), os.fdopen(from_child, "rb"))
        # The one place the child is stopped and reaped: a finalizer runs once, so a pid that
        # was reaped (and may be another process's now) is never signalled.
        self._end = weakref.finalize(self, _stop, pid, self._pipes)

    def make(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``function(*args, **kwargs)`` in the child (a module-level function: it is pickled by
        name), its result here; the child's warnings warned and its exception raised here as
        they were there.
        Raises :class:`SearchProcessError` when the child is not there to answer."""
        with self._lock:
            pipes = self._pipes
            if pipes is None:
                raise SearchProcessError(f"offload: the plan search process {self.reason}")
            try:
                _send(pipes[0], (function, args, kwargs))
                ok, value, said = _receive(pipes[1])
            except (OSError, EOFError, pickle.PickleError) as exc:
                self._pipes, self.reason = None, f"stopped: {exc!r}{_how_it_ended(self.pid)}"
                self._end()
                raise SearchProcessError(f"offload: the plan search process {self.reason}") from exc
        for message, category in said:
            warnings.warn(message, category, stacklevel=2)
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """Stop the child (it ends with the interpreter, or when this is collected, anyway)."""
        with self._lock:
            self._pipes, self.reason = None, "was closed"
        self._end()


def _how_it_ended(pid: Optional[int]) -> str:
    # How the child ended, read without reaping it (WNOWAIT: the finalizer reaps it, once).
    waitid = getattr(os, "waitid", None)
    if pid is None or waitid is None:
        return ""
    for _ in range(50):  # a child whose pipe closed is ending: up to 0.5 s for it to be done
        try:
            ended = waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return ""
        if ended is not None:
            if ended.si_code == os.CLD_EXITED:
                return f" (the child exited with code {ended.si_status})"
            try:
                name = signal.Signals(ended.si_status).name
            except ValueError:
                name = f"signal {ended.si_status}"
            return f" (the child was killed by {name})"
        time.sleep(0.01)
    return ""


def _child_main(read_fd: int, write_fd: int, parent: int) -> None:
    # The forked child: serve, then leave without running the parent's exit handlers (they
    # would flush its buffers, join its threads' pools, tear down its CUDA and process groups).
    code = 0
    # The parent's objects are the parent's: none is collected here. Garbage it had not collected
    # yet when it forked (a CUDA tensor or event in a cycle) would otherwise be freed by this
    # child's collector, and freeing CUDA memory or an event in a forked child raises in C++ from
    # a destructor: the child aborted (SIGABRT, "CUDA error: initialization error") at its first
    # search on the H200 in tests/test_planner_gpu.py. The child's own cycles are still collected.
    gc.freeze()
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's to handle
        # The fds the parent had open (its device, sockets, other children's pipes) are not ours:
        # holding another child's pipe end open would keep that child from seeing its end.
        keep = {0, 1, 2, read_fd, write_fd}
        for fd in _open_fds():
            if fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass
        with os.fdopen(read_fd, "rb") as source, os.fdopen(write_fd, "wb") as out:
            serve(source, out, parent)
    except BaseException:  # noqa: BLE001 - the parent sees the pipe close
        code = 1
    finally:
        os._exit(code)


def _open_fds() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: the usual range
        return list(range(3, 256))


def serve(source: IO[bytes], out: IO[bytes], parent: Optional[int] = None) -> None:
    """The child's loop: read a call, run it, send back ``(True, result, warnings)`` or
    ``(False, error, warnings)``, the warnings it raised as ``(message, category)`` pairs (the
    parent warns them again, under its own filters: a warning printed here would bypass them);
    end when the parent closes the pipe, or (``parent``, a pid) when it is gone."""
    while True:
        if parent is not None:
            while not select.select([source], [], [], _PARENT_CHECK_S)[0]:
                if os.getppid() != parent:
                    return
        try:
            function, args, kwargs = _receive(source)
        except EOFError:
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                ok, value = True, function(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - sent back, raised in the parent
                ok, value = False, exc
        said = [(str(w.message), w.category) for w in caught]
        try:
            _send(out, (ok, value, said))
        except (pickle.PickleError, TypeError, AttributeError) as exc:  # an error that does not pickle
            _send(out, (False, RuntimeError(f"offload: the plan search failed: {value!r} ({exc!r})"), said))
