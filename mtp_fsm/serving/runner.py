"""ServingLoop: drives engine steps from the scheduler's plans, feeds sinks, records metrics."""

from __future__ import annotations

import time
from typing import Callable, Iterable

from ..engine.plan import FinishedRequest, NewRequest, StepOutput, StepPlan
from ..errors import AdmissionError, DuplicateRequestError, MtpFsmError, SlotTableFullError
from ..lifecycle import TERMINAL_STATES, FinishReason
from .metrics import ServingMetrics, StepMetrics
from .scheduler import Scheduler
from .sinks import Sink

_TERMINAL_LABELS = frozenset(s.label for s in TERMINAL_STATES)


class ServingStallError(MtpFsmError):
    """Requests are waiting but the scheduler can plan nothing (no slot can ever free up)."""


class ServingLoop:
    """The embedded serving default: submit/abort from clients, step() the engine.

    A request the engine or the model refuses (bad fields, unusable inputs, a prompt
    that does not fit) is rejected alone: it is reported finished with reason `error`
    to sinks and metrics (the message is kept in metrics), and nothing else accepted
    is lost. Request ids must be unique for the loop's lifetime.
    """

    def __init__(
        self,
        engine,
        scheduler: Scheduler,
        sinks: Iterable[Sink] = (),
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.engine, self.scheduler, self.clock = engine, scheduler, clock
        self.sinks = tuple(sinks)
        self.metrics = ServingMetrics()
        for sink in self.sinks:
            add_observer = getattr(sink, "add_observer", None)  # a ChunkingSink: time the first audio chunk
            if add_observer is not None:
                add_observer(lambda chunk: self.metrics.on_chunk(chunk.request_id, self.clock()))

    # -- client side ---------------------------------------------------------------------

    def submit(self, request: NewRequest) -> bool:
        """Accept a request into the queue; False when it was rejected (reported as an error)."""
        rid = request.request_id
        if rid in self.metrics.requests:
            rm = self.metrics.requests[rid]
            state = rm.finish_reason.label if rm.finish_reason is not None else self.scheduler.phase(rid) or "submitted"
            raise DuplicateRequestError(rid, "request ids must be unique for the serving loop's lifetime", state)
        self.metrics.on_submit(rid, self.clock())
        problems = self.engine.check_new(request)
        if problems:
            self._reject(rid, AdmissionError(rid, "; ".join(problems), "submitted"))
            return False
        try:
            prompt_len = self._prompt_len(request)
        except AdmissionError as exc:  # the model rejected these inputs: this request's fault only
            self._reject(rid, exc)
            return False
        self.scheduler.add(request, prompt_len)
        return True

    def abort(self, request_id: str) -> str:
        """'dropped' (was queued; reported aborted now), 'scheduled' (aborted in the next
        step, reported then) or 'ignored' (already finished or unknown)."""
        outcome = self.scheduler.abort(request_id)
        if outcome == "dropped":
            self._finish(self.engine.step_count, FinishedRequest(request_id, FinishReason.ABORT, 0))
        return outcome

    def _prompt_len(self, request: NewRequest) -> int:
        # The scheduler needs the prompt length to size the first chunk in the admission step.
        return int(self.engine.prepare(request).prompt_embeds.shape[0])

    # -- stepping ------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return self.scheduler.idle

    def step(self) -> StepOutput | None:
        """Plan and run one engine step; None when there is nothing left to do."""
        start = self.clock()
        while True:
            if self.scheduler.idle:
                return None
            plan = self.scheduler.schedule(self.engine)
            if _is_empty(plan):
                raise ServingStallError(
                    f"nothing can be scheduled: {len(self.scheduler.queue)} queued, {self.scheduler.num_running} "
                    f"running, {self.scheduler.num_preempted} preempted, engine has {self.engine.num_free_slots} "
                    "free slots"
                )
            try:
                output = self.engine.step(plan)
                break
            except AdmissionError as exc:
                new_ids = {r.request_id for r in plan.new_requests}
                if isinstance(exc, SlotTableFullError) or exc.request_id not in new_ids:
                    raise  # the plan itself is wrong: a scheduler bug, not a client's input
                self.scheduler.reject(exc.request_id)
                self._reject(exc.request_id, exc)
        self.scheduler.update(output)
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
                preempts=len(plan.preempts), states=self._state_counts(),
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
        self.metrics.on_finished(finished.request_id, finished.reason, self.clock(), finished.detail or None)
        for sink in self.sinks:
            sink.on_finished(step, finished)

    def _state_counts(self) -> dict[str, int]:
        counts = {"queued": len(self.scheduler.queue), "finished": self.metrics.num_finished}
        for label in self.engine.requests().values():
            if label not in _TERMINAL_LABELS:  # ended requests are counted once, in "finished"
                counts[label] = counts.get(label, 0) + 1
        return counts


def _is_empty(plan: StepPlan) -> bool:
    return not (plan.rows or plan.new_requests or plan.aborts or plan.preempts or plan.resumes or plan.releases)
