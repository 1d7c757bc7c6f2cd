"""Request definitions, alone-run results, and `run_alone`: a request alone in a fresh one-slot engine."""

from __future__ import annotations

from typing import Any, Callable

import attrs
import torch

from .._util.threads import torch_threads  # noqa: F401  (re-exported: tests import it from here)
from ..engine import LockstepEngine, NewRequest, SchedulingPolicy
from ..lifecycle import FinishReason
from ..model_api import FrameDraws, TalkerModel
from ..sampling import SamplingParams
from .delay_check import delay_pattern_problems
from .scripted import ScriptedTalker, ScriptInputs

ModelFactory = Callable[[], TalkerModel]


def scripted_mtp() -> ScriptedTalker:
    """The default model: a 4-codebook scripted talker with an MTP stage, float64."""
    return ScriptedTalker(dtype=torch.float64)


def scripted_mtp_stop() -> ScriptedTalker:
    """The 4-codebook scripted talker whose MTP hook decides the stop (variant mtp_stop)."""
    return ScriptedTalker(dtype=torch.float64, variant="mtp_stop")


def scripted_mtp_stop_deferred() -> ScriptedTalker:
    """scripted_mtp_stop on the deferred schedule (variant mtp_stop_deferred)."""
    return ScriptedTalker(dtype=torch.float64, variant="mtp_stop_deferred")


def scripted_conditioned() -> ScriptedTalker:
    """The 4-codebook scripted talker whose text step reads a conditioning feed (variant conditioned)."""
    return ScriptedTalker(dtype=torch.float64, variant="conditioned")


def scripted_delay() -> ScriptedTalker:
    """A 4-codebook scripted talker whose codebooks follow a delay pattern (variant delay_pattern)."""
    return ScriptedTalker(dtype=torch.float64, variant="delay_pattern")


def scripted_stop_head() -> ScriptedTalker:
    """A scripted talker whose frame is CB0 plus a float payload; the stop frame is published
    (variant stop_head, VoxCPM2's lifecycle)."""
    return ScriptedTalker(dtype=torch.float64, variant="stop_head")


def scripted_single() -> ScriptedTalker:
    """A single-codebook scripted talker (no MTP stage), float64."""
    return ScriptedTalker(num_codebooks=1, dtype=torch.float64)


@attrs.frozen
class RequestDef:
    """Everything that determines a request's output (hashable: the reference cache key)."""

    inputs: Any
    max_frames: int
    seed: int = 0
    cb0: SamplingParams = SamplingParams()
    mtp: SamplingParams = SamplingParams()
    min_frames: int | None = None

    def new_request(self, request_id: str, **overrides) -> NewRequest:
        fields = dict(inputs=self.inputs, max_frames=self.max_frames, seed=self.seed,
                      cb0_sampling=self.cb0, mtp_sampling=self.mtp, min_frames=self.min_frames)
        return NewRequest(request_id, **{**fields, **overrides})

    @staticmethod
    def of(req: NewRequest) -> "RequestDef":
        return RequestDef(req.inputs, req.max_frames, req.seed, req.cb0_sampling, req.mtp_sampling, req.min_frames)


@attrs.frozen
class AloneRun:
    """A request run alone (max_slots=1, full prefill then decode): the ground truth."""

    frames: tuple[tuple[int, ...], ...]
    reason: FinishReason
    error_kind: str | None  # "cb0" (a faulty CB0 sample) or "mtp" when reason is ERROR
    detail: str = ""  # the finish detail of an ERROR ending (which codebook, what value)


def _faulty(logits: torch.Tensor) -> bool:
    """NaN or +inf anywhere (-inf is a mask, not a fault)."""
    logits = logits.float()
    return bool(torch.isnan(logits).any() or (logits == float("inf")).any())


