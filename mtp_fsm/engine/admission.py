"""Admission checks of a new request: its own fields, its prepared prompt, and the prompt cache."""

from __future__ import annotations

import weakref

from ..errors import AdmissionError
from ..model_api import ModelSpec, PreparedPrompt, TalkerModel
from ..sampling.params import MAX_COUNT, SamplingParams
from ..sampling.topp import MAX_VOCAB_FIXED
from .plan import NewRequest
from .records import RequestRecord


class Admission:
    """Decides whether a request can enter the engine; keeps each request object's
    prepared prompt (weakly: a request dropped by its client takes its prompt with it)."""

    def __init__(self, model: TalkerModel, *, deferred: bool = False) -> None:
        self.model, self.spec = model, model.spec
        self.deferred = deferred  # frames publish a step after their CB0 is sampled
        self._prepared: dict[int, tuple[weakref.ref, PreparedPrompt]] = {}  # id(request) -> (request, prompt)

    def prepare(self, req: NewRequest) -> PreparedPrompt:
        """The model's PreparedPrompt for this request object (computed once, kept until admitted)."""
        cached = self._prepared.get(id(req))
        if cached is not None and cached[0]() is req:
            return cached[1]
        try:
            prepared = self.model.prepare(req.inputs)
        except Exception as exc:  # the model rejected its inputs: reject this request only
            raise AdmissionError(req.request_id, f"inputs rejected by the model: {type(exc).__name__}: {exc}") from exc
        self._prepared[id(req)] = (weakref.ref(req), prepared)
        weakref.finalize(req, self._prepared.pop, id(req), None)
        return prepared

    def forget(self, req: NewRequest) -> None:
        self._prepared.pop(id(req), None)

    def check_new(self, req: NewRequest) -> list[str]:
        """Problems with a new request's own fields (independent of the table)."""
        problems = []
        if type(req.sampling_width) is not int or req.sampling_width != 1:
            problems.append(
                f"sampling width {req.sampling_width} is not supported: current-step MTP builds one frame "
                "per sampled CB0, so multi-token or speculative sampling would desynchronise frames"
            )
        if type(req.request_id) is not str or not req.request_id:
            problems.append(f"the request id must be a non-empty str, got {req.request_id!r}")
        if type(req.max_frames) is not int or not 1 <= req.max_frames <= MAX_COUNT:  # bool is not a frame count
            problems.append(f"max_frames must be an int in [1, {MAX_COUNT}], got {req.max_frames!r}")
        if type(req.seed) is not int or not (-(2**63) <= req.seed < 2**63):
            problems.append(f"seed must be a 64-bit int, got {req.seed!r}")
        if req.min_frames is not None and (type(req.min_frames) is not int or not 0 <= req.min_frames <= MAX_COUNT):
            problems.append(f"min_frames must be an int in [0, {MAX_COUNT}] or None (the model's default), "
                            f"got {req.min_frames!r}")
        for name in ("cb0_sampling", "mtp_sampling"):
            if not isinstance(getattr(req, name), SamplingParams):
                problems.append(f"{name} must be a mtp_fsm.sampling.SamplingParams, got {getattr(req, name)!r}")
        if problems and not all(isinstance(p, SamplingParams) for p in (req.cb0_sampling, req.mtp_sampling)):
            return problems  # the checks below read the sampling parameters
        problems += [f"cb0 sampling: {p}" for p in req.cb0_sampling.problems()]
        problems += [f"mtp sampling: {p}" for p in req.mtp_sampling.problems()]
        if req.mtp_sampling.repetition_penalty not in (None, 1.0):
            problems.append(f"mtp sampling: repetition_penalty applies to CB0 only (the engine keeps counts of "
                            f"published CB0 ids), got {req.mtp_sampling.repetition_penalty!r} for the MTP codebooks")
        cb0, mtp = sampling_of(self.spec, req)  # what the rows will really run with
        if self.deferred and (cb0.penalises or min_frames_of(self.spec, req)):
            # CB0 of frame f is sampled before frame f-1 is published: counts and frame numbers lag.
            problems.append("repetition_penalty != 1 and min_frames > 0 are not supported on a deferred "
                            "lifecycle (the previous frame is published after the next CB0 is sampled)")
        if self.spec.eos_token_id is None and self.spec.delay_pattern is None and min_frames_of(self.spec, req):
            # min_frames masks the CB0 EOS; here the stop is decided elsewhere (the MTP stage).
            problems.append(f"min_frames > 0 is not supported by {self.spec.name!r}: its stop is decided by the "
                            f"MTP stage ({self.spec.lifecycle!r}), not by a CB0 EOS that min_frames could mask")
        if self.spec.delay_pattern is not None and (cb0.penalises or min_frames_of(self.spec, req)):
            # The pattern's BOC / EOC fillers would count as repeats, and its wind-down is the stop.
            problems.append(f"repetition_penalty != 1 and min_frames > 0 are not supported by {self.spec.name!r}: "
                            "its codebooks follow a delay pattern (BOC / EOC fillers; EOC on codebook 0 "
                            "starts the wind-down that ends the request)")
        sampled = [("cb0", cb0, self.spec.backbone_vocab_size)]
        if self.spec.has_mtp:
            sampled.append(("mtp", mtp, self.spec.codebook_size))
        for name, params, vocab in sampled:
            if isinstance(params.top_p, (int, float)) and params.top_p < 1.0 and vocab > MAX_VOCAB_FIXED:
                problems.append(
                    f"{name} sampling: top_p < 1 needs a vocabulary of at most {MAX_VOCAB_FIXED} ids "
                    f"(the fixed-point top-p mass), the model's is {vocab}"
                )
        return problems

    def admissible(self, req: NewRequest) -> PreparedPrompt:
        """The prepared prompt of an admissible request; AdmissionError naming it otherwise."""
        problems = self.check_new(req)
        if problems:
            raise AdmissionError(req.request_id, "; ".join(problems))
        prepared = self.prepare(req)
        length = int(prepared.prompt_embeds.shape[0])
        if length < 1:
            raise AdmissionError(req.request_id, "the prompt is empty")
        if length >= self.spec.max_context:
            raise AdmissionError(
                req.request_id,
                f"prompt of {length} positions does not fit the context of {self.spec.max_context} "
                "(at least one position is needed to produce a frame)",
            )
        return prepared


def sampling_of(spec: ModelSpec, request) -> tuple[SamplingParams, SamplingParams]:
    """(CB0, MTP) sampling a request runs with: the model's own where it fixes them
    (spec.cb0_sampling / mtp_sampling, e.g. MOSS's audio sampling), else the request's; the
    CB0 repetition penalty resolved (None -> the model's default)."""
    cb0 = (spec.cb0_sampling or request.cb0_sampling).with_penalty(spec.repetition_penalty)
    return cb0, spec.mtp_sampling or request.mtp_sampling


def min_frames_of(spec: ModelSpec, request) -> int:
    """Frames a request publishes before CB0 EOS may be sampled (None -> the model's default)."""
    return spec.min_frames if request.min_frames is None else request.min_frames


def resolved(spec: ModelSpec, record: RequestRecord) -> tuple[SamplingParams, SamplingParams]:
    """The record's (CB0, MTP) sampling, resolved once per request (with its min_frames)."""
    if record.sampling is None:
        record.sampling = sampling_of(spec, record.request)
        record.min_frames = min_frames_of(spec, record.request)
    return record.sampling
