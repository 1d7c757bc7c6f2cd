"""What goes into a step (StepPlan, NewRequest) and what comes out (StepOutput, frames)."""

from __future__ import annotations

from typing import Any, Iterator

import attrs
import torch

from ..errors import PlanTypeError
from ..lifecycle import FinishReason
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


@attrs.frozen
class Frame:
    request_id: str
    index: int
    codes: torch.Tensor  # int64 [W]: the Q codes, then (a model with a payload) the payload's bits
    payload: torch.Tensor | None = None  # [*shape] in the payload's dtype (ModelSpec.payload), else None


@attrs.frozen
class FrameBatch:
    """Frames published in one step, request-major (one row per request), owned CPU copies."""

    request_ids: tuple[str, ...]
    frame_index: torch.Tensor  # int64 [N]
    codes: torch.Tensor  # int64 [N, W] (Frame.codes)
    payload: torch.Tensor | None = None  # [N, *shape] decoded from the codes' payload words (its own tensor)

    def __len__(self) -> int:
        return len(self.request_ids)

    def __iter__(self) -> Iterator[Frame]:
        for i, rid in enumerate(self.request_ids):
            yield Frame(rid, int(self.frame_index[i]), self.codes[i], None if self.payload is None else self.payload[i])

    @staticmethod
    def empty(width: int) -> "FrameBatch":
        return FrameBatch((), torch.zeros(0, dtype=torch.int64), torch.zeros(0, width, dtype=torch.int64))


@attrs.frozen
class FinishedRequest:
    request_id: str
    reason: FinishReason
    num_frames: int
    detail: str = ""  # why, for reason error (e.g. the model exception of a failed step)


@attrs.frozen
class RowOutput:
    """The step's per-row view (batch order), for adapters that need the row layout."""

    request_ids: tuple[str | None, ...]  # None for padding rows
    query_start_loc: torch.Tensor  # int64 [B + 1]
    valid: torch.Tensor  # bool [B]
    codes: torch.Tensor  # int64 [B, Q]


@attrs.frozen
class StepOutput:
    step: int
    frames: FrameBatch
    finished: tuple[FinishedRequest, ...]
    rows: RowOutput
    num_tokens: int
    preempted: tuple[str, ...] = ()  # requests preempted at this step's boundary

    @property
    def num_preempted(self) -> int:
        return len(self.preempted)


@attrs.define
class Generation:
    """What `LockstepEngine.generate` returns per request: its frames in order and how it ended."""

    request_id: str
    frames: list[Frame] = attrs.field(factory=list)
    finished: FinishedRequest | None = None

    def codes(self) -> torch.Tensor:
        """The frames' codes stacked [N, Q] (int64)."""
        if not self.frames:
            return torch.zeros(0, 0, dtype=torch.int64)
        return torch.stack([f.codes for f in self.frames])
