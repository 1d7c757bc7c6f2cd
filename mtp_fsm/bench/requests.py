"""The requests every bench design runs and the frame key they all report."""

from __future__ import annotations

import attrs

from ..engine import NewRequest
from ..sampling import SamplingParams

# A published frame as every driver reports it: (request id, frame index, codes).
FrameKey = tuple[str, int, tuple[int, ...]]


@attrs.frozen
class BenchRequest:
    request_id: str
    inputs: object  # model-specific (NullInputs, TTSInputs, ...)
    seed: int
    max_frames: int
    cb0: SamplingParams = SamplingParams()
    mtp: SamplingParams = SamplingParams()

    def to_new(self) -> NewRequest:
        return NewRequest(self.request_id, self.inputs, self.max_frames, self.seed, self.cb0, self.mtp)


def make_requests(n: int, inputs: object, *, max_frames: int = 10**6, prefix: str = "r") -> list[BenchRequest]:
    """n requests with distinct seeds and the default sampling (T=0.9, top-k 50, top-p 1)."""
    return [BenchRequest(f"{prefix}{i}", inputs, seed=1000 + 7919 * i, max_frames=max_frames) for i in range(n)]
