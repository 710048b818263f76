"""The probe step: one training step, measured per layer, that the planner plans from.

Nothing is offloaded during the probe. It runs in one of two modes (``StepProfile.probe``):

- ``"plain"``: the step as the model runs, the most exact; it needs the plain step's memory.
- ``"recompute"``, the low-memory probe: every layer runs under non-reentrant checkpointing
  (:class:`~offload.planner.instrument.CheckpointedLayer`), so it fits wherever checkpointing
  fits. What a layer saves is counted inside its checkpointed forward, its backward is timed
  without its recompute, and the plain step's figures are the cost model's prediction.

It records, per layer:
- the storage slots the layer's group would copy (the engine's own ``Group`` dedups views and
  aligns spans, and the engine's ``SelectionPolicy`` picks the tensors, so the bytes are exactly
  what an offloading step would move);
- the bytes a checkpoint of the layer would send (its tensor inputs, :mod:`offload.forwards.recompute`,
  and what was saved since the layer before, which joins its group);
- the bytes its selectively recomputed modules keep in their caches (``offload.forwards.selective``),
  which never reach the hooks;
- the same with its selective candidates (a layer's MLP) run selectively: their insides give way
  to their inputs and their GEMM outputs' cache, and their backward recomputes the rest of their
  forward (``LayerProfile.selective``, :mod:`offload.planner.instrument`);
- its forward time (events at the module's pre-hook and hook) and its backward time (from the
  moment the gradient of its output is ready to the moment the gradient of its input is).

Plus the time before the first layer, the head (after the last layer, forward and backward), the
time after layer 0's backward, the memory at forward start and the step's peak (CUDA: with what
the loop holds at the profile's making, the next step's entry, and did not at this one's, e.g.
AdamW's state made at its first step: :mod:`offload.planner.entry_base`), and the host link's
speed each way and both ways at once (:func:`measure_link`). Times come from CUDA events on the
stream each hook runs on (read once the step is over), or the host clock on CPU; the saved-tensor
hooks keep each tensor on the device as autograd would, so a plain probe step's peak is the plain
peak.
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence

import torch

from ..engine.eager import run_eagerly, saved_tensors_hooks
from ..engine.step import first_grad_tensor
from ..engine.packing import keep_handle, unpack_kept
from ..engine.policy import SelectionPolicy
from ..forwards.recompute import SavedSize, checkpoint_input_sizes, checkpoint_inputs, saved_size
from ..forwards.selective import always_selective
from .calibration import RecomputeReading, recompute_factors
from .entry_base import grads_held, rebased
from .timeline import Clock, Meter
from .instrument import CandidateForward, CheckpointedLayer, ExpensiveOutputs, FixedSelectiveInside
from .scaling import predict_plain
from .shapes import StepShape, shape_of, size_exponents
from .tally import AttentionTimer, SlotTally, spans_ms, under_floor
from .types import PLAIN_PROBE, PROBES, RECOMPUTE_PROBE, LayerProfile, LinkProfile, SelectiveProfile, \
    StepProfile


class _LayerRecord:
    __slots__ = (
        "index", "tally", "input_sizes", "fwd_start", "fwd_end", "bwd_start", "bwd_end",
        "mem_start", "mem_end", "forward_peak", "mem_bwd_start", "backward_peak", "module",
        "new_grads", "cached", "selective_tally", "selective_cached",
        "candidate_spans", "has_candidates", "rec_start", "rec_end", "attention", "before",
    )

    def __init__(self, index: int, retain: bool = False) -> None:
        self.index = index
        # The tallies only count: they lay the saved tensors out into slots, whose sizes are
        # kept when the layer's forward ends. A plain step keeps its saved tensors alive
        # anyway, so their groups hold none (``retain=False``); inside a checkpointed layer the
        # tensors die as soon as they are saved, and a freed address reused would merge two
        # slots, so there they hold them until the layer's end (``retain``).
        self.tally = SlotTally(index, retain)
        # The same with the layer's selective candidates run selectively.
        self.selective_tally = SlotTally(index, retain)
        self.selective_cached = 0
        # SDPA calls' (forward spans, backward spans), see offload.planner.tally.
        self.attention: tuple[list[Any], list[Any]] = ([], [])
        self.has_candidates = False
        # (start, end, [(start, end) of each GEMM inside]) per candidate call.
        self.candidate_spans: list[tuple[Any, Any, list[tuple[Any, Any]]]] = []
        self.module: Optional[torch.nn.Module] = None
        self.new_grads = 0  # bytes of its weights that require grad and have none yet
        self.cached = 0     # bytes its selectively recomputed modules cached (offload.forwards.selective)
        self.rec_start = self.rec_end = None  # its recompute in backward (low-memory probe)
        # Allocated bytes at its start and end, its peak above the start; the same in backward. 0 on CPU.
        self.mem_start = self.mem_end = self.forward_peak = 0
        self.mem_bwd_start = self.backward_peak = 0
        self.input_sizes: list[tuple[int, tuple[int, ...]]] = []  # a checkpoint's inputs
        self.before: list[SavedSize] = []  # saved since the layer before: they join its group
        self.fwd_start: Any = None
        self.fwd_end: Any = None
        self.bwd_start: Any = None  # gradient of the layer's output ready
        self.bwd_end: Any = None    # gradient of the layer's input ready


class ProbeStep:
    """Records one step over ``layers``; call :meth:`begin` before its forward, :meth:`end_forward`
    after it and :meth:`end_step` after its backward, then :meth:`profile`.

    ``policy`` selects the tensors exactly as the engine would (parameters, marks, sizes).
    ``mode``: ``"plain"`` or ``"recompute"`` (the low-memory probe, see the module notes).
    ``candidates``: the modules (inside ``layers``) a plan may run under selective recompute.
    """

    def __init__(
        self,
        layers: Sequence[torch.nn.Module],
        policy: SelectionPolicy,
        device: torch.device,
        *,
        calibrate_recompute: bool = False,
        mode: str = PLAIN_PROBE,
        candidates: Sequence[torch.nn.Module] = (),
    ) -> None:
        if mode not in PROBES:
            raise ValueError(f"offload: probe mode must be one of {PROBES}, got {mode!r}")
        self.layers = list(layers)
        self.mode = mode
        self.candidates = list(dict.fromkeys(candidates))
        # Calibration: one layer (in the middle, called once) runs under checkpointing, so that its
        # backward peak and time with recompute are measured (:meth:`recompute_peak`); a recompute
        # probe measures every layer's, and its middle one's calibrates a plain profile as well.
        self.calibrating = calibrate_recompute and mode == PLAIN_PROBE
        self.recompute_index: Optional[int] = None
        if self.calibrating or mode == RECOMPUTE_PROBE:
            middle = len(self.layers) // 2
            if self.layers.count(self.layers[middle]) == 1:
                self.recompute_index = middle
        self._wrappers: list[Any] = []
        self.policy = policy
        self.device = device
        self.clock = Clock(device)
        self.records: list[_LayerRecord] = []
        self._open: Optional[_LayerRecord] = None
        self._pending: Optional[_LayerRecord] = None
        self._handles: list[Any] = []
        self._saved_hooks = saved_tensors_hooks(self._pack, self._unpack)
        self.step_start: Any = None
        self.forward_end: Any = None
        self.step_end: Any = None
        self.base_bytes = 0
        self.entry_bytes, self.entry_grads = 0, False  # allocated, and gradients held, when the step began
        self.meter = Meter(device)
        self.shape: Optional[StepShape] = None  # the batch shape, read at the first layer
        self.hidden_size: Optional[int] = None
        self.attention = AttentionTimer(self._attention_spans, self.clock.mark)
        self.head_peak = 0          # peak from the last layer's end to backward reaching it
        self.head_residual = 0      # what the head left allocated when backward reached it
        self.backward_started = False
        self.backward_running: Optional[_LayerRecord] = None  # whose backward segment is open
        self.inside: Optional[str] = None  # "candidate" / "fixed" while such a module runs
        # ``active``: the probe's hooks and wrappers are in force (a low-memory probe's layers
        # run checkpointed). ``recording``: what runs is measured; it stops at the end of the
        # first forward's backward when the step runs several (micro-batches, see _next_forward).
        self.active = False
        self.recording = False

    # -- the forward -------------------------------------------------------------------------------
    def begin(self) -> None:
        """Start the step: hooks on, clocks and the device's peak counter reset."""
        self.meter.segment()
        self.meter.peak = 0
        self.entry_bytes, self.entry_grads = self.meter.now(), grads_held(self.layers)
        # Set before the call: Module.__call__ reads ``forward`` before its pre-hooks run.
        # Innermost first: the selective candidates (and the modules selective already), then
        # the layers' checkpoints around them; removed in the opposite order.
        for module in {m: None for layer in self.layers for m in layer.modules() if always_selective(m)}:
            self._wrappers.append(FixedSelectiveInside(self, module.__dict__["forward"]))
        for module in self.candidates:
            if not always_selective(module):
                self._wrappers.append(CandidateForward(self, module))
        if self.mode == RECOMPUTE_PROBE:
            for module in dict.fromkeys(self.layers):
                self._wrappers.append(CheckpointedLayer(self, module))
        elif self.recompute_index is not None:
            self._wrappers.append(CheckpointedLayer(self, self.layers[self.recompute_index], timed=False))
        self.step_start = self.clock.mark()
        for module in dict.fromkeys(self.layers):
            # with_kwargs: a layer called by keyword (layer(hidden_states=h)) has its inputs
            # there, and a checkpoint of it saves them (offload.forwards.recompute).
            self._handles.append(module.register_forward_pre_hook(_ProbeHook(self, after=False), with_kwargs=True))
            self._handles.append(module.register_forward_hook(_ProbeHook(self, after=True)))
        self._saved_hooks.__enter__()
        self.attention.install()
        self.active = True
        self.recording = True

    def end_forward(self) -> None:
        """The forward is over (the backward may follow outside)."""
        if not self.active:
            return
        self.active = False
        self.recording = False
        self.attention.remove()
        self._saved_hooks.__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for wrapper in reversed(self._wrappers):
            wrapper.remove()
        self._wrappers.clear()
        self.inside = None
        self.forward_end = self.clock.mark()
        for record in self.records + ([self._pending] if self._pending is not None else []):
            self._close_groups(record)
        self._pending = None
        self._open = None

    def end_step(self) -> None:
        """The whole step, backward included, is over."""
        self.end_forward()
        if self.step_end is None:  # (else the step's first forward and backward ended earlier)
            self._end_measured_step()
        if self.clock.cuda:
            torch.cuda.synchronize(self.device)

    def _end_measured_step(self) -> None:
        self.step_end = self.clock.mark()
        running, self.backward_running = self.backward_running, None
        peak = self.meter.segment()
        if running is not None:  # layer 0's input needed no gradient: its backward ran to here
            running.backward_peak = max(0, peak - running.mem_bwd_start)

    def _next_forward(self) -> None:
        # The layers run once more than listed: a step of several micro-batches (gradient
        # accumulation) begins its next forward. A plan is made per forward, as
        # OffloadActivations is entered once per micro-batch, so the first micro-batch, forward
        # and backward, is the measured step; the rest of the step runs as the probe runs it
        # (checkpointed in a low-memory probe) but is not measured.
        if not all(r.bwd_start is not None for r in self.records):
            raise RuntimeError(
                f"offload: the probe saw the {len(self.layers)} given layers run again before the "
                "backward of their first run: either the step runs several forwards before their "
                "backwards (plan with a step that runs one micro-batch, forward and backward), "
                "or the forward calls a module more often than it is listed (list a module once "
                "per call, in call order)"
            )
        self.recording = False
        self._end_measured_step()

    def complete(self) -> bool:
        """Whether every layer's forward and backward ran (not in a step that raised, or no backward)."""
        return bool(self.records) and self.step_end is not None and all(r.bwd_start is not None for r in self.records)

    @staticmethod
    def _close_groups(record: _LayerRecord) -> None:
        # Keep the slot sizes, let the groups (and what a retaining group holds) go.
        record.tally.close()
        record.selective_tally.close()

    def _passive(self) -> bool:
        return torch._C._current_graph_task_id() != -1  # a checkpoint recomputing in backward

    def _before(self, args: Any, kwargs: Any) -> None:
        if not self.recording or self._passive():
            return
        index = len(self.records)
        if index == len(self.layers) and self._open is None:
            self._next_forward()
            return
        record = self._pending if self._pending is not None else self._new_record(index)
        self._pending = None
        self.meter.segment()
        record.mem_start = self.meter.now()
        if index == 0:
            self.base_bytes = record.mem_start
        record.input_sizes, record.before = checkpoint_input_sizes(args, kwargs, record.before), []
        if index == 0:
            # The step's batch shape, from the hidden states (offload.planner.shapes).
            hidden = next(iter(checkpoint_inputs(args, kwargs)), None)
            self.shape = shape_of(hidden.shape) if hidden is not None and hidden.dim() >= 2 else None
            self.hidden_size = int(hidden.shape[-1]) if self.shape is not None else None
        record.fwd_start = self.clock.mark()
        grad_input = first_grad_tensor(args)
        if grad_input is not None:
            grad_input.register_hook(_Mark(self, record, "bwd_end"))
        self.records.append(record)
        self._open = record

    def _new_record(self, index: int) -> _LayerRecord:
        return _LayerRecord(index, retain=self.mode == RECOMPUTE_PROBE)

    def _after(self, module: torch.nn.Module, output: Any) -> None:
        record = self._open
        if record is None or not self.recording or self._passive():
            return
        self._open = None
        record.fwd_end = self.clock.mark()
        record.module = module
        record.new_grads = sum(p.nbytes for p in module.parameters() if p.requires_grad and p.grad is None)
        record.forward_peak = max(0, self.meter.segment() - record.mem_start)
        # In a recompute probe the groups hold the layer's saved tensors until here.
        self._close_groups(record)
        record.mem_end = self.meter.now()
        grad_output = first_grad_tensor(output)
        if grad_output is not None:
            grad_output.register_hook(_Mark(self, record, "bwd_start"))

    def _attention_spans(self) -> Optional[tuple[list[Any], list[Any]]]:
        # Where an SDPA call's spans go: the layer being recorded, not a recompute in backward.
        record = self._open
        if record is None or not self.recording or self._passive():
            return None
        return record.attention

    def _record_now(self) -> _LayerRecord:
        record = self._open
        if record is None:
            # Between layers: the next layer's, as in the engine (a checkpoint around __call__ saves its inputs there).
            if self._pending is None:
                self._pending = self._new_record(len(self.records))
            record = self._pending
        return record

    def count_saved(self, t: torch.Tensor, record: Optional[_LayerRecord] = None) -> None:
        """File a tensor the layer (``record``, default the one running) saves for backward: in
        its plain slots unless a module made selective by the user saved it (its inputs stand for
        it), and in its selective slots unless any candidate saved it."""
        small = under_floor(self.policy, t) if self.recording else None
        if small is None:
            return
        if record is None:
            record = self._record_now()
        if self.inside != "fixed":
            record.tally.add(t, small)
        if self.inside is None:
            record.selective_tally.add(t, small)

    def _pack(self, t: torch.Tensor) -> Any:
        # In a recompute probe, what reaches these hooks inside a layer is its checkpoint's
        # inputs (its own tensors are counted inside the checkpoint: CountingPack). Never the
        # tensor itself here, nor in ``before``: it may be the saving node's own output, and a
        # reference would keep a failed probe step's graph alive (see offload.engine.packing).
        if not self.recording:
            return keep_handle(t, len(self.records))
        record = self._record_now()
        if self.mode == PLAIN_PROBE or self._open is None:
            self.count_saved(t, record)
        if self._open is None:
            record.before.append(saved_size(t))
        return keep_handle(t, record.index)

    @staticmethod
    def _unpack(handle: tuple[torch.Tensor, int, int]) -> torch.Tensor:
        return unpack_kept(handle)

    def run_candidate(self, fn: Callable[..., Any], fixed: bool, args: Any, kwargs: Any) -> Any:
        """Run a selective candidate (``fixed``: one the user made selective) and file what it
        saves, its inputs and its GEMM outputs (see :mod:`offload.planner.instrument`)."""
        if not self.recording or self._passive() or self._open is None or self.inside is not None \
                or not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        record = self._open
        record.has_candidates |= not fixed
        # What a selective checkpoint saves through the hooks: its tensor inputs.
        for a in checkpoint_inputs(args, kwargs):
            small = under_floor(self.policy, a)
            if small is not None:
                if fixed:
                    record.tally.add(a, small)
                record.selective_tally.add(a, small)
        self.inside = "fixed" if fixed else "candidate"
        counter = ExpensiveOutputs(self.clock.mark)
        start = self.clock.mark()
        try:
            with counter:
                out = fn(*args, **kwargs)
        finally:
            self.inside = None
        if not fixed:
            record.candidate_spans.append((start, self.clock.mark(), counter.spans))
        record.selective_cached += counter.nbytes
        if fixed:
            record.cached += counter.nbytes
        return out

    def mark_recompute(self, start: bool) -> None:
        """A checkpointed layer's recompute starts or ends (in backward, recompute probes)."""
        record = self.backward_running
        if record is not None:
            if start:
                record.rec_start = self.clock.mark()
            else:
                record.rec_end = self.clock.mark()

    # -- the result --------------------------------------------------------------------------------
    def _grad_bytes(self) -> list[int]:
        # Weight gradients a layer's backward allocates: its parameters that require grad and
        # had none at its forward (with gradient accumulation they exist already and cost
        # nothing new). A module called several times allocates them in the backward of its
        # last call, which backward reaches first.
        out = [0] * len(self.records)
        seen: set[int] = set()
        for i in range(len(self.records) - 1, -1, -1):
            module = self.records[i].module
            if module is not None and id(module) not in seen:
                seen.add(id(module))
                out[i] = self.records[i].new_grads
        return out

    def recompute_peak(self) -> Optional[RecomputeReading]:
        """Its calibration layer's backward with recompute (peak and time), from a calibration
        step or a low-memory one, with the layer's forward and saved bytes in the same step and
        the step's shape (what :func:`recompute_factors` scales by); None where none was measured."""
        i = self.recompute_index
        if i is None or i >= len(self.records) or not self.clock.cuda:
            return None
        r = self.records[i]
        end = r.bwd_end if r.bwd_end is not None else self.step_end
        ms = self.clock.ms
        return RecomputeReading(i, r.backward_peak, ms(r.bwd_start, end) if r.bwd_start is not None else 0.0,
                                ms(r.fwd_start, r.fwd_end) if r.fwd_end is not None else 0.0,
                                sum(r.tally.sizes) + r.cached, self.shape)

    def _measured_gradients(self, layers: list[LayerProfile]) -> Optional[tuple[int, list[int]]]:
        # What backward holds besides the activations when layer i's backward begins (the
        # head's leftovers, the weight gradients made so far, the gradient flowing in), read
        # off the allocator: G_i = allocated - base - saved bytes of layers 0..i. Returns
        # (G of the last layer, the growth of G across each layer's backward).
        records = self.records
        if not self.clock.cuda or any(r.bwd_start is None for r in records):
            return None
        held, g = 0, []
        for r, layer in zip(records, layers):
            held += self._held_until_backward(layer)
            g.append(max(0, r.mem_bwd_start - self.base_bytes - held))
        growth = [max(0, g[i - 1] - g[i]) for i in range(1, len(g))]
        return g[-1], [layers[0].grad_bytes] + growth

    def _held_until_backward(self, layer: LayerProfile) -> int:
        # What the probe step itself held of the layer from its forward to its backward: what it
        # saved, or, checkpointed, its inputs.
        if self.mode == RECOMPUTE_PROBE:
            return layer.input_bytes
        return layer.saved_bytes + layer.cached_bytes

    def _selective_profile(self, r: _LayerRecord) -> Optional[SelectiveProfile]:
        if not r.has_candidates:
            return None
        ms = self.clock.ms
        # The candidates' forward less their GEMMs: what their backward recomputes.
        extra = sum(max(0.0, ms(start, end) - sum(ms(a, b) for a, b in gemms))
                    for start, end, gemms in r.candidate_spans)
        tally = r.selective_tally
        return SelectiveProfile(**tally.fields(self.shape, self.hidden_size), cached_bytes=r.selective_cached,
                                extra_backward_ms=extra, forward_ms=sum(ms(start, end) for start, end, _ in r.candidate_spans))

    def profile(self, link: LinkProfile, plain_step_ms: Optional[float] = None,
                recompute_peak: Optional[RecomputeReading] = None) -> StepProfile:
        """The measured step as a :class:`StepProfile` (call after :meth:`end_step`)."""
        if not self.records:
            raise ValueError(
                "offload: the probe step ran none of the given layers; pass the modules the "
                "forward really calls (e.g. model.model.layers)"
            )
        ms = self.clock.ms
        records = self.records
        # On the host nothing but the activations is accounted (no allocator to measure the
        # rest against), so gradients are left out there too.
        grads = self._grad_bytes() if self.clock.cuda else [0] * len(records)
        layers = []
        shape = self.shape
        for r in records:
            slots = r.tally.sizes
            input_bytes = sum(n for n, _ in r.input_sizes)
            # Layer 0's input gradient may not exist (token ids): its backward then runs until
            # the end of the step's backward, which post_ms then does not double count.
            bwd_end = r.bwd_end if r.bwd_end is not None else self.step_end
            signature = f"{len(slots)}:{sum(slots)}:{input_bytes}"
            backward_ms = ms(r.bwd_start, bwd_end) if r.bwd_start is not None else 0.0
            backward_peak = r.backward_peak
            if self.mode == RECOMPUTE_PROBE:
                # Measured with the recompute inside: take it out, so that the profile says
                # what a kept layer's backward costs (a recompute plan adds it back, with a
                # time and memory factor of 1: this is what it measured).
                backward_ms = max(0.0, backward_ms - ms(r.rec_start, r.rec_end))
                backward_peak = max(0, backward_peak - sum(slots) - r.cached)
            layers.append(LayerProfile(
                **r.tally.fields(shape, self.hidden_size),
                input_bytes=input_bytes,
                forward_ms=ms(r.fwd_start, r.fwd_end),
                backward_ms=backward_ms,
                signature=signature,
                forward_peak_bytes=r.forward_peak,
                backward_peak_bytes=backward_peak,
                grad_bytes=grads[len(layers)],
                cached_bytes=r.cached,
                selective=self._selective_profile(r),
                input_terms=tuple((n, *size_exponents(size, shape, self.hidden_size)) for n, size in r.input_sizes)
                if shape is not None else (),
                attention_forward_ms=spans_ms(r.attention[0], ms),
                attention_backward_ms=spans_ms(r.attention[1], ms),
                attention_bytes=sum(span[2] for span in r.attention[0]),
            ))
        first, last = records[0], records[-1]
        step_ms = ms(self.step_start, self.step_end)
        pre_ms = ms(self.step_start, first.fwd_start)
        # The head: from the last layer's end to the gradient of its output (its forward, the
        # loss, and their backward).
        head_ms = ms(last.fwd_end, last.bwd_start) if last.bwd_start is not None else 0.0
        post_ms = ms(first.bwd_end, self.step_end) if first.bwd_end is not None else 0.0
        head_residual = self.head_residual
        measured = self._measured_gradients(layers)
        if measured is not None:
            head_residual, growth = measured
            layers = [replace(l, grad_bytes=g) for l, g in zip(layers, growth)]
        factor = time_factor = 1.0
        if recompute_peak is not None and recompute_peak[0] < len(layers) and self.mode == PLAIN_PROBE:
            factor, time_factor = recompute_factors(layers[recompute_peak[0]], recompute_peak, self.shape)
        saved = sum(self._held_until_backward(l) for l in layers)
        if self.clock.cuda:
            base, peak, head_peak = self.base_bytes, self.meter.peak, self.head_peak
        else:
            # No allocator to ask on the host: plan on the activations alone.
            base, peak, head_peak = 0, max(1, saved), saved
        profile = StepProfile(
            layers=tuple(layers),
            link=link,
            base_bytes=base,
            # The head's own peak, measured from the last layer's end to backward reaching it
            # (not the step's peak, which may come in backward or from first-use workspaces).
            head_bytes=max(0, head_peak - base - saved),
            head_residual_bytes=head_residual,
            recompute_factor=factor,
            recompute_time_factor=time_factor,
            pre_ms=pre_ms,
            head_ms=head_ms,
            post_ms=post_ms,
            plain_step_ms=plain_step_ms if plain_step_ms is not None else max(step_ms, 1e-6),
            plain_peak_bytes=peak,
            device="cuda" if self.clock.cuda else "cpu",
            probe=self.mode,
            shape=(shape.batch, shape.length) if shape is not None else None,
            offload_floor_bytes=self.policy.min_offload_bytes,
        )
        if self.mode == RECOMPUTE_PROBE:
            profile = predict_plain(profile)
        # Made at the next step's entry (offload.plan: after the step); see the module notes.
        return rebased(profile, self.meter.now() - self.entry_bytes,
                       self.clock.cuda and not self.entry_grads and grads_held(self.layers))


