"""ServingMetrics: per-request latencies and per-step load recorded by the serving loop, and their summary.

Retention is bounded, so a long-running server does not grow: running totals count
everything since the start, while per-request and per-step records are kept for the
requests in flight plus a window of the most recent finished requests and steps.
"""

from __future__ import annotations

from collections import deque

import attrs

from .._util.stats import percentile
from ..lifecycle import FinishReason

# Columns of the per-step state counts, in plotting order; "finished" is cumulative.
# "pending" (deferred schedule) and "starved" (waiting for a conditioning row) exist only in
# the variants that declare them.
STATE_COLUMNS = ("queued", "waiting", "prefilling", "decoding", "pending", "starved", "preempted", "finished")

# Default retention windows: finished-request records and step records kept for summaries and plots.
DEFAULT_WINDOW = 10_000


@attrs.define
class RequestMetrics:
    """Times are clock readings (seconds); latencies are measured from submit.

    first_chunk_time is the first chunk that carried audio (frames); a request that produced
    no frame (EOS at once, rejected, aborted early) has none, even if it got an empty final chunk.
    received_time: when the engine's thread took the request, if earlier than its submit: a thread
    that takes a batch of requests submits them one after another, and each submit runs the model's
    prompt preparation (3.3 ms a request for the tiny Qwen3-TTS), so the 8th of a batch is submitted
    23 ms after the engine has it; first_frame_from_received_ms counts that wait, first_frame_ms not.
    """

    request_id: str
    submit_time: float
    first_frame_time: float | None = None
    first_chunk_time: float | None = None
    finish_time: float | None = None
    num_frames: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None  # why the request was rejected, when it was
    received_time: float | None = None  # None: received at submit

    @property
    def first_frame_from_received_ms(self) -> float | None:
        if self.first_frame_time is None:
            return None
        received = self.submit_time if self.received_time is None else self.received_time
        return 1e3 * (self.first_frame_time - received)

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
    """Counts, frames, wall time, finished-by-reason and preemptions are totals since the
    start; the latency percentiles are over the `latency_window` most recently finished
    requests (those of them with a frame / an audio chunk)."""

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
    latency_window: int = 0  # finished requests the percentiles were computed over

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
            ("latency percentiles over", f"the last {self.latency_window} finished requests"),
            ("finished by reason", reasons),
            ("preemptions", str(self.preemptions)),
        ]

    def table(self) -> str:
        rows = self.rows()
        width = max(len(label) for label, _ in rows)
        return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def _check_window(name: str, value: object) -> None:
    if type(value) is not int or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


class ServingMetrics:
    """Filled in by the serving loop; read at any time (summary, state_history).

    `requests` holds every request in flight plus the `max_finished` most recently finished
    ones (older finished records are dropped); `steps` holds the `max_steps` most recent
    steps. The totals (num_submitted, num_finished, num_steps, total_frames, preemptions,
    finished_by_reason, wall time) are running counters over the whole lifetime.
    """

    def __init__(self, max_steps: int = DEFAULT_WINDOW, max_finished: int = DEFAULT_WINDOW) -> None:
        _check_window("max_steps", max_steps)
        _check_window("max_finished", max_finished)
        self.max_steps, self.max_finished = max_steps, max_finished
        self.requests: dict[str, RequestMetrics] = {}
        self.steps: deque[StepMetrics] = deque(maxlen=max_steps)
        self._finished: deque[str] = deque()  # retained finished request ids, oldest first
        self.first_step_start: float | None = None
        self.last_step_end: float | None = None
        self.num_submitted = 0
        self.num_finished = 0
        self.num_steps = 0
        self.total_frames = 0
        self.preemptions = 0
        self.finished_by_reason: dict[str, int] = {}

    def on_submit(self, request_id: str, now: float, received: float | None = None) -> None:
        if received is not None and received > now:
            raise ValueError(f"request {request_id!r}: received at {received}, after its submit at {now}")
        self.requests[request_id] = RequestMetrics(request_id, now, received_time=received)
        self.num_submitted += 1

    def on_frame(self, request_id: str, now: float) -> None:
        rm = self.requests[request_id]
        if rm.first_frame_time is None:
            rm.first_frame_time = now
        rm.num_frames += 1
        self.total_frames += 1

    def on_chunk(self, request_id: str, now: float, num_frames: int | None = None) -> None:
        """An audio chunk reached the client. A chunk of no frames (num_frames=0: an empty
        final chunk, the end-of-stream marker) is not audio and is never a first chunk."""
        if num_frames == 0:
            return
        rm = self.requests.get(request_id)
        if rm is not None and rm.first_chunk_time is None:
            rm.first_chunk_time = now

    def on_finished(self, request_id: str, reason: FinishReason, now: float, error: str | None = None) -> None:
        rm = self.requests[request_id]
        if rm.finish_reason is not None:
            return  # already counted: a request ends once
        rm.finish_reason, rm.finish_time = FinishReason(reason), now
        if error is not None:
            rm.error = error
        self.num_finished += 1
        label = rm.finish_reason.label
        self.finished_by_reason[label] = self.finished_by_reason.get(label, 0) + 1
        self._finished.append(request_id)
        while len(self._finished) > self.max_finished:
            self.requests.pop(self._finished.popleft(), None)

    def on_step(self, record: StepMetrics, start: float, end: float) -> None:
        if self.first_step_start is None:
            self.first_step_start = start
        self.last_step_end = end
        self.num_steps += 1
        self.preemptions += record.preempts
        self.steps.append(record)

    def retained(self) -> dict[str, int]:
        """How many records are held now (in-flight + window of finished requests, steps)."""
        return {"requests": len(self.requests), "steps": len(self.steps)}

    def state_history(self) -> dict[str, list[int]]:
        """Requests per state after each retained step (the last `max_steps` steps)."""
        return {name: [s.states.get(name, 0) for s in self.steps] for name in STATE_COLUMNS}

    def summary(self) -> ServingSummary:
        frames = self.total_frames
        wall = 0.0 if self.first_step_start is None else self.last_step_end - self.first_step_start
        window = [self.requests[rid] for rid in self._finished]
        ff = [r.first_frame_ms for r in window if r.first_frame_ms is not None]
        fc = [r.first_chunk_ms for r in window if r.first_chunk_ms is not None]
        return ServingSummary(
            num_requests=self.num_submitted, num_steps=self.num_steps, total_frames=frames, wall_s=wall,
            frames_per_s=frames / wall if wall > 0 else 0.0,
            first_frame_ms_p50=_percentile_or_none(ff, 50), first_frame_ms_p95=_percentile_or_none(ff, 95),
            first_chunk_ms_p50=_percentile_or_none(fc, 50), first_chunk_ms_p95=_percentile_or_none(fc, 95),
            finished_by_reason=dict(self.finished_by_reason), preemptions=self.preemptions,
            latency_window=len(window),
        )


def _percentile_or_none(values: list[float], p: float) -> float | None:
    return percentile(values, p) if values else None
