"""ServingLoop: steps the engine with its built-in policy, feeds sinks, records metrics."""

from __future__ import annotations

import time
from typing import Callable, Iterable

from ..engine import LockstepEngine
from ..engine.plan import FinishedRequest, NewRequest, StepOutput
from ..engine.scheduler import SchedulerStallError as ServingStallError  # noqa: F401  (re-exported)
from ..errors import AdmissionError, DuplicateRequestError
from ..lifecycle import CLASS_TERMINAL, CLASS_VACANT, FinishReason
from .metrics import ServingMetrics, StepMetrics
from .sinks import Sink


class ServingLoop:
    """The embedded serving default: submit/abort from clients, step() the engine.

    A request the engine or the model refuses (bad fields, unusable inputs, a prompt
    that does not fit) is rejected alone: it is reported finished with reason `error`
    to sinks and metrics (the message is kept in metrics), and nothing else accepted
    is lost.

    Request ids must be unique among the requests in flight and those the metrics still
    retain (the last `metrics.max_finished` finished ones): retention is bounded, so a
    long-running loop does not remember every id it ever served.
    """

    def __init__(
        self,
        engine: LockstepEngine,
        sinks: Iterable[Sink] = (),
        clock: Callable[[], float] = time.perf_counter,
        metrics: ServingMetrics | None = None,
    ) -> None:
        self.engine, self.clock = engine, clock
        compiled = engine.compiled
        self._terminal = frozenset(s.label for s in compiled.states_in(CLASS_TERMINAL))
        self._queued = frozenset(s.label for s in compiled.states_in(CLASS_VACANT))  # admitted by no plan yet
        self.sinks = tuple(sinks)
        self.metrics = ServingMetrics() if metrics is None else metrics
        for sink in self.sinks:
            add_observer = getattr(sink, "add_observer", None)  # a ChunkingSink: time the first audio chunk
            if add_observer is not None:
                add_observer(self._on_chunk)

    # -- client side ---------------------------------------------------------------------

    def submit(self, request: NewRequest, *, received: float | None = None) -> bool:
        """Accept a request into the queue; False when it was rejected (reported as an error).
        received: when the caller's thread took it (a clock reading), for a batch submitted one after
        another (metrics: RequestMetrics.received_time)."""
        rid = request.request_id
        if rid in self.metrics.requests:
            rm = self.metrics.requests[rid]
            state = rm.finish_reason.label if rm.finish_reason is not None else self.engine.requests().get(rid, "submitted")
            raise DuplicateRequestError(rid, "request ids must be unique for the serving loop's lifetime", state)
        self.metrics.on_submit(rid, self.clock(), received)
        try:
            self.engine.add_request(request)
        except AdmissionError as exc:  # bad fields or inputs the model refuses: this request's fault only
            self._reject(rid, exc)
            return False
        return True

    def abort(self, request_id: str) -> str:
        """'dropped' (was queued; reported aborted now), 'scheduled' (aborted in the next
        step, reported then) or 'ignored' (already finished or unknown)."""
        outcome = self.engine.abort(request_id)
        if outcome == "dropped":
            self._finish(self.engine.step_count, FinishedRequest(request_id, FinishReason.ABORT, 0))
        return outcome

    def preempt(self, request_id: str) -> bool:
        """Preempt a running request at the next step (it resumes when a slot is free and
        produces the same frames); False when it is not running (queued, ended, unknown)."""
        return self.engine.preempt(request_id)

    def feed(self, request_id: str, rows, *, done: bool = False) -> None:
        """Conditioning rows for a request of a conditioned talker (Qwen3-Omni thinker rows);
        a request starved for its next row runs again from the next step (engine.feed)."""
        self.engine.feed(request_id, rows, done=done)

    # -- stepping ------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return self.engine.idle

    def step(self) -> StepOutput | None:
        """Plan and run one engine step; None when there is nothing to run now: every request
        ended, or those left wait for conditioning rows (`engine.waiting_for_feed`)."""
        start = self.clock()
        output = self.engine.step()
        if output is None:
            return None
        now = self.clock()
        for rid in output.frames.request_ids:
            self.metrics.on_frame(rid, now)
        if len(output.frames):
            for sink in self.sinks:
                sink.on_frames(output.step, output.frames)
        for finished in output.finished:
            self._finish(output.step, finished)
        end = self.clock()
        self.metrics.on_step(
            StepMetrics(
                step=output.step, wall_s=end - start, num_tokens=output.num_tokens, num_frames=len(output.frames),
                preempts=output.num_preempted, states=self._state_counts(),
            ),
            start, end,
        )
        return output

    def run_until_idle(
        self, max_steps: int | None = None, on_step: Callable[[StepOutput], None] | None = None
    ) -> int:
        """Step until every request has ended and been released (or max_steps); -> steps run."""
        steps = 0
        while max_steps is None or steps < max_steps:
            output = self.step()
            if output is None:
                break
            steps += 1
            if on_step is not None:
                on_step(output)
        return steps

    # -- helpers -------------------------------------------------------------------------

    def _reject(self, request_id: str, error: Exception) -> None:
        self._finish(self.engine.step_count, FinishedRequest(request_id, FinishReason.ERROR, 0, str(error)))

    def _finish(self, step: int, finished: FinishedRequest) -> None:
        # Sinks first: a final chunk they emit (maybe the request's first audio) is timed
        # while the request is still in flight, never after its finish.
        for sink in self.sinks:
            sink.on_finished(step, finished)
        self.metrics.on_finished(finished.request_id, finished.reason, self.clock(), finished.detail or None)

    def _on_chunk(self, chunk) -> None:
        if chunk.has_audio:  # an empty final chunk marks the end of a stream: it is not audio
            self.metrics.on_chunk(chunk.request_id, self.clock(), len(chunk.frames))

    def _state_counts(self) -> dict[str, int]:
        counts = {"queued": 0, "finished": self.metrics.num_finished}
        for label in self.engine.requests().values():
            if label in self._queued:
                counts["queued"] += 1
            elif label not in self._terminal:  # ended requests are counted once, in "finished"
                counts[label] = counts.get(label, 0) + 1
        return counts
