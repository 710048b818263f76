"""The multi-process scenarios, for any process group: gloo on the CPU (pytest spawns two
processes, ``test_multiprocess_cpu.py``) or NCCL on two GPUs (``torchrun --nproc-per-node 2
tests/distributed/run.py``, or ``pytest -m distributed``).

Every scenario runs the same training step plainly twice (the plain run must repeat itself, or a
bitwise comparison proves nothing) and then with offload twice, and returns plain figures that
:func:`problems` judges on rank 0:

- ``ddp_te`` / ``ddp_oa``: DDP, TransformerEngine's call shape / ``OffloadActivations``.
- ``fsdp_te`` / ``fsdp_oa``: FSDP2, ``fully_shard`` on every layer and at the root.
- ``pipeline_te`` / ``pipeline_oa``: ``torch.distributed.pipelining``, one stage per rank,
  ``Schedule1F1B`` over 4 micro-batches (stage 0 holds two in flight).
- ``diverge_<fsdp|ddp>_<lengths|low_memory|bucket|oom>`` (torchrun only; the CPU runs its own
  cases in ``test_ranks_diverge_cpu.py``): ranks that differ on purpose decide together (issue
  48, ``diverge``).

Gradients are compared with ``torch.equal`` (FSDP2: each rank's shards). No parameter is ever
copied: every tensor the policy sends to the host is checked against the storages of the
parameters at that moment (DDP's, FSDP2's sharded ones, and the unsharded all-gathered ones
while their layer runs), and against their sizes; the parameters are counted as kept.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
for _path in (HERE, HERE.parent):  # _util (tests/) for spawned processes and torchrun alike
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import cp_scenarios  # noqa: E402
import diverge  # noqa: E402
import offload  # noqa: E402
from offload.models import MLPBlock  # noqa: E402

SCENARIOS = ("ddp_te", "ddp_oa", "fsdp_te", "fsdp_oa", "pipeline_te", "pipeline_oa")
DIVERGE = {case.name: case for case in diverge.GPU_CASES}
CP = cp_scenarios.SCENARIOS  # context parallelism: CUDA only (torch's ring has no CPU kernel)
LAYERS = 4


@dataclass
class Setup:
    """One rank's view: where it computes and with what sizes."""

    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype
    hidden: int
    batch: int
    seq: int

    @property
    def cuda(self) -> bool:
        """Whether this rank computes on a GPU."""
        return self.device.type == "cuda"

    def offload_kw(self) -> dict[str, Any]:
        """Options of every offload context here: the host transport on the CPU, where the
        tensors are tiny (so no size floor)."""
        return {"device": None, "min_offload_bytes": 64 << 10} if self.cuda else {"device": "cpu", "min_offload_bytes": 0}

    def layers(self, seed: int = 0) -> torch.nn.ModuleList:
        """The same layers on every rank (same seed)."""
        torch.manual_seed(seed)
        return torch.nn.ModuleList(MLPBlock(self.hidden, device=self.device, dtype=self.dtype) for _ in range(LAYERS))

    def batch_for(self, rank: int, seed: int = 100) -> torch.Tensor:
        """This rank's own input (another one per rank: DDP and FSDP2 average different data)."""
        g = torch.Generator(device="cpu").manual_seed(seed + rank)
        return torch.randn(self.batch, self.seq, self.hidden, generator=g).to(self.device, self.dtype)


def setup_for(rank: int, world: int, device: torch.device) -> Setup:
    """CPU: tiny float32 layers. GPU: hidden 1024 in bf16 (sizes chosen so that no activation
    has the element count of a weight or a weight's shard)."""
    if device.type == "cuda":
        return Setup(rank, world, device, torch.bfloat16, hidden=1024, batch=2, seq=384)
    return Setup(rank, world, device, torch.float32, hidden=64, batch=2, seq=12)


class Stack(torch.nn.Module):
    """The layers in a row, plainly or in TransformerEngine's call shape (``ctx``/``sync``), or
    inside an ``OffloadActivations`` (``oa``): what DDP, FSDP2's root and a pipeline stage wrap."""

    def __init__(self, layers: torch.nn.ModuleList) -> None:
        super().__init__()
        self.layers = layers
        self.ctx: Any = None
        self.sync: Any = None
        self.oa: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.oa is not None:
            with self.oa:
                return self._run(x)
        return self._run(x)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.ctx is None:
                x = layer(x)
            else:
                with self.ctx:
                    x = layer(x)
                x = self.sync(x)
        return x


