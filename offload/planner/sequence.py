"""Which probe each planning step runs, so that planning fits wherever checkpointing fits.

A plan is made from one measured probe step (:mod:`offload.planner.probe`) after warm-up steps
(a cold step allocates library workspaces and autotunes kernels). ``probe`` picks the kind:

``"auto"`` (the default; on CUDA)
    1. A low-memory step (every layer checkpointed) sizes the model: it counts what each layer
       saves, so the cost model can predict the plain step's peak without running it.
    2. If that prediction, plus the model's error (``PEAK_MODEL_ERROR``), fits what the device
       can give (:mod:`offload.planner.budget`) and the memory budget the user set in bytes (it
       binds every step, the probe's too), the measured plain step follows, the most exact.
       The sizing step measured its middle layer's recompute (the recompute's memory and time
       factors), which a calibration step (plain, one layer recomputed) would; only where that
       layer is called more than once does a calibration step come first.
    3. Otherwise the sizing step is the measured one (a second low-memory step would measure the
       same), its first-run layers' warm-up taken out (:mod:`offload.planner.warm_up`). One step.
    On CPU there is no device memory to run out of: the plain probe runs directly.
``"plain"``
    Plain warm-up steps, the last one calibrating, then the measured plain step.
``"recompute"``
    Low-memory steps only.

An out-of-memory error in a plain probe step switches to the low-memory probe (the next step is
measured at low memory). One in a low-memory step is a :class:`BudgetError`: the model does not
fit even with every layer recomputed.

**Ranks move together.** Which probe step comes next changes the collectives a rank issues (a rank
past its probe agrees on its plan's shape at its first layer, one still probing runs its step's
all-gathers), so under a process group every transition is the ranks' one decision. The
sequence is pure about it: :meth:`ProbeSequence.judge` gives this rank's :class:`StepOutcome`
of a step, the caller agrees on the worst outcome of all ranks
(:func:`offload.planner.agree.agree_max` of :meth:`StepOutcome.values`), and
:meth:`ProbeSequence.advance` moves on by the agreed one: the same next step on every rank. So
every rank takes the low-memory probe if any rank's sizing step predicts that the plain step
would not fit its device; every rank measures again at low memory if any rank's plain step ran
out of memory (a rank whose step completed drops its figures); every rank runs the same step
again if any rank's raised (or did not finish its backward); every rank raises the
:class:`BudgetError` if any rank's low-memory step ran out of memory. Without a process group
the agreed outcome is this rank's own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import torch

from ..engine.policy import SelectionPolicy
from ..engine.stats import format_bytes
from .calibration import RecomputeReading
from .probe import ProbeStep
from .scaling import predict_plain
from .search import PEAK_MODEL_ERROR, BudgetError
from .types import PLAIN_PROBE, RECOMPUTE_PROBE, LinkProfile, StepProfile
from .warm_up import layer_kind, without_warm_up

AUTO = "auto"
PROBE_CHOICES = (AUTO, PLAIN_PROBE, RECOMPUTE_PROBE)

# The sizing step only predicts a peak, which no copy takes part in: any link will do.
_NO_LINK = LinkProfile(d2h_gbps=1.0, h2d_gbps=1.0, duplex_gbps=1.0)


def check_probe(probe: object, where: str) -> str:
    """Validate a ``probe=`` argument: ``TypeError`` for a wrong type, ``ValueError`` for a
    string that is not one of :data:`PROBE_CHOICES`."""
    what = (f"offload: {where} probe must be one of {', '.join(map(repr, PROBE_CHOICES))} ('auto': "
            "low memory first, plain where it fits)")
    if not isinstance(probe, str):
        raise TypeError(f"{what}, got {probe!r} ({type(probe).__name__})")
    if probe not in PROBE_CHOICES:
        raise ValueError(f"{what}, got {probe!r}")
    return probe


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is the allocator running out of device memory."""
    return isinstance(exc, torch.cuda.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


class Verdict(enum.IntEnum):
    """How a probe step went on one rank, worst last: ranks agree on the largest."""

    DONE = 0        # it ran to its end: the sequence moves on
    AGAIN = 1       # it raised (not out of memory), or did not finish without a sign of memory: run it again
    LOW_MEMORY = 2  # a plain step ran out of memory (or did not finish its backward): measure at low memory
    NO_FIT = 3      # a low-memory step ran out of memory: BudgetError


@dataclass(frozen=True)
class StepOutcome:
    """One probe step's outcome on this rank, or the one the ranks agreed on.

    ``low_memory``: after the sizing step, the plain step's predicted peak is over this rank's
    device or the memory budget. ``raised``: the step raised something other than out of memory (fatal to
    :meth:`ProbeSequence.run`, the caller's own error in a ``with``). ``why`` and ``sizing`` stay
    on this rank (the reason for the report, the sizing step's figures)."""

    verdict: Verdict = Verdict.DONE
    low_memory: bool = False
    raised: bool = False
    why: str = field(default="", compare=False)
    sizing: Optional[StepProfile] = field(default=None, compare=False, repr=False)

    def values(self) -> list[int]:
        """What the ranks reduce (element-wise maximum: the worst verdict, any rank's flags)."""
        return [int(self.verdict), int(self.low_memory), int(self.raised)]

    @classmethod
    def from_values(cls, values: Sequence[int]) -> "StepOutcome":
        """The outcome of :meth:`values` reduced over the ranks."""
        return cls(Verdict(int(values[0])), bool(values[1]), bool(values[2]))


def _alone(outcome: StepOutcome) -> StepOutcome:
    return outcome


_NO_FIT = ("offload: the planner's probe ran out of device memory even with every layer recomputed (the "
           "lowest-memory probe: what checkpointing needs)")
_NO_FIT_HINT = "No plan can fit: use a shorter sequence, a smaller batch, or more GPUs (a smaller shard on each)"


def grow_allocator(device: torch.device, peak_bytes: int) -> None:
    """Grow the caching allocator to ``peak_bytes`` on ``device`` now: one block, freed at once
    (the allocator keeps it and splits it for the step's tensors). A step that would otherwise
    grow the pool between its kernels calls ``cudaMalloc`` there, and each of those waits for the
    driver while the background pinner registers host memory (``cuMemHostRegister`` holds it:
    measured on the H200, a stand-in step beside its plan's pinning). Out of memory here is left
    for the step itself to meet. No-op off CUDA."""
    if device.type != "cuda":
        return
    extra = peak_bytes - torch.cuda.memory_allocated(device)
    try:
        if extra > 0:
            torch.empty(extra, dtype=torch.uint8, device=device)
    except torch.cuda.OutOfMemoryError:
        pass


class ProbeSequence:
    """Hands out the probe step of each planning step and takes back how it went.

    Use: ``probe = seq.next_step()`` (None: run the step plainly, unmeasured), run the step
    between ``probe.begin()`` / ``probe.end_forward()`` and its backward, ``probe.end_step()``;
    then ``own = seq.judge(probe, exc)`` (``exc``: what the step raised, if it did), the outcome
    the ranks agree on (``own`` itself alone), and ``seq.advance(own, agreed, exc)``, which
    returns the :class:`StepProfile` once the measured step is done. :meth:`step_done` and
    :meth:`step_failed` do both for one process.
    """

    def __init__(
        self,
        layers: Sequence[torch.nn.Module],
        policy: SelectionPolicy,
        device: torch.device,
        *,
        probe: str = AUTO,
        warmup_steps: int = 2,
        candidates: Sequence[torch.nn.Module] = (),
        link: Callable[[], LinkProfile],
        device_limit: Optional[Callable[[], int]],
        budget_bytes: Optional[int] = None,
    ) -> None:
        self.layers, self.policy, self.device = list(layers), policy, device
        self.candidates = list(candidates)
        self.link = link
        self.device_limit = device_limit
        # A memory budget in bytes: the plain probe runs only within it. A user who set 24 GiB
        # on a larger GPU (another job shares it, or the model must also fit a smaller one)
        # meant every step; the plain probe ran at twice that on the H200 (T22, LLAMA-1B at
        # 6144), and the allocator kept all it had grown to reserved for the whole run.
        self.budget_bytes = budget_bytes
        self.recompute_peak: Optional[RecomputeReading] = None
        self.reason = ""  # why the probe kind was chosen, for the plan's report
        # The low-memory sizing step's figures (no link measured), once it ran: enough to
        # pin a plan's host blocks ahead of the measured step's plan.
        self.sizing: Optional[StepProfile] = None
        self.grow = False  # the measured plain step comes right after the sizing step
        if probe == AUTO and device_limit is None:  # no device memory to run out of (CPU)
            probe = PLAIN_PROBE
        self.mode = probe
        # The steps still to run, each "plain", "calibrate", "size" or "measure".
        if probe == AUTO:
            self.todo = ["size"] + (["measure"] if warmup_steps == 0 else [])
        elif probe == PLAIN_PROBE:
            self.todo = ["plain"] * max(0, warmup_steps - 1) + ["calibrate"] * min(1, warmup_steps) + ["measure"]
            self.reason = "plain probe (asked for)" if device_limit is not None else "plain probe (no device memory to size)"
        else:
            self.todo = ["plain"] * max(0, warmup_steps - 1) + ["measure"]
            self.reason = "low-memory probe (asked for)"

    # -- the steps ---------------------------------------------------------------------------------
    def next_step(self) -> Optional[ProbeStep]:
        """The probe for the next step, or None to run it plainly (a warm-up)."""
        kind = self.todo[0]
        if kind == "plain" and self.mode == PLAIN_PROBE:
            return None
        if kind == "measure" and self.grow:
            self._grow_allocator()
        mode = PLAIN_PROBE if kind == "calibrate" or (kind == "measure" and self.mode == PLAIN_PROBE) \
            else RECOMPUTE_PROBE
        return ProbeStep(self.layers, self.policy, self.device, calibrate_recompute=kind == "calibrate",
                         mode=mode, candidates=self.candidates)

    def _grow_allocator(self) -> None:
        # The measured plain step is the first plain one: the caching allocator would grow to the
        # plain peak inside it, mapping memory between its kernels (timed into its layers), as
        # the calibration step it replaces did for it. Grow it now to the sizing step's
        # prediction of that peak: one block, freed at once (the allocator keeps it). Out of
        # memory here is the measured step's to find (it then moves to the low-memory probe).
        self.grow = False
        if self.sizing is not None:
            grow_allocator(self.device, self.sizing.plain_peak_bytes)

    def judge(self, probe: Optional[ProbeStep], exc: Optional[BaseException] = None) -> StepOutcome:
        """This rank's outcome of the step ``probe`` ran (None: a plain warm-up), ``exc`` what it
        raised if it did; changes nothing. A plain warm-up that raised out of memory counts (as in
        :meth:`run`); one whose error ended inside a ``with`` is never seen here. Out of memory in
        a plain step (or, on CUDA, a plain step whose backward did not finish) calls for the
        low-memory probe; in a low-memory step it is :attr:`Verdict.NO_FIT`. An unfinished step
        on the CPU, which has no device memory to run out of, is run again."""
        low_memory = probe is not None and probe.mode == RECOMPUTE_PROBE
        if exc is not None:
            if not is_out_of_memory(exc):
                return StepOutcome(Verdict.AGAIN, raised=True)
            if low_memory:
                return StepOutcome(Verdict.NO_FIT)
            return StepOutcome(Verdict.LOW_MEMORY, why="low-memory probe: the plain probe step ran out of device memory")
        if probe is None:
            return StepOutcome()
        if not probe.records:
            # The same on every rank (the same model): raised here, before any agreement.
            raise ValueError(
                "offload: the probe step ran none of the given layers. If its `with` held the "
                "backward (or the optimizer's step), put it around the forward only: `with oa: loss "
                "= model(x)`, then `loss.backward()` (after the `with`, or inside that same one). "
                "Otherwise pass the modules the forward really calls (e.g. model.model.layers)"
            )
        if not probe.complete():
            # Its backward never ran, or raised (out of memory, most likely, outside the with).
            if low_memory or self.device_limit is None:
                return StepOutcome(Verdict.AGAIN)
            return StepOutcome(Verdict.LOW_MEMORY, why="low-memory probe: the plain probe step did not finish its "
                                                        "backward (out of memory there, or it raised)")
        if self.todo[0] == "size":
            return self._size(probe)
        return StepOutcome()

    def _size(self, probe: ProbeStep) -> StepOutcome:
        # The sizing step's prediction of the plain step's peak, against this rank's device.
        sizing = predict_plain(probe.profile(_NO_LINK))
        predicted = sizing.plain_peak_bytes
        need = int(predicted * (1 + PEAK_MODEL_ERROR))
        limit, bound = (self.device_limit() if self.device_limit is not None else 0), "the device's"
        if self.budget_bytes is not None and self.budget_bytes < limit:
            limit, bound = self.budget_bytes, "the memory budget's"
        fits = need <= limit
        why = (f"the plain step's predicted peak {format_bytes(predicted)} (+{PEAK_MODEL_ERROR:.0%}) "
               f"{'fits' if fits else 'is more than'} {bound} {format_bytes(limit)}")
        return StepOutcome(low_memory=not fits, why=why, sizing=sizing)

    def advance(self, own: StepOutcome, agreed: StepOutcome, exc: Optional[BaseException] = None,
                probe: Optional[ProbeStep] = None) -> Optional[StepProfile]:
        """Move on by the ``agreed`` outcome of the step (``own``: this rank's, from :meth:`judge`;
        ``exc``: what the step raised here; ``probe``: the step's probe); the profile when it was
        the measured step. Raises :class:`BudgetError` on :attr:`Verdict.NO_FIT`. A rank whose own
        step completed drops its figures when the agreed outcome is worse."""
        verdict = agreed.verdict
        if verdict == Verdict.NO_FIT:
            if own.verdict == Verdict.NO_FIT:
                raise BudgetError(f"{_NO_FIT}. {_NO_FIT_HINT}") from exc
            raise BudgetError(f"{_NO_FIT} on another rank of the plan group (see its error). {_NO_FIT_HINT}")
        if verdict == Verdict.LOW_MEMORY:
            self.mode = RECOMPUTE_PROBE
            self.todo = ["measure"]
            self.reason = own.why if own.verdict == Verdict.LOW_MEMORY else (
                "low-memory probe: another rank's plain probe step ran out of device memory (or did not finish "
                "its backward)")
            return None
        if verdict == Verdict.AGAIN:
            return None  # the same step again
        kind = self.todo.pop(0)
        if kind == "calibrate" and probe is not None:
            self.recompute_peak = probe.recompute_peak()
        elif kind == "size":
            self.sizing = own.sizing
            if agreed.low_memory:
                self.mode = RECOMPUTE_PROBE
                self.reason = f"low-memory probe: {own.why}" if own.low_memory else (
                    f"low-memory probe: on another rank of the plan group the plain step would not fit its "
                    f"device or the budget (here {own.why})")
                if probe is None:  # (no figures to take: measure at low memory)
                    self.todo = ["measure"]
                    return None
                # The measured step would be the same low-memory step again: this one is it, its
                # first-run layers' warm-up taken out (offload.planner.warm_up). Every rank has
                # its profile at this same step (the verdict is the agreed one).
                self.todo = []
                return self._measured_sizing(probe)
            else:
                # The sizing step measured its middle layer's recompute as a calibration step
                # would (docs/design.md, "The first steps"): the measured plain step comes next,
                # on an allocator grown to its peak first (:meth:`_grow_allocator`).
                self.recompute_peak = probe.recompute_peak() if probe is not None else None
                calibrated = probe is not None and probe.recompute_index is not None
                self.mode, self.todo = PLAIN_PROBE, ["measure"] if calibrated else ["calibrate", "measure"]
                self.grow = calibrated
                self.reason = f"plain probe: {own.why}"
        elif kind == "measure" and probe is not None:
            # The measured plain step is often the first at its length (a stream's second batch):
            # the length's one-off costs land in its first layers too (H200, LLAMA-1B at 6144:
            # layer 0's forward 135 ms against 11 for the others, and every plan predicted 42%
            # slow). Taken out as the sizing step's are; the peak stays the one measured.
            profile, steadied = self._steadied(probe, probe.profile(self.link(), recompute_peak=self.recompute_peak))
            if steadied:
                profile = replace(profile, plain_step_ms=predict_plain(profile).plain_step_ms)
            return replace(profile, probe_reason=self.reason + _left_out(steadied))
        return None

    def _measured_sizing(self, probe: ProbeStep) -> StepProfile:
        profile, steadied = self._steadied(probe, probe.profile(self.link()))
        if steadied:
            profile = predict_plain(profile)
        return replace(profile, probe_reason=self.reason + "; the sizing step measured" + _left_out(steadied))

    @staticmethod
    def _steadied(probe: ProbeStep, measured: StepProfile) -> tuple[StepProfile, list[int]]:
        # The measured step's first-run layers' warm-up taken out (offload.planner.warm_up).
        kinds = [layer_kind(r.module, layer) for r, layer in zip(probe.records, measured.layers)]
        return without_warm_up(measured, kinds)

    def step_done(self, probe: Optional[ProbeStep]) -> Optional[StepProfile]:
        """One process: take a step that ran to its end (its backward may have failed); the
        profile when it was the measured one."""
        own = self.judge(probe)
        return self.advance(own, own, probe=probe)

    def step_failed(self, probe: Optional[ProbeStep], exc: BaseException) -> bool:
        """One process: a probe step raised ``exc``. Returns whether the sequence goes on (the
        step is run again, or at low memory); False for errors other than out of memory, which
        are the caller's. Raises :class:`BudgetError` for out of memory at low memory."""
        own = self.judge(probe, exc)
        if own.raised:
            return False
        self.advance(own, own, exc, probe)
        return True

    def run(self, step_fn: Callable[[], object], where: str,
            agree: Callable[[StepOutcome], StepOutcome] = _alone) -> StepProfile:
        """Run ``step_fn()`` (one whole training step) as the sequence's steps until the measured
        one is done; its profile. ``where`` names the caller in errors. ``agree``: the outcome the
        ranks agree on, from this rank's (called once after every step, on every rank)."""
        while True:
            current = self.next_step()
            failure: Optional[Exception] = None  # what the step raised
            misuse: Optional[RuntimeError] = None  # a step that is not one whole training step
            try:
                if current is not None:
                    current.begin()
                step_fn()
            except Exception as exc:
                if current is not None:
                    current.end_forward()
                failure = exc
            else:
                if current is not None:
                    current.end_step()
                    if current.records and not current.complete():
                        misuse = RuntimeError(
                            f"{where}: the step ran the forward but not the whole backward; it must be "
                            "one whole training step (loss.backward() included)"
                        )
            own = StepOutcome(Verdict.AGAIN, raised=True) if misuse is not None else self.judge(current, failure)
            agreed = agree(own)
            if agreed.raised:
                if misuse is not None:
                    raise misuse
                if own.raised:
                    raise RuntimeError(
                        f"{where}: the probe step raised {type(failure).__name__}: {failure}. The probe runs "
                        "the step as it is (no offload); fix the step so that it runs on its own first"
                    ) from failure
                raise RuntimeError(f"{where}: the probe step raised on another rank of the plan group; see its error")
            profile = self.advance(own, agreed, failure, current)
            if profile is not None:
                return profile


def _left_out(steadied: Sequence[int]) -> str:
    """The probe reason's note on the layers whose warm-up was taken out (none: nothing)."""
    return f" (the warm-up left out of layers {', '.join(map(str, steadied))})" if steadied else ""