def run_alone(model_factory: ModelFactory, definition: RequestDef, **engine_kwargs) -> AloneRun:
    """The request alone in a fresh one-slot engine, whole prompt in one step (the engine's
    side of the engine-vs-interpreter comparisons)."""
    model = model_factory()
    bad = {"cb0": False, "mtp": False}
    cb0_logits, mtp = model.cb0_logits, getattr(model, "mtp", None)

    def probe_cb0(hidden):  # which stage saw the faulty row (one row: no ambiguity)
        logits = cb0_logits(hidden)
        bad["cb0"] = _faulty(logits)
        return logits

    def probe_mtp(hidden, cb0, sample):
        bad["mtp"] = False

        def probed(logits, codebook):
            bad["mtp"] |= _faulty(logits)
            return sample(logits, codebook)

        if isinstance(sample, FrameDraws):  # a payload model: a non-finite payload is the MTP fault
            out = mtp(hidden, cb0, FrameDraws(probed, sample.normal, sample.previous))
            bad["mtp"] |= not bool(torch.isfinite(out).all())
            return out
        return mtp(hidden, cb0, probed)

    model.cb0_logits = probe_cb0
    if model.spec.has_mtp:
        model.mtp = probe_mtp
    engine_kwargs = {k: v for k, v in engine_kwargs.items() if k != "max_slots"}
    whole_prompt = SchedulingPolicy(token_budget=model.spec.max_context, prefill_chunk=model.spec.max_context)
    engine = LockstepEngine(model, 1, policy=whole_prompt, **engine_kwargs)
    result = engine.generate([definition.new_request("alone")])["alone"]
    indices = [f.index for f in result.frames]
    assert indices == list(range(len(indices))), f"alone run published frames {indices}"
    done = result.finished
    kind = ("cb0" if bad["cb0"] else "mtp") if done.reason is FinishReason.ERROR else None
    run = AloneRun(tuple(tuple(int(c) for c in f.codes) for f in result.frames), done.reason, kind, done.detail)
    if isinstance(definition.inputs, ScriptInputs):
        check_script(definition, run, model.spec)
    return run



def check_script(definition: RequestDef, run: AloneRun, spec) -> None:
    """The alone run is itself an engine run: hold it to the script, so an engine that
    ignored a forced EOS or NaN everywhere would not agree with itself unnoticed."""
    inputs = definition.inputs
    if spec.delay_pattern is not None:
        _check_delay_script(inputs, run, spec)
        return
    stop_in_mtp = spec.lifecycle in ("mtp_stop", "mtp_stop_deferred")
    min_frames = spec.min_frames if definition.min_frames is None else definition.min_frames
    # A forced EOS before min_frames is masked: the script's other logits stay finite, so
    # the request simply goes on.
    eos_at = inputs.eos_at if inputs.eos_at is not None and inputs.eos_at >= min_frames else None

    stop_head = spec.lifecycle == "stop_head"  # an EOS frame still runs its MTP stage, then publishes

    def forced(f: int) -> str | None:
        if eos_at == f and stop_head:
            return "mtp" if f in (inputs.nan_at, inputs.mtp_nan_at) else "eos"
        if eos_at == f and not stop_in_mtp:
            return "eos"  # forced EOS logits are finite even where the hidden state is NaN
        if inputs.eos_at == f and not stop_in_mtp:  # forced but masked: CB0 is finite, a NaN reaches MTP
            return "mtp" if spec.has_mtp and f in (inputs.nan_at, inputs.mtp_nan_at) else None
        if inputs.nan_at == f:
            return "cb0"
        if spec.has_mtp and inputs.mtp_nan_at == f:
            return "mtp"  # under mtp_stop a faulty MTP sample also beats the stop
        return "eos" if eos_at == f else None

    n = len(run.frames)
    if stop_head and run.reason is FinishReason.EOS:
        n -= 1  # the stop frame itself is published: the forced event is its index
    early = [f for f in range(n) if forced(f)]
    end = forced(n)
    if run.reason is FinishReason.EOS:
        # A natural EOS is sampled before the MTP stage (which a stop head's EOS frame still runs).
        ok = end in ((None, "eos") if stop_head else (None, "eos", "mtp"))
    elif run.reason is FinishReason.ERROR:
        ok = end == run.error_kind
    else:
        ok = True
    assert not early and ok, f"alone run of {inputs} ended {run.reason.label}/{run.error_kind} after {n} frames"


def _check_delay_script(inputs: ScriptInputs, run: AloneRun, spec) -> None:
    """A delay-pattern run: the pattern holds, no fault was skipped, and a forced EOC (eos_at)
    starts the wind-down by that frame at the latest."""
    problems = delay_pattern_problems(run.frames, spec.delay_pattern, run.reason)
    n = len(run.frames)
    faults = [(f, "cb0") for f in (inputs.nan_at,) if f is not None] + \
        [(f, "mtp") for f in (inputs.mtp_nan_at,) if f is not None]
    first_fault = min(faults, default=None)
    if first_fault is not None and first_fault[0] < n:
        problems.append(f"the {first_fault[1]} fault at frame {first_fault[0]} was not reported")
    if run.reason is FinishReason.ERROR and (first_fault is None or first_fault[0] != n):
        problems.append(f"ended with an error after {n} frames but the script faults at {first_fault}")
    eoc_at = next((f for f, codes in enumerate(run.frames) if codes[0] == spec.delay_pattern.eoc), None)
    if inputs.eos_at is not None and inputs.eos_at < n and (eoc_at is None or eoc_at > inputs.eos_at):
        problems.append(f"EOC forced at frame {inputs.eos_at} but codebook 0 first holds it at {eoc_at}")
    assert not problems, f"alone run of {inputs} ({run.reason.label}, {n} frames): {problems}"