class Watch:
    """Every tensor the engine sends to the host, checked against the parameters' storages and
    sizes at that moment; and the figures of each finished step."""

    def __init__(self, engine: Any, layers: torch.nn.ModuleList, sharded: list[torch.Tensor]) -> None:
        self.offloaded = 0
        self.param_copies: list[str] = []  # what went wrong, readable
        self.finished: dict[int, dict[str, int]] = {}  # by step (finishing is idempotent)
        self.max_in_flight = 0
        stable = {t.untyped_storage().data_ptr() for t in sharded}
        sizes = {t.numel() for t in sharded}
        live: set[int] = set()  # the storages of the running layer's (unsharded) parameters
        for layer in layers:
            sizes |= {p.numel() for p in layer.parameters() if not hasattr(p, "to_local")}

            # Registered after FSDP2's own pre-hook: the parameters are all-gathered by now.
            def enter(module: torch.nn.Module, args: Any) -> None:
                live.update(p.untyped_storage().data_ptr() for p in module.parameters())

            def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
                live.clear()

            layer.register_forward_pre_hook(enter)
            layer.register_forward_hook(leave)
        # The engine's own hooks, wrapped: what pack returns says what happened to the tensor,
        # whichever hooks decided it (the Python ones, or the native ones on request).
        pack, unpack = engine._hooks.pack_hook, engine._hooks.unpack_hook

        def watched(t: torch.Tensor) -> Any:
            handle = pack(t)
            if type(handle) is tuple and len(handle) == 2:  # (group, index): sent to the host
                self.offloaded += 1
                ptr = t.untyped_storage().data_ptr()
                if ptr in stable or ptr in live:
                    self.param_copies.append(f"a tensor of shape {tuple(t.shape)} over a parameter's storage")
                elif t.numel() in sizes:
                    self.param_copies.append(f"a tensor of shape {tuple(t.shape)} with a parameter's size")
            return handle

        engine._hooks = torch.autograd.graph.saved_tensors_hooks(watched, unpack)
        finish = engine._finish

        def finishing(step: Any, trim: bool = True) -> None:
            self.max_in_flight = max(self.max_in_flight, len(engine.in_flight))
            finish(step, trim)
            c = step.counters
            self.finished[c.step] = {"step": c.step, "reloads": c.reloads, "on_demand": c.reloads_on_demand,
                                     "groups": c.groups_offloaded}

        engine._finish = finishing


def _offload(s: Setup, stack: Stack, form: str, sharded: list[torch.Tensor]) -> tuple[Any, Watch]:
    """Put an offload context of the given form on ``stack``; the context's stats and a watch."""
    n = len(stack.layers)
    if form == "te":
        stack.ctx, stack.sync = offload.get_cpu_offload_context(True, num_layers=n - 1, model_layers=n, **s.offload_kw())
        engine, owner = stack.ctx.engine, stack.ctx
    else:
        # The fixed count (as the TE form's), on CUDA too, where the default would plan.
        stack.oa = offload.OffloadActivations(stack.layers, num_offload_layers=n - 1, **s.offload_kw())
        engine, owner = stack.oa.engine, stack.oa
    return owner, Watch(engine, stack.layers, sharded)


