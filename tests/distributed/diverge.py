"""Ranks that differ on purpose (issue 48): every decision that changes the collectives a rank
issues must be taken by all ranks together, or one rank waits in a collective the others never
join. Shared by the gloo test on the CPU (``test_ranks_diverge_cpu.py``, 2 and 3 processes) and
the NCCL scenarios on two GPUs (``dist_scenarios``, under torchrun).

Each case runs :data:`STEPS` steps of ``OffloadActivations`` over a stack of ``MLPBlock`` layers
(or a tiny HF Llama in the model form), after the same steps plainly, twice (the plain run must
repeat itself). The ranks diverge on purpose:

- ``lengths``: each rank its own length at each step, ``BASE * (1, 0.5, 0.75, 0.375)[(i + r) % 4]``
  (the issue's stream), under DDP (CPU) or FSDP2 and DDP (GPU);
- ``low_memory``: the last rank's device limit is forced to one byte, so its sizing step alone
  predicts that the plain step would not fit: every rank must take the low-memory probe;
- ``bucket``: the last rank alone meets a new, 4x longer bucket at two steps;
- ``oom``: the last rank runs out of memory (simulated: ``torch.OutOfMemoryError``) in the sizing
  step (a ``BudgetError`` on every rank at the next entry) and in the plain calibration step
  (every rank measures at low memory), rank 0 raises another error in the measured step (every
  rank measures again), and after the probe the last rank runs out of memory in a planned step
  (every rank plans again; the lowered budget fits no plan at the longest bucket, so every rank
  raises ``BudgetError`` at those steps). The loop catches the errors and goes on, as an
  OOM-retry loop does. On the CPU the model has **no DDP** (each rank trains its own copy: DDP's
  all-reduce cannot survive a rank that raised in the middle of its forward), and the error comes
  from inside a layer; on the GPU, under FSDP2 and DDP, it comes inside the ``with`` after the
  model's forward (a real out-of-memory error in the planned step), and the **loop agrees to
  skip** the backward of a step that failed on any rank (one all-reduce of a flag);
- ``short`` (CPU): the model form's short probe (``model=``) with rank 0's first batch long enough
  to be probed short and the others' not: every rank must probe short, or none;
- base growth (CPU, in the ``ddp`` case): from step :data:`BASE_GROWS_AT` the last rank's entry
  holds :data:`BASE_GROWTH` more bytes than its plans' base (as after AdamW's first step under
  gradient accumulation; read through a stand-in of the allocator's count): that rank plans again
  on the grown base, and every rank with it at the same step.

What must hold: nothing hangs (a short process-group timeout, and a deadline on the processes);
every rank goes through the same phases at the same steps (probe kinds, planned, the same
``BudgetError`` steps), so all leave the probe at the same step; the ranks follow plans made for
the same bucket at every planned step, at least as large as each rank's own; each rank's gradients
are bitwise the plain run's at every step that ran.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

import offload
from offload import plan_steps
from offload.layers import model_form
from offload.models import MLPBlock
from offload.planner import replan_steps
from offload.planner.scaling import profile_at
from offload.planner.search import BudgetError, lowest_peak
from offload.planner.shapes import StepShape

STEPS = 20
LAYERS = 4
FACTORS = (1.0, 0.5, 0.75, 0.375)  # the stream: rank r at step i, FACTORS[(i + r) % 4]
# The "oom" case's faults: (step, rank) where rank -1 is the last one.
PROBE_OOMS = {0: -1, 3: -1}  # in the sizing step, then in the plain calibration step
OTHER_ERRORS = {4: 0}        # in the (low-memory) measured step
SET_BUDGET_AT = 7            # every rank: a budget just over the lowest plan's at the longest bucket
PLANNED_OOMS = {12: -1}
NEW_BUCKET_STEPS = (10, 15)  # the last rank's length is 4 x the longest of the stream
SHORT_PROBE_TOKENS = 32      # the "short" case: rank 0's first step has 2 x 48 tokens, the others 2 x 24
BASE_GROWS_AT = 17           # the last rank's entry holds BASE_GROWTH more from here (base_grows)
BASE_GROWTH = 1 << 28        # over 4% (the model's error) of the CPU cases' 1 GiB budget


@dataclass(frozen=True)
class Case:
    """One scenario: its model, its data-parallel wrapper and how the ranks diverge."""

    name: str
    wrap: str = "ddp"      # "ddp", "fsdp" or "none" (each rank its own model)
    model: str = "mlp"     # "mlp" (a stack of MLPBlock) or "llama" (the model form)
    forced_low_memory: bool = False
    faults: bool = False
    new_bucket: bool = False
    base_grows: bool = False


# On the CPU, one DDP case diverges three ways at once (each rank its own lengths, the last one
# forced onto the low-memory probe and meeting a new bucket): a spawned rank's steps cost CI time.
CPU_CASES = (Case("ddp", forced_low_memory=True, new_bucket=True, base_grows=True), Case("oom", wrap="none", faults=True),
             Case("short", wrap="none", model="llama"))
GPU_CASES = tuple(Case(f"diverge_{wrap}_{name}", wrap=wrap, forced_low_memory=name == "low_memory",
                       faults=name == "oom", new_bucket=name == "bucket")
                  for wrap in ("fsdp", "ddp") for name in ("lengths", "low_memory", "bucket", "oom"))


@dataclass(frozen=True)
class Sizes:
    """Where a rank computes, and the sizes of its steps."""

    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype
    hidden: int
    batch: int
    base: int  # the longest length of the stream

    @property
    def last(self) -> int:
        """The rank that diverges (the last one)."""
        return self.world - 1

    def length(self, case: Case, rank: int, step: int) -> int:
        """``rank``'s length at ``step``."""
        if case.model == "llama":
            return 48 if (rank == 0 and step == 0) else 24 - 4 * ((step + rank) % 2)
        if case.new_bucket and rank == self.last and step in NEW_BUCKET_STEPS:
            return 4 * self.base  # a bucket no other rank meets
        return max(1, int(self.base * FACTORS[(step + rank) % 4]))


