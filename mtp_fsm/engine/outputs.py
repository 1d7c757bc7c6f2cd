"""What comes out of a step: published frames, finished requests, the per-row view, and what
`LockstepEngine.generate` returns per request."""

from __future__ import annotations

from typing import Iterator

import attrs
import torch

from ..lifecycle import FinishReason


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
