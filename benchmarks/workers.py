"""Contenders in processes of their own: the parent spawns the script again once per contender
(``--worker SPEC --worker-out FILE``), streams the worker's output with a ``[label]`` prefix,
and reads back the JSON the worker wrote.

Why a process per contender: an out-of-memory error can leave memory behind (the caching
allocator's segments, a failed step's tensors held by a traceback, pinned host blocks), and the
"device" budget reads the GPU's free memory, so a contender run after another would be measured
on a GPU the first one changed. The parent never starts CUDA itself (it would hold a context's
memory on the GPU the workers measure).

A worker that dies (a crash, a kill, a timeout) gives a result ``{"error": ..., "output_tail":
...}`` instead of its JSON: the parent reports it and goes on with the next contender.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from common import Env, _jsonable, metadata

OUTPUT_TAIL_LINES = 40


def add_worker_options(parser: argparse.ArgumentParser) -> None:
    """The options of the parent/worker protocol: ``--worker``/``--worker-out`` (set by the
    parent; a person runs the parent), ``--jobs`` and ``--worker-timeout``."""
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--jobs", type=int, default=1,
                        help="workers at once (default 1; more only for --cpu-smoke: on a GPU they would share it)")
    parser.add_argument("--worker-timeout", type=float, default=None, help="seconds before a worker is killed")


def parent_env(args: argparse.Namespace) -> Env:
    """The parent's :class:`common.Env`, made without starting CUDA: the device is the CPU (the
    parent runs no step); :func:`parent_meta` takes the GPU's name from a worker."""
    return Env(device=torch.device("cpu"), smoke=args.cpu_smoke, offload_device="cpu" if args.cpu_smoke else None, args=args)


def worker_env(env: Env) -> dict[str, str]:
    """Environment variables for the workers: in CPU smoke runs one intra-op thread each (the tiny
    GEMMs gain nothing from more, and workers run side by side with ``--jobs``), unless set."""
    if env.smoke and "OMP_NUM_THREADS" not in os.environ:
        return {"OMP_NUM_THREADS": "1"}
    return {}


def check_cuda_or_exit(args: argparse.Namespace, script: str) -> None:
    """Refuse to spawn GPU workers on a machine without CUDA (``torch.cuda.is_available`` reads
    the driver, not a context: no GPU memory is taken)."""
    if not args.cpu_smoke and not torch.cuda.is_available():
        sys.exit(f"{script}: this benchmark needs a CUDA GPU, and CUDA is not available "
                 f"(torch {torch.__version__}); run it on the GPU machine, or pass --cpu-smoke")


def worker_info(env: Env) -> dict[str, Any]:
    """What a worker reports about where it ran (the parent's metadata takes the device from it)."""
    info: dict[str, Any] = {"pid": os.getpid()}
    if env.cuda:
        props = torch.cuda.get_device_properties(env.device)
        info.update(device=props.name, capacity_bytes=int(props.total_memory),
                    alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    else:
        info["device"] = "cpu"
    return info


def parent_meta(env: Env, results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """:func:`common.metadata` of the parent, with the device its workers reported."""
    meta = metadata(env)
    devices = sorted({r["info"]["device"] for r in results if isinstance(r.get("info"), dict) and r["info"].get("device")})
    if devices:
        meta["device"] = ", ".join(devices)
    meta["processes"] = "one per contender (workers.py)"
    return meta


def write_worker_result(path: str, doc: dict[str, Any]) -> None:
    """The worker's side: its result as JSON (atomically: a killed worker leaves no half file)."""
    tmp = f"{path}.part"
    with open(tmp, "w") as f:
        json.dump(_jsonable(doc), f)
    os.replace(tmp, path)


def _tee(stream: Any, label: str, tail: deque) -> None:
    for line in iter(stream.readline, ""):
        tail.append(line.rstrip("\n"))
        sys.stdout.write(f"[{label}] {line}")
        sys.stdout.flush()


def spawn(script: Path, argv: Sequence[str], label: str, *, timeout: Optional[float] = None,
          extra_env: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """Run ``python script *argv --worker-out FILE`` and return the JSON the worker wrote, with
    ``wall_s`` (the process's wall time, start-up included) and ``returncode`` added; on a
    worker's death, ``{"error": ..., "output_tail": [...]}``."""
    with tempfile.TemporaryDirectory(prefix="bench-worker-") as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, **(extra_env or {}), "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, str(script), *argv, "--worker-out", str(out)]
        tail: deque = deque(maxlen=OUTPUT_TAIL_LINES)
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        reader = threading.Thread(target=_tee, args=(proc.stdout, label, tail), daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            tail.append(f"killed after {timeout} s (--worker-timeout)")
        reader.join(timeout=10)
        wall = time.perf_counter() - t0
        if out.exists():
            result = json.loads(out.read_text())
        else:
            result = {"error": f"worker exited with status {rc} and wrote no result", "output_tail": list(tail)}
    result.update(returncode=rc, wall_s=wall)
    print(f"[{label}] done: exit {rc} after {wall:.1f} s", flush=True)
    return result


def spawn_all(script: Path, jobs: Sequence[tuple[str, list[str]]], *, parallel: int = 1,
              timeout: Optional[float] = None, extra_env: Optional[dict[str, str]] = None) -> dict[str, dict[str, Any]]:
    """:func:`spawn` each ``(label, argv)``; ``parallel`` at once (1 on a GPU). Results by label,
    in the jobs' order."""
    def one(job: tuple[str, list[str]]) -> dict[str, Any]:
        return spawn(script, job[1], job[0], timeout=timeout, extra_env=extra_env)

    if parallel <= 1:
        return {label: one((label, argv)) for label, argv in jobs}
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        results = list(pool.map(one, jobs))
    return {label: r for (label, _), r in zip(jobs, results)}


def strip_parent_options(argv: Sequence[str], names: Sequence[str]) -> list[str]:
    """``argv`` without the given options (and their values, ``--x v`` or ``--x=v``): what the
    parent passes on to its workers after removing what it sets itself."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in names:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


# -- ranks on this machine, without torchrun ---------------------------------------------------------
def _rank_process(rank: int, world: int, port: int, run: Callable[[list[str]], int], argv: list[str]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this machine: loopback
    torch.set_num_threads(1)  # the ranks share the host's cores
    code = run(argv)
    sys.stdout.flush()
    os._exit(code)  # skip the interpreter's teardown under gloo's threads (see tests/distributed)


def spawn_ranks(run: Callable[[list[str]], int], nproc: int, argv: list[str]) -> int:
    """Run ``run(argv)`` as each of ``nproc`` ranks spawned on this machine (what torchrun would
    start, for a script run without it); the first failing rank's exit code, else 0. ``run`` must
    be a module-level function (the spawned processes import it)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.start_processes(_rank_process, args=(nproc, port, run, argv), nprocs=nproc, join=False,
                                 start_method="spawn")
    try:
        while not context.join():
            pass
    except mp.ProcessExitedException as exc:
        return exc.exit_code or 1
    return 0