def sizes_for(rank: int, world: int, device: torch.device) -> Sizes:
    """CPU: tiny float32 layers. GPU: bf16, hidden 512, lengths up to 1024."""
    if device.type == "cuda":
        return Sizes(rank, world, device, torch.bfloat16, hidden=512, batch=2, base=1024)
    return Sizes(rank, world, device, torch.float32, hidden=32, batch=2, base=64)


class _Stack(torch.nn.Module):
    """The layers in a row (what DDP or FSDP2's root wraps)."""

    def __init__(self, layers: torch.nn.ModuleList) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class InjectedError(RuntimeError):
    """A failure that is not out of memory (the step is probed again on every rank)."""


class Faults:
    """What the "oom" case raises where, on this rank; and the allocator's OOM count as the
    planner reads it on the CPU (where nothing else counts out-of-memory errors)."""

    def __init__(self, s: Sizes, case: Case) -> None:
        self.s, self.on = s, case.faults
        self.in_layer = case.wrap == "none"  # else after the model's forward, inside the with
        self.step = -1
        self.ooms = 0

    def _mine(self, table: dict[int, int]) -> bool:
        rank = table.get(self.step)
        return self.on and rank is not None and rank % self.s.world == self.s.rank

    def raise_due(self) -> None:
        """Raise this step's fault, if this rank has one."""
        if self._mine(OTHER_ERRORS):
            raise InjectedError("injected failure (not a memory error)")
        if self._mine(PROBE_OOMS):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        if self._mine(PLANNED_OOMS):
            if self.s.device.type == "cuda":
                torch.empty(1 << 50, dtype=torch.uint8, device=self.s.device)  # a real one, counted
            self.ooms += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")

    def layer_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """A forward hook on a middle layer: the fault from inside that layer."""
        if self.in_layer:
            self.raise_due()


@contextlib.contextmanager
def patched(s: Sizes, case: Case, faults: Faults) -> Iterator[None]:
    """The test's hooks into the planner, while the case runs: the last rank's device
    limit forced to one byte (the others' to 1 PiB on the CPU, where there is no limit to read),
    the CPU's out-of-memory count read from ``faults``, the short probe's length."""
    real = plan_steps.ProbeSequence
    limit: Optional[int] = None
    if case.forced_low_memory:
        limit = 1 if s.rank == s.last else (None if s.device.type == "cuda" else 1 << 50)
    elif case.faults and s.device.type != "cuda":
        limit = 1 << 50  # the "auto" probe (sizing, calibration, measured step) on the CPU too

    def forced(*args: Any, **kwargs: Any) -> Any:
        if limit is not None:
            kwargs["device_limit"] = lambda: limit
        return real(*args, **kwargs)

    count, held = plan_steps._oom_count, replan_steps.held_at_entry
    plan_steps.ProbeSequence = forced  # type: ignore[assignment,misc]
    if s.device.type != "cuda":
        plan_steps._oom_count = lambda device: faults.ooms
    if case.base_grows and s.rank == s.last:
        replan_steps.held_at_entry = lambda device: held(device) + (BASE_GROWTH if faults.step >= BASE_GROWS_AT else 0)
    try:
        yield
    finally:
        plan_steps.ProbeSequence = real  # type: ignore[misc]
        plan_steps._oom_count = count
        replan_steps.held_at_entry = held