class _ProbeHook:
    """A layer's forward pre-hook (``after=False``, registered with kwargs) or forward hook.
    Weak, like :class:`_Mark`; run eagerly (:mod:`offload.engine.eager`): in a compiled model it is a
    graph break, and the layer between two of them is compiled on its own, so the probe measures
    the compiled layers."""

    __slots__ = ("probe", "after")

    def __init__(self, probe: ProbeStep, after: bool) -> None:
        self.probe, self.after = weakref.ref(probe), after

    @run_eagerly
    def __call__(self, module: torch.nn.Module, args: Any, third: Any) -> None:
        probe = self.probe()
        if probe is not None:
            if self.after:
                probe._after(module, third)  # third: the output
            else:
                probe._before(args, third)   # third: the keyword arguments


class _Mark:
    """Gradient hook on a layer's output (``bwd_start``: its backward begins) or input
    (``bwd_end``: it is over) that stamps the time and the memory (runs in backward).

    It holds a weak reference to the probe: a hook kept alive by a tensor that the caller
    holds on to must not keep the probe's records alive with it."""

    __slots__ = ("probe", "record", "field")

    def __init__(self, probe: ProbeStep, record: _LayerRecord, field: str) -> None:
        self.probe, self.record, self.field = weakref.ref(probe), record, field

    @run_eagerly
    def __call__(self, grad: torch.Tensor) -> None:
        probe, record = self.probe(), self.record
        if probe is None or getattr(record, self.field) is not None:
            return
        setattr(record, self.field, probe.clock.mark())
        meter = probe.meter
        # Layer i's input is layer i-1's output, so "i's backward is over" and "i-1's begins"
        # are often the same gradient: whichever hook runs first closes i's memory segment.
        running = probe.backward_running
        if running is not None and (self.field == "bwd_start" or running is record):
            running.backward_peak = max(0, meter.segment() - running.mem_bwd_start)
            probe.backward_running = None
        if self.field == "bwd_start":
            peak = meter.segment() if running is None else 0
            if not probe.backward_started:  # the head (and the loss) ran since the last layer
                probe.backward_started = True
                last = probe.records[-1]
                probe.head_peak = peak
                probe.head_residual = max(0, meter.now() - last.mem_end)
            record.mem_bwd_start = meter.now()
            probe.backward_running = record
