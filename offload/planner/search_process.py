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

:class:`SearchProcess` starts ``python -c "...serve()"`` once (it imports offload, and so torch,
in a second or two, while the probe steps run), sends each making's arguments down a pipe, and
reads the made plan back: the planner's objects are plain dataclasses, pickled both ways. The
child sees no GPU (``CUDA_VISIBLE_DEVICES`` empty: the search never touches CUDA, and a slip
would fail there, not take a context on the device) and runs one thread. An error of the search
itself (``BudgetError``) comes back and is raised as the making's error; a child that could not
start or died makes :meth:`SearchProcess.make` raise :class:`SearchProcessError`, and the caller
makes that plan, and every later one, on its own thread as before.

Used on CUDA by default; ``OFFLOAD_PLAN_PROCESS=0`` (or ``1``) says otherwise.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import threading
import weakref
from typing import IO, Any, Callable, Optional

__all__ = ["SearchProcess", "SearchProcessError", "process_wanted", "serve"]

_LENGTH = struct.Struct("<Q")
# The child's command: the parent's import path first, so that the same offload is imported.
_CHILD = "import sys, os; sys.path[:0] = os.environ['OFFLOAD_PLAN_PATH'].split(os.pathsep); " \
         "from offload.planner.search_process import serve; serve()"


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


def _stop(process: subprocess.Popen) -> None:
    # (A finalizer: holds the process, never the SearchProcess.)
    try:
        if process.stdin is not None:
            process.stdin.close()
        process.wait(timeout=2)
    except Exception:  # noqa: BLE001 - a child that will not end is killed
        process.kill()


class SearchProcess:
    """A child process that runs ``make_ahead`` calls one at a time (see the module notes).

    Started at construction (its imports take a second or two, beside the probe steps). Called
    from one thread at a time (the plans-ahead worker); :meth:`make` blocks that thread, which
    holds no interpreter lock while it waits on the pipe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pid: Optional[int] = None
        env = dict(os.environ, OFFLOAD_PLAN_PATH=os.pathsep.join(p for p in sys.path if p),
                   CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OFFLOAD_PLAN_PROCESS="0")
        try:
            if not sys.executable:
                raise OSError("sys.executable is empty")
            self._process: Optional[subprocess.Popen] = subprocess.Popen(
                [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, env=env, close_fds=True)
        except OSError as exc:
            self._process, self.reason = None, f"could not start: {exc}"
            return
        self.pid, self.reason = self._process.pid, ""
        weakref.finalize(self, _stop, self._process)

    def make(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``function(*args, **kwargs)`` in the child (a module-level function: it is pickled by
        name), its result here; the child's exception raised here as it was raised there.
        Raises :class:`SearchProcessError` when the child is not there to answer."""
        with self._lock:
            process = self._process
            if process is None:
                raise SearchProcessError(f"offload: the plan search process {self.reason}")
            try:
                _send(process.stdin, (function, args, kwargs))  # type: ignore[arg-type]
                ok, value = _receive(process.stdout)  # type: ignore[arg-type]
            except (OSError, EOFError, pickle.PickleError) as exc:
                self._process, self.reason = None, f"stopped: {exc!r} (exit code {process.poll()})"
                _stop(process)
                raise SearchProcessError(f"offload: the plan search process {self.reason}") from exc
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """Stop the child (it ends at the interpreter's exit, or when this is collected, anyway)."""
        with self._lock:
            process, self._process, self.reason = self._process, None, "was closed"
        if process is not None:
            _stop(process)


def serve() -> None:
    """The child's loop: read a call, run it, send back ``(True, result)`` or ``(False, error)``;
    end when the parent closes the pipe. What the code prints goes to stderr, not the pipe."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    source = sys.stdin.buffer
    while True:
        try:
            function, args, kwargs = _receive(source)
        except EOFError:
            return
        try:
            reply: tuple[bool, Any] = (True, function(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - sent back, raised in the parent
            reply = (False, exc)
        try:
            _send(out, reply)
        except (pickle.PickleError, TypeError, AttributeError) as exc:  # an error that does not pickle
            _send(out, (False, RuntimeError(f"offload: the plan search failed: {reply[1]!r} ({exc!r})")))
