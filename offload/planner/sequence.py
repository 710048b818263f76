"""Which probe each planning step runs, so that planning fits wherever checkpointing fits.

A plan is made from one measured probe step (:mod:`offload.planner.probe`) after warm-up steps
(a cold step allocates library workspaces and autotunes kernels). ``probe`` picks the kind:

``"auto"`` (the default; on CUDA)
    1. A low-memory step (every layer checkpointed) sizes the model: it counts what each layer
       saves, so the cost model can predict the plain step's peak without running it.
    2. If that prediction, plus the model's error (``PEAK_MODEL_ERROR``), fits what the device
       can give (:mod:`offload.planner.budget`), the plain probe follows: a calibration step
       (plain, one layer recomputed), then the measured plain step. It is the most exact.
    3. Otherwise the measured step is a low-memory one too. Two steps in all.
    On CPU there is no device memory to run out of: the plain probe runs directly.
``"plain"``
    Plain warm-up steps, the last one calibrating, then the measured plain step.
``"recompute"``
    Low-memory steps only.

An out-of-memory error in a plain probe step switches to the low-memory probe (the next step is
measured at low memory). One in a low-memory step is a :class:`BudgetError`: the model does not
fit even with every layer recomputed.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional, Sequence

import torch

from ..engine.policy import SelectionPolicy
from ..engine.stats import format_bytes
from .probe import ProbeStep
from .scaling import predict_plain
from .search import PEAK_MODEL_ERROR, BudgetError
from .types import PLAIN_PROBE, RECOMPUTE_PROBE, LinkProfile, StepProfile

AUTO = "auto"
PROBE_CHOICES = (AUTO, PLAIN_PROBE, RECOMPUTE_PROBE)

# The sizing step only predicts a peak, which no copy takes part in: any link will do.
_NO_LINK = LinkProfile(d2h_gbps=1.0, h2d_gbps=1.0, duplex_gbps=1.0)


def check_probe(probe: object, where: str) -> str:
    """Validate a ``probe=`` argument."""
    if probe not in PROBE_CHOICES:
        raise ValueError(
            f"offload: {where} probe must be one of {PROBE_CHOICES} ('auto': low memory first, "
            f"plain where it fits), got {probe!r}"
        )
    return str(probe)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is the allocator running out of device memory."""
    return isinstance(exc, torch.cuda.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


class ProbeSequence:
    """Hands out the probe step of each planning step and takes back how it went.

    Use: ``probe = seq.next_step()`` (None: run the step plainly, unmeasured), run the step
    between ``probe.begin()`` / ``probe.end_forward()`` and its backward, ``probe.end_step()``,
    then ``seq.step_done(probe)``, which returns the :class:`StepProfile` once the measured step
    is done (or ``seq.step_failed(...)`` when the step raised).
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
    ) -> None:
        self.layers, self.policy, self.device = list(layers), policy, device
        self.candidates = list(candidates)
        self.link = link
        self.device_limit = device_limit
        self.recompute_peak: Optional[tuple[int, int, float]] = None
        self.reason = ""  # why the probe kind was chosen, for the plan's report
        # The low-memory sizing step's figures (no link measured), once it ran: enough to
        # pin a plan's host blocks ahead of the measured step's plan.
        self.sizing: Optional[StepProfile] = None
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
        mode = PLAIN_PROBE if kind == "calibrate" or (kind == "measure" and self.mode == PLAIN_PROBE) \
            else RECOMPUTE_PROBE
        return ProbeStep(self.layers, self.policy, self.device, calibrate_recompute=kind == "calibrate",
                         mode=mode, candidates=self.candidates)

    def step_done(self, probe: Optional[ProbeStep]) -> Optional[StepProfile]:
        """Take a step that ran to its end; return the profile when it was the measured one."""
        if probe is not None and not probe.records:
            raise ValueError(
                "offload: the probe step ran none of the given layers. If its `with` held the "
                "backward (or the optimizer's step), put it around the forward only: `with oa: loss "
                "= model(x)`, then `loss.backward()` (after the `with`, or inside that same one). "
                "Otherwise pass the modules the forward really calls (e.g. model.model.layers)"
            )
        if probe is not None and not probe.complete():
            # Its backward never ran, or raised (out of memory, most likely, outside the with).
            self.step_failed(probe, None)
            return None
        kind = self.todo.pop(0)
        if kind == "calibrate" and probe is not None:
            self.recompute_peak = probe.recompute_peak()
        elif kind == "size" and probe is not None:
            self._choose_after_sizing(probe)
        elif kind == "measure" and probe is not None:
            return replace(probe.profile(self.link(), recompute_peak=self.recompute_peak), probe_reason=self.reason)
        return None

    def _choose_after_sizing(self, probe: ProbeStep) -> None:
        self.sizing = predict_plain(probe.profile(_NO_LINK))
        predicted = self.sizing.plain_peak_bytes
        need = int(predicted * (1 + PEAK_MODEL_ERROR))
        limit = self.device_limit() if self.device_limit is not None else 0
        if need <= limit:
            self.mode = PLAIN_PROBE
            self.todo = ["calibrate", "measure"]
            self.reason = (f"plain probe: the plain step's predicted peak {format_bytes(predicted)} "
                           f"(+{PEAK_MODEL_ERROR:.0%}) fits the device's {format_bytes(limit)}")
        else:
            self.mode = RECOMPUTE_PROBE
            self.todo = ["measure"]
            self.reason = (f"low-memory probe: the plain step's predicted peak {format_bytes(predicted)} "
                           f"(+{PEAK_MODEL_ERROR:.0%}) is more than the device's {format_bytes(limit)}")

    def step_failed(self, probe: Optional[ProbeStep], exc: Optional[BaseException]) -> bool:
        """A probe step raised ``exc`` (None: it did not finish its backward). Returns whether the
        sequence goes on: out of memory in a plain step (or, on CUDA, an unfinished step) moves on
        to the low-memory probe; an unfinished step on the CPU, which has no device memory to run
        out of, is measured again; out of memory in a low-memory step is a :class:`BudgetError`;
        other errors are the caller's (False)."""
        low_memory = probe is not None and probe.mode == RECOMPUTE_PROBE
        if exc is not None and not is_out_of_memory(exc):
            return False
        if low_memory and exc is not None:
            raise BudgetError(
                "offload: the planner's probe ran out of device memory even with every layer "
                "recomputed (the lowest-memory probe: what checkpointing needs). No plan can fit: "
                "use a shorter sequence, a smaller batch, or more GPUs (a smaller shard on each)"
            ) from exc
        if exc is None and self.device_limit is None:
            # No device memory to run out of (CPU): the step raised in its backward, or its
            # backward never ran. Measure the next step the same way.
            return True
        if not low_memory:
            self.mode = RECOMPUTE_PROBE
            self.todo = ["measure"]
            self.reason = ("low-memory probe: the plain probe step ran out of device memory" if exc is not None
                           else "low-memory probe: the plain probe step did not finish its backward (out of "
                                "memory there, or it raised)")
        return True

    def run(self, step_fn: Callable[[], object], where: str) -> StepProfile:
        """Run ``step_fn()`` (one whole training step) as the sequence's steps until the measured
        one is done; its profile. ``where`` names the caller in errors."""
        while True:
            current = self.next_step()
            try:
                if current is not None:
                    current.begin()
                step_fn()
            except Exception as exc:
                if current is not None:
                    current.end_forward()
                if not self.step_failed(current, exc):  # out of memory: a lower-memory probe next
                    raise RuntimeError(
                        f"{where}: the probe step raised {type(exc).__name__}: {exc}. The probe runs "
                        "the step as it is (no offload); fix the step so that it runs on its own first"
                    ) from exc
                continue
            if current is not None:
                current.end_step()
                if current.records and not current.complete():
                    raise RuntimeError(
                        f"{where}: the step ran the forward but not the whole backward; it must be "
                        "one whole training step (loss.backward() included)"
                    )
            profile = self.step_done(current)
            if profile is not None:
                return profile