def _figures(owner: Any, watch: Watch) -> dict[str, Any]:
    stats = owner.stats
    return {"offloaded": stats["offloaded_tensors"], "offloaded_bytes": stats["offloaded_bytes"],
            "parameters_kept": stats["kept"].get("parameter", 0), "watched": watch.offloaded,
            "param_copies": watch.param_copies[:5], "host_budget_bytes": stats["host_budget_bytes"],
            "host_numa": [stats["host_numa_node"], stats["host_numa_source"]],
            "finished": list(watch.finished.values()), "max_in_flight": watch.max_in_flight}


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _data_parallel(s: Setup, form: str, fsdp: bool) -> dict[str, Any]:
    stack = Stack(s.layers())
    sharded: list[torch.Tensor] = []
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(s.device.type, (s.world,))
        for layer in stack.layers:
            fully_shard(layer, mesh=mesh)
        model: torch.nn.Module = fully_shard(stack, mesh=mesh)
        sharded = [p.to_local() for p in stack.parameters()]
    else:
        model = torch.nn.parallel.DistributedDataParallel(stack, device_ids=[s.device.index] if s.cuda else None)
    x = s.batch_for(s.rank)

    def step() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        xin = x.detach().requires_grad_(True)
        (model(xin).float() ** 2).mean().backward()
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in stack.parameters()]
        return [g.clone() for g in grads] + [xin.grad.clone()]

    plain = step()
    repeats = _same(plain, step())
    owner, watch = _offload(s, stack, form, sharded)
    bitwise = all(_same(plain, step()) for _ in range(2))
    result = {"repeats": repeats, "bitwise": bitwise, **_figures(owner, watch)}
    if fsdp:
        # The same layers unwrapped, the same offload form: the bytes that are activations.
        alone = Stack(s.layers())
        alone_owner, _ = _offload(s, alone, form, [])
        (alone(x.detach().requires_grad_(True)).float() ** 2).mean().backward()
        result["unwrapped_offloaded_bytes"] = alone_owner.stats["offloaded_bytes"]
    else:
        flat = torch.cat([g.flatten().float() for g in plain[:-1]])
        gathered = [torch.empty_like(flat) for _ in range(s.world)]
        dist.all_gather(gathered, flat)
        result["synced"] = all(torch.equal(gathered[0], g) for g in gathered[1:])
    del model, stack  # DDP's reducer must go while the group lives
    return result


def _pipeline(s: Setup, form: str) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    per_stage = LAYERS // s.world
    layers = s.layers()
    stack = Stack(torch.nn.ModuleList(layers[s.rank * per_stage:(s.rank + 1) * per_stage]))
    stage = PipelineStage(stack, s.rank, s.world, s.device)
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=lambda out, target: ((out.float() - target.float()) ** 2).mean())
    x = torch.cat([s.batch_for(0, seed=200), s.batch_for(1, seed=200)])  # 4 micro-batches of batch / 2
    target = torch.cat([s.batch_for(2, seed=200), s.batch_for(3, seed=200)])

    def step() -> list[torch.Tensor]:
        stack.zero_grad(set_to_none=True)
        if s.rank == 0:
            schedule.step(x)
        elif s.rank == s.world - 1:
            schedule.step(target=target, losses=[])
        else:
            schedule.step()
        return [p.grad.clone() for p in stack.parameters()]

    plain = step()
    repeats = _same(plain, step())
    owner, watch = _offload(s, stack, form, [])
    bitwise = all(_same(plain, step()) for _ in range(2))
    return {"repeats": repeats, "bitwise": bitwise, **_figures(owner, watch)}


def run_scenario(s: Setup, name: str) -> dict[str, Any]:
    """One scenario on this rank; an exception becomes ``{"error": traceback}``."""
    if name in DIVERGE:
        return diverge.run_cases(diverge.sizes_for(s.rank, s.world, s.device), (DIVERGE[name],))[name]
    if name in CP:
        return cp_scenarios.run(s.device, name)
    try:
        kind, form = name.split("_")
        if kind == "pipeline":
            return _pipeline(s, form)
        return _data_parallel(s, form, fsdp=kind == "fsdp")
    except Exception:  # noqa: BLE001 - reported per scenario; the others still run
        return {"error": traceback.format_exc(limit=6)}