# -- the models --------------------------------------------------------------------------------------
def _mlp(s: Sizes, case: Case) -> tuple[torch.nn.Module, torch.nn.ModuleList, Callable[[int, int], Any]]:
    torch.manual_seed(0)  # the same weights on every rank
    layers = torch.nn.ModuleList(MLPBlock(s.hidden, device=s.device, dtype=s.dtype) for _ in range(LAYERS))

    def batch(rank: int, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + 10 * step + rank)
        return torch.randn(s.batch, s.length(case, rank, step), s.hidden, generator=g).to(s.device, s.dtype)

    return _Stack(layers), layers, batch


def _llama(s: Sizes, case: Case) -> tuple[torch.nn.Module, torch.nn.ModuleList, Callable[[int, int], Any]]:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=s.hidden, intermediate_size=4 * s.hidden, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, use_cache=False,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(s.device)

    def batch(rank: int, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + 10 * step + rank)
        return torch.randint(0, config.vocab_size, (s.batch, s.length(case, rank, step)), generator=g).to(s.device)

    return model, model.model.layers, batch


def _wrap(s: Sizes, case: Case, model: torch.nn.Module, layers: torch.nn.ModuleList) -> torch.nn.Module:
    if case.wrap == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[s.device.index] if s.device.type == "cuda" else None)
    if case.wrap == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(s.device.type, (s.world,))
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    return model


def _loss(case: Case, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if case.model == "llama":
        return model(input_ids=x, labels=x).loss
    return (model(x).float() ** 2).mean()


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        g = p.grad
        out.append(None if g is None else (g.to_local() if hasattr(g, "to_local") else g).detach().clone())
    return out


def _same(a: Optional[list[Any]], b: Optional[list[Any]]) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)) for x, y in zip(a, b))


