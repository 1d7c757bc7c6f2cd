"""What goes into a step: the requests to admit (NewRequest) and the host's plan (StepPlan, Span)."""

from __future__ import annotations

from typing import Any

import attrs

from ..errors import PlanTypeError
from ..sampling import SamplingParams


@attrs.frozen
class NewRequest:
    """A request to admit. `inputs` is model-specific (e.g. models.qwen3_tts.TTSInputs)."""

    request_id: str
    inputs: Any
    max_frames: int
    seed: int = 0
    cb0_sampling: SamplingParams = SamplingParams()
    mtp_sampling: SamplingParams = SamplingParams()
    sampling_width: int = 1  # tokens sampled per step; anything but 1 is rejected
    # CB0 EOS is masked until this many frames are published (HF min_new_tokens); None takes
    # the model's default (ModelSpec.min_frames; Qwen3-TTS: 2, like the official generate).
    min_frames: int | None = None


@attrs.frozen
class Span:
    """One scheduled row: `num_tokens` prompt tokens (prefill chunk) or 1 (decode)."""

    request_id: str
    num_tokens: int


def _sequence_of(*kinds: type, what: str):
    """Validator: a tuple (lists are converted first) whose members are `kinds`; a bare string
    is refused, so `aborts="req-1"` cannot become five one-character ids."""

    def check(_, attribute, value) -> None:
        if not isinstance(value, tuple):
            raise PlanTypeError(f"StepPlan.{attribute.name} must be a sequence of {what}, got {type(value).__name__} "
                            f"{value!r}")
        for member in value:
            if not isinstance(member, kinds):
                raise PlanTypeError(f"StepPlan.{attribute.name} holds {member!r} ({type(member).__name__}); "
                                f"expected {what}")

    return check


def _as_tuple(value):
    return tuple(value) if isinstance(value, list) else value


def _ids():
    return attrs.field(default=(), converter=_as_tuple, validator=_sequence_of(str, what="request ids (str)"))


@attrs.frozen
class StepPlan:
    """Everything the host decided for one step, applied in this order at the boundary:
    releases, aborts, preempts, then resumes and new requests, then the rows.

    rows: scheduled spans in batch-row order; None is a padding row (inert). Row order is
    arbitrary and must not change any result. Fields take tuples (or lists); members are
    type-checked at construction.
    """

    new_requests: tuple[NewRequest, ...] = attrs.field(
        default=(), converter=_as_tuple, validator=_sequence_of(NewRequest, what="NewRequest"))
    rows: tuple[Span | None, ...] = attrs.field(
        default=(), converter=_as_tuple, validator=_sequence_of(Span, type(None), what="Span or None (padding)"))
    aborts: tuple[str, ...] = _ids()
    preempts: tuple[str, ...] = _ids()
    resumes: tuple[str, ...] = _ids()
    releases: tuple[str, ...] = _ids()

    @property
    def has_events(self) -> bool:
        """Any host event (release, abort, preempt, resume, admission) at this boundary."""
        return bool(self.releases or self.aborts or self.preempts or self.resumes or self.new_requests)

    @staticmethod
    def of(rows: dict[str, int] | None = None, **kwargs) -> "StepPlan":
        """Convenience: StepPlan.of({"a": 8, "b": 1}, new_requests=(...,))."""
        spans = tuple(Span(rid, n) for rid, n in (rows or {}).items())
        return StepPlan(rows=spans, **{k: tuple(v) for k, v in kwargs.items()})


# What comes out of a step (their own module; re-exported where callers have always found them).
from .outputs import FinishedRequest, Frame, FrameBatch, Generation, RowOutput, StepOutput  # noqa: E402,F401
