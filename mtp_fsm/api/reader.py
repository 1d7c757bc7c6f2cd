"""JobReader: reads one job's events in order, decides when its stream has ended and how, and records its metrics."""

from __future__ import annotations

import time
from typing import AsyncIterator, Callable

from ..lifecycle import FinishReason
from .errors import ApiError
from .jobs import AudioEvent, AudioFailedEvent, EndEvent, FramesEvent, SpeechJob
from .metrics import SpeechMetrics

_DROPPED = frozenset({FinishReason.ABORT, FinishReason.ERROR})


class JobReader:
    """Yields ("frames", FramesEvent) and ("audio", 16-bit PCM bytes) in order until the stream is whole:
    the request's end has come and, for audio, the decoder's final chunk (a request ended by a fault or
    an abort gets none). A fault ends the iteration with ApiError 500 (model or decoder), an abort the
    client did not ask for with 503; the caller decides what a client that already has bytes sees.

    Metrics: queued -> active at the first frame, time to first audio at the first samples (the first
    frame for codes), frames, audio seconds, real-time factor and the finish reason at the end."""

    def __init__(self, job: SpeechJob, metrics: SpeechMetrics, sample_rate: int | None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.job, self.metrics, self.sample_rate, self.clock = job, metrics, sample_rate, clock
        self.finished = None
        self.frames = 0
        self.samples = 0
        self.first_audio_s: float | None = None
        self._audio_done = not job.speech.wants_audio
        self._active = False
        self._left = False
        metrics.queued.inc()

    @property
    def done(self) -> bool:
        if self.finished is None:
            return False
        return self._audio_done or FinishReason(self.finished.reason) in _DROPPED

    async def items(self) -> AsyncIterator[tuple[str, object]]:
        job = self.job
        try:
            while not self.done:
                event = await job.events.get()
                if isinstance(event, FramesEvent):
                    if not self._active:
                        self._active = True
                        self.metrics.queued.dec()
                        self.metrics.active.inc()
                    self.frames += len(event.codes)
                    self.metrics.frames.inc(len(event.codes))
                    if not job.speech.wants_audio and self.first_audio_s is None and len(event.codes):
                        self._first_audio()
                    yield "frames", event
                elif isinstance(event, AudioEvent):
                    if len(event.samples):
                        first = self.first_audio_s is None
                        if first:
                            self._first_audio()
                        self.samples += len(event.samples)
                        yield "audio", event.pcm
                        if first and job.on_first_audio is not None:
                            job.on_first_audio()  # asked for more: the first audio went out, the engine may step on
                    if event.is_final:
                        self._audio_done = True
                elif isinstance(event, EndEvent):
                    self.finished = event.finished
                elif isinstance(event, AudioFailedEvent):
                    raise ApiError(500, f"request {job.request_id!r}: its audio failed: {event.message}",
                                   reason="decoder_fault", request_id=job.request_id)
            self._check_end()
        finally:
            self.close()

    def _first_audio(self) -> None:
        self.first_audio_s = self.clock() - self.job.arrival
        self.metrics.ttfa.observe(self.first_audio_s)

    def _check_end(self) -> None:
        finished, rid = self.finished, self.job.request_id
        reason = FinishReason(finished.reason)
        self.metrics.finished.labels(reason=reason.label).inc()
        if reason is FinishReason.ERROR:
            raise ApiError(500, f"request {rid!r} failed in the engine after {finished.num_frames} frames: "
                           f"{finished.detail or 'no detail'}", reason="model_fault", request_id=rid)
        if reason is FinishReason.ABORT:
            raise ApiError(503, f"request {rid!r} was aborted by the server after {finished.num_frames} frames"
                           + (f": {finished.detail}" if finished.detail else ""), reason="server_abort",
                           request_id=rid)
        if self.sample_rate and self.samples:
            audio_s = self.samples / self.sample_rate
            self.metrics.audio_seconds.inc(audio_s)
            self.metrics.rtf.observe((self.clock() - self.job.arrival) / audio_s)

    def close(self) -> None:
        """Count this request out of queued / active (once; also when it was never read)."""
        if self._left:
            return
        self._left = True
        (self.metrics.active if self._active else self.metrics.queued).dec()