def _any_rank(flag: bool, s: Sizes) -> bool:
    # The loop's own agreement: a step that failed on any rank has its backward skipped on all.
    t = torch.tensor([int(flag)], device=s.device if s.device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _phase(oa: Any) -> str:
    planned = oa._planned
    if not planned._probing:
        return "planned" if planned.profile is not None else "none"
    probe = planned.probe
    return "warmup" if probe is None else probe.mode + ("+calibrate" if probe.calibrating else "")


def _plan_shape(oa: Any) -> Optional[list[int]]:
    plan = oa.plan
    shape = getattr(getattr(plan, "profile", None), "shape", None) if plan is not None else None
    return None if shape is None else [int(shape[0]), int(shape[1])]


# -- one case on this rank ------------------------------------------------------------------------------
def run_case(s: Sizes, case: Case) -> dict[str, Any]:
    """The case on this rank: per step, its phase and error, the plan's shape, whether the
    gradients are bitwise the plain run's; the plain run's repeatability."""
    model, layers, batch = (_llama if case.model == "llama" else _mlp)(s, case)
    faults = Faults(s, case)
    if case.faults:
        # Only where faults are injected: a forward hook on a layer makes the model form probe
        # at full length (it may compute, and would see the short probe's calls).
        layers[LAYERS // 2].register_forward_hook(faults.layer_hook)
    wrapped = _wrap(s, case, model, layers)
    skip_together = case.faults and case.wrap != "none"

    def step(i: int, oa: Any) -> tuple[str, Optional[list[torch.Tensor]]]:
        faults.step = i if oa is not None else -1
        wrapped.zero_grad(set_to_none=True)
        phase, error, loss = "refused", "", None
        try:
            with oa if oa is not None else contextlib.nullcontext():
                phase = _phase(oa) if oa is not None else "plain"
                loss = _loss(case, wrapped, batch(s.rank, i))
                if not faults.in_layer:
                    faults.raise_due()
        except (torch.OutOfMemoryError, BudgetError, InjectedError) as exc:
            error, loss = type(exc).__name__, None
        if skip_together and _any_rank(loss is None, s):
            loss = None
        if loss is not None:
            loss.backward()
        after = _phase(oa) if oa is not None else "plain"
        return f"{phase}>{after}" + (f"!{error}" if error else "") + ("" if loss is not None else " (no backward)"), \
            (_grads(model) if loss is not None else None)

    # DDP rebuilds its buckets after its first step, and over 3 ranks another grouping sums in
    # another order: that step is not compared.
    step(0, None)
    plain = [step(i, None)[1] for i in range(STEPS)]
    # The kernels repeat themselves (or a bitwise comparison proves nothing): seen on the first
    # steps, which have each rank's every length.
    repeats = all(_same(plain[i], step(i, None)[1]) for i in range(len(FACTORS)))
    # Plans made ahead (the default on CUDA) on the CPU too: a stand-in, then the switch, agreed.
    options: dict[str, Any] = {"plan_ahead": True} if s.device.type == "cuda" else \
        {"device": "cpu", "min_offload_bytes": 0, "plan_ahead": True}
    if case.model == "llama":
        options.update(model=model, memory_budget_bytes=1 << 30)
    elif s.device.type != "cuda":
        options["memory_budget_bytes"] = 1 << 30
    old_tokens = model_form.SHORT_PROBE_TOKENS
    model_form.SHORT_PROBE_TOKENS = SHORT_PROBE_TOKENS
    timeline, shapes, bitwise, together = [], [], [], []
    try:
        with patched(s, case, faults):
            oa = offload.OffloadActivations(layers, **options)
            for i in range(STEPS):
                if case.faults and i == SET_BUDGET_AT and oa._planned.profile is not None:
                    oa.set_budget(_tight_budget(oa, s))
                status, grads = step(i, oa)
                timeline.append(status)
                shapes.append(_plan_shape(oa))
                together.append(bool(oa._planned.last_plan.get("new")))  # planned with the group at this step
                bitwise.append(None if grads is None else _same(grads, plain[i]))
        reason = oa._planned.profile.probe_reason if oa._planned.profile is not None else ""
        lowered = oa._planned._lowered
        oa.close()
    finally:
        model_form.SHORT_PROBE_TOKENS = old_tokens
    del wrapped  # DDP's reducer must go while the group lives
    return {"repeats": repeats, "timeline": timeline, "shapes": shapes, "bitwise": bitwise, "reason": reason,
            "lowered": lowered, "own": [s.length(case, s.rank, i) for i in range(STEPS)], "together": together}


def _tight_budget(oa: Any, s: Sizes) -> int:
    # Just over the lowest plan's predicted peak at the longest bucket: one out-of-memory step
    # (its budget lowered to 90%) then leaves no plan there.
    bucket = StepShape(s.batch, s.base).bucket()
    return int(1.05 * lowest_peak(profile_at(oa._planned.profile, bucket)).prediction.peak_bytes)


def run_cases(s: Sizes, cases: tuple[Case, ...]) -> dict[str, Any]:
    """Every case in turn; after one raised (the group may be broken), the rest are not run."""
    import traceback

    results: dict[str, Any] = {}
    for case in cases:
        try:
            results[case.name] = run_case(s, case)
        except Exception:  # noqa: BLE001 - reported to the test
            results[case.name] = {"error": traceback.format_exc(limit=10)}
            for rest in cases[cases.index(case) + 1:]:
                results[rest.name] = {"error": f"not run: case {case.name} raised before it"}
            break
    return results


# -- judging ----------------------------------------------------------------------------------------
def problems(case: Case, ranks: list[dict[str, Any]], base: int, batch: int) -> list[str]:
    """What went wrong in ``case`` (one result per rank), in words; [] when all is well."""
    out = [f"rank {r} raised:\n{res['error']}" for r, res in enumerate(ranks) if "error" in res]
    if out:
        return out
    last = len(ranks) - 1
    for r, res in enumerate(ranks):
        if not res["repeats"]:
            out.append(f"rank {r}: the plain run does not repeat itself (a bitwise comparison proves nothing)")
        differ = [i for i, ok in enumerate(res["bitwise"]) if ok is False]
        if differ:
            out.append(f"rank {r}: gradients differ from the plain run's at steps {differ}")
    # The phases, rank by rank; a simulated error belongs to its own rank only.
    phases = [[t.split("!")[0].replace(" (no backward)", "") for t in res["timeline"]] for res in ranks]
    budget = [[i for i, t in enumerate(res["timeline"]) if "!BudgetError" in t] for res in ranks]
    for r in range(1, len(ranks)):
        if phases[r] != phases[0]:
            out.append(f"rank {r} went through other phases than rank 0:\n  rank 0: {ranks[0]['timeline']}\n"
                       f"  rank {r}: {ranks[r]['timeline']}")
        if budget[r] != budget[0]:
            out.append(f"rank {r} raised BudgetError at steps {budget[r]}, rank 0 at {budget[0]}")
    planned = [i for i, p in enumerate(phases[0]) if p.endswith(">planned")]
    if not planned or planned[-1] != STEPS - 1:
        out.append(f"no plan came into force by the last step: {ranks[0]['timeline']}")
    for i in planned:
        if i in budget[0]:
            continue
        shapes = [res["shapes"][i] for res in ranks]
        if any(sh != shapes[0] for sh in shapes) or shapes[0] is None:
            out.append(f"step {i}: the ranks follow plans for different shapes {shapes}")
            continue
        need = StepShape(batch, max(res["own"][i] for res in ranks)).bucket()
        if shapes[0][0] < need.batch or shapes[0][1] < need.length:
            out.append(f"step {i}: the plan was made for {shapes[0]}, less than the ranks' largest bucket {need}")
    out += _case_checks(case, ranks, phases, budget, last)
    return out


def _case_checks(case: Case, ranks: list[dict[str, Any]], phases: list[list[str]], budget: list[list[int]],
                 last: int) -> list[str]:
    out = []
    if case.forced_low_memory:
        # One low-memory step on every rank, the sizing step measured, then the plan on all at once.
        if phases[0][:2] != ["recompute>recompute", "planned>planned"]:
            out.append(f"the ranks did not all take the low-memory probe (the sizing step measured, then "
                       f"planned together): {phases[0][:3]}")
        if "another rank" not in ranks[0]["reason"]:
            out.append(f"rank 0's probe reason does not say another rank chose: {ranks[0]['reason']!r}")
    if case.new_bucket:
        top = StepShape(1, max(ranks[last]["own"])).bucket().length
        for i in NEW_BUCKET_STEPS:
            if (ranks[0]["shapes"][i] or [0, 0])[1] != top:
                out.append(f"step {i}: rank {last} alone met a bucket of length {top}; the plan was made for "
                           f"{ranks[0]['shapes'][i]}")
    if case.faults:
        timeline = ranks[0]["timeline"]
        if budget[0][:1] != [1]:
            out.append(f"the sizing step's out of memory on rank {last} was not every rank's BudgetError at "
                       f"step 1: {timeline}")
        if not phases[0][4].startswith("recompute") or phases[0][5] != "recompute>recompute":
            out.append(f"after the calibration step's out of memory on rank {last}, the ranks did not all "
                       f"measure at low memory (twice: rank 0 raised in the first): {timeline}")
        if not [i for i in budget[0] if i > max(PLANNED_OOMS)]:
            out.append(f"the planned step's out of memory on rank {last} led to no BudgetError (the case "
                       f"proves nothing): {timeline}")
        if "lowered" not in ranks[last]["lowered"] or any(res["lowered"] for res in ranks[:last]):
            out.append(f"only rank {last}'s budget should be lowered: {[res['lowered'] for res in ranks]}")
    if case.base_grows:
        if "planned again" not in ranks[last]["lowered"] or any(res["lowered"] for res in ranks[:last]):
            out.append(f"only rank {last}'s base grew, and it should have planned again: {[res['lowered'] for res in ranks]}")
        # A bucket every rank has a plan for is planned together only after a rank asked for it.
        if not all(res["together"][BASE_GROWS_AT] for res in ranks):
            out.append(f"rank {last} planned again at step {BASE_GROWS_AT} without the others: "
                       f"{[res['together'][BASE_GROWS_AT] for res in ranks]}")
    if case.model == "llama" and not phases[0][0].endswith(">planned"):
        out.append(f"the first step was not probed short on every rank: {phases[0][:4]}")
    return out
