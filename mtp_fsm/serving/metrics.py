"""ServingMetrics: per-request latencies and per-step load recorded by the serving loop, and their summary."""

from __future__ import annotations

import attrs

from .._util.stats import percentile
from ..lifecycle import FinishReason

# Columns of the per-step state counts, in plotting order; "finished" is cumulative.
STATE_COLUMNS = ("queued", "waiting", "prefilling", "decoding", "preempted", "finished")


@attrs.define
class RequestMetrics:
    """Times are clock readings (seconds); latencies are measured from submit."""

    request_id: str
    submit_time: float
    first_frame_time: float | None = None
    first_chunk_time: float | None = None
    finish_time: float | None = None
    num_frames: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None  # why the request was rejected, when it was

    @property
    def first_frame_ms(self) -> float | None:
        return None if self.first_frame_time is None else 1e3 * (self.first_frame_time - self.submit_time)

    @property
    def first_chunk_ms(self) -> float | None:
        return None if self.first_chunk_time is None else 1e3 * (self.first_chunk_time - self.submit_time)


@attrs.frozen
class StepMetrics:
    step: int
    wall_s: float
    num_tokens: int
    num_frames: int
    preempts: int
    states: dict[str, int]  # STATE_COLUMNS -> number of requests after the step


@attrs.frozen
class ServingSummary:
    num_requests: int
    num_steps: int
    total_frames: int
    wall_s: float
    frames_per_s: float
    first_frame_ms_p50: float | None
    first_frame_ms_p95: float | None
    first_chunk_ms_p50: float | None
    first_chunk_ms_p95: float | None
    finished_by_reason: dict[str, int]
    preemptions: int

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) pairs for a printed table."""

        def ms(v: float | None) -> str:
            return "n/a" if v is None else f"{v:.1f} ms"

        reasons = ", ".join(f"{k}={v}" for k, v in sorted(self.finished_by_reason.items())) or "none"
        return [
            ("requests", str(self.num_requests)),
            ("steps", str(self.num_steps)),
            ("frames", str(self.total_frames)),
            ("wall time", f"{self.wall_s:.2f} s"),
            ("frames/s", f"{self.frames_per_s:.1f}"),
            ("first-frame latency p50", ms(self.first_frame_ms_p50)),
            ("first-frame latency p95", ms(self.first_frame_ms_p95)),
            ("first-chunk latency p50", ms(self.first_chunk_ms_p50)),
            ("first-chunk latency p95", ms(self.first_chunk_ms_p95)),
            ("finished by reason", reasons),
            ("preemptions", str(self.preemptions)),
        ]

    def table(self) -> str:
        rows = self.rows()
        width = max(len(label) for label, _ in rows)
        return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


class ServingMetrics:
    """Filled in by the serving loop; read at any time (summary, state_history)."""

    def __init__(self) -> None:
        self.requests: dict[str, RequestMetrics] = {}
        self.steps: list[StepMetrics] = []
        self.first_step_start: float | None = None
        self.last_step_end: float | None = None
        self.num_finished = 0

    def on_submit(self, request_id: str, now: float) -> None:
        self.requests[request_id] = RequestMetrics(request_id, now)

    def on_frame(self, request_id: str, now: float) -> None:
        rm = self.requests[request_id]
        if rm.first_frame_time is None:
            rm.first_frame_time = now
        rm.num_frames += 1

    def on_chunk(self, request_id: str, now: float) -> None:
        rm = self.requests.get(request_id)
        if rm is not None and rm.first_chunk_time is None:
            rm.first_chunk_time = now

    def on_finished(self, request_id: str, reason: FinishReason, now: float, error: str | None = None) -> None:
        rm = self.requests[request_id]
        rm.finish_reason, rm.finish_time = FinishReason(reason), now
        if error is not None:
            rm.error = error
        self.num_finished += 1

    def on_step(self, record: StepMetrics, start: float, end: float) -> None:
        if self.first_step_start is None:
            self.first_step_start = start
        self.last_step_end = end
        self.steps.append(record)

    def state_history(self) -> dict[str, list[int]]:
        return {name: [s.states.get(name, 0) for s in self.steps] for name in STATE_COLUMNS}

    def summary(self) -> ServingSummary:
        frames = sum(r.num_frames for r in self.requests.values())
        wall = 0.0 if self.first_step_start is None else self.last_step_end - self.first_step_start
        ff = [r.first_frame_ms for r in self.requests.values() if r.first_frame_ms is not None]
        fc = [r.first_chunk_ms for r in self.requests.values() if r.first_chunk_ms is not None]
        reasons: dict[str, int] = {}
        for r in self.requests.values():
            if r.finish_reason is not None:
                reasons[r.finish_reason.label] = reasons.get(r.finish_reason.label, 0) + 1
        return ServingSummary(
            num_requests=len(self.requests), num_steps=len(self.steps), total_frames=frames, wall_s=wall,
            frames_per_s=frames / wall if wall > 0 else 0.0,
            first_frame_ms_p50=_percentile_or_none(ff, 50), first_frame_ms_p95=_percentile_or_none(ff, 95),
            first_chunk_ms_p50=_percentile_or_none(fc, 50), first_chunk_ms_p95=_percentile_or_none(fc, 95),
            finished_by_reason=reasons, preemptions=sum(s.preempts for s in self.steps),
        )


def _percentile_or_none(values: list[float], p: float) -> float | None:
    return percentile(values, p) if values else None