def problems(name: str, ranks: list[dict[str, Any]], *, local_world: int) -> list[str]:
    """What is wrong with a scenario's results (one dict per rank), in words; [] when all good."""
    if name in DIVERGE:
        sizes = diverge.sizes_for(0, len(ranks), torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        return diverge.problems(DIVERGE[name], ranks, sizes.base, sizes.batch)
    if name in CP:
        return cp_scenarios.problems(name, ranks)
    out: list[str] = []
    for rank, r in enumerate(ranks):
        where = f"{name} rank {rank}"
        if "error" in r:
            out.append(f"{where} raised:\n{r['error']}")
            continue
        if not r["repeats"]:
            out.append(f"{where}: the plain run does not repeat itself (a bitwise comparison would prove nothing)")
        if not r["bitwise"]:
            out.append(f"{where}: gradients with offload differ from the plain run's")
        if r["offloaded"] <= 0 or r["watched"] <= 0:
            out.append(f"{where}: nothing was offloaded ({r['offloaded']} tensors)")
        if r["parameters_kept"] <= 0:
            out.append(f"{where}: no parameter was seen and kept (kept['parameter'] is 0)")
        if r["param_copies"]:
            out.append(f"{where}: parameters were sent to the host: {r['param_copies']}")
        if "synced" in r and not r["synced"]:
            out.append(f"{where}: DDP's averaged gradients differ between ranks")
        if "unwrapped_offloaded_bytes" in r and r["offloaded_bytes"] != r["unwrapped_offloaded_bytes"]:
            out.append(f"{where}: FSDP2 offloaded {r['offloaded_bytes']} bytes, the same layers unwrapped "
                       f"{r['unwrapped_offloaded_bytes']}: something besides activations was copied")
        if name.startswith("ddp"):
            from offload.host.ledger import default_host_budget

            # The node's total less the floor left for others, shared by this job's ranks.
            share, source = default_host_budget({**os.environ, "LOCAL_WORLD_SIZE": str(local_world)})
            if r["host_budget_bytes"] != share:
                out.append(f"{where}: host budget {r['host_budget_bytes']} is not the node's share for "
                           f"{local_world} ranks ({share}: {source})")
        if name.startswith("pipeline"):
            if rank == 0 and r["max_in_flight"] < 1:
                out.append(f"{where}: stage 0 never had two micro-batches in flight (1F1B holds two)")
            late = [f for f in r["finished"] if f["on_demand"] or f["reloads"] != f["groups"]]
            if late:
                out.append(f"{where}: micro-batches whose groups were not all prefetched: {late[:3]}")
    return out


# -- launching ------------------------------------------------------------------------------------
def init(backend: str, rank: int, world: int, timeout_s: float = 120.0) -> None:
    """Join the process group (env:// rendezvous) with a timeout, so a lost rank fails the
    others instead of hanging them."""
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def gloo_worker(rank: int, world: int, port: int, out_dir: str, names: list[str]) -> None:
    """What each process ``test_multiprocess_cpu`` spawns runs: every scenario on gloo, its
    results written to ``out_dir/rank<r>.json``."""
    # Loopback for gloo's own connections: resolving the host name can pick an interface the
    # container cannot reach, and the ranks then wait for each other for good.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world),
                      GLOO_SOCKET_IFNAME="lo")
    init("gloo", rank, world, timeout_s=60.0)
    torch.set_num_threads(1)  # the ranks share the host's cores: oversubscribed threads slow gloo's steps
    try:
        s = setup_for(rank, world, torch.device("cpu"))
        results = {name: run_scenario(s, name) for name in names}
        # Every DDP object is gone (freed when its scenario returned) while the group still
        # lives: a reducer destroyed after destroy_process_group can wait for good.
        dist.barrier()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()
    # The results are on disk. Skip the interpreter's teardown: gloo's threads met static
    # destructors there once in a while ("terminate called without an active exception").
    os._exit(0)


def torchrun_main(argv: Optional[list[str]] = None, out: Callable[[str], None] = print) -> int:
    """``torchrun --nproc-per-node N run.py [scenario ...]``: NCCL on the GPUs (gloo without
    CUDA); rank 0 prints one line per scenario and every problem. Exit status 1 on a problem."""
    names = [a for a in (argv if argv is not None else sys.argv[1:])] or [
        *SCENARIOS, *DIVERGE, *(CP if torch.cuda.is_available() else ())]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        init("nccl", rank, world)
    else:
        device = torch.device("cpu")
        init("gloo", rank, world)
    s = setup_for(rank, world, device)
    results = {}
    for name in names:
        results[name] = run_scenario(s, name)
        if s.cuda:
            torch.cuda.synchronize()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, results)
    failed = 0
    if rank == 0:
        out(f"tests/distributed on {world} ranks, {device.type}, {s.dtype}, hidden {s.hidden}")
        for name in names:
            per_rank = [g[name] for g in gathered]
            found = problems(name, per_rank, local_world=local_world)
            failed += bool(found)
            head = per_rank[0]
            figures = cp_scenarios.summary(name, head) if name in CP else "" if "error" in head or name in DIVERGE else (
                f"offloaded {head['offloaded']} tensors ({head['offloaded_bytes'] / 2**20:.1f} MiB), "
                f"parameters kept {head['parameters_kept']}, NUMA {head['host_numa'][0]} ({head['host_numa'][1]})")
            out(f"  {name:<12} {'ok  ' if not found else 'FAIL'} {figures}")
            for p in found:
                out(f"    {p}")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0
