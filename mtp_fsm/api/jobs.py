"""SpeechJob and JobRouter: one HTTP request's event queue, fed from the engine's sink and the decoder's thread."""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import Callable, Iterable

import attrs
import numpy as np
import torch

from ..engine.plan import FinishedRequest, FrameBatch, NewRequest
from ..lifecycle import FinishReason
from ..serving.audio_stream import AudioStream, PcmChunk
from ..serving.codec import CodecDecoder
from ..serving.wav import pcm16
from .schema import SpeechRequest

log = logging.getLogger(__name__)

# Ended by the client or a fault: AudioStream hands out no final chunk for these.
_DROPPED = frozenset({FinishReason.ABORT, FinishReason.ERROR})


@attrs.frozen
class FramesEvent:
    first_index: int
    codes: np.ndarray  # int64 [n, W]


def pcm16_bytes(samples: np.ndarray) -> bytes:
    """float samples -> 16-bit little-endian PCM, rounded as the WAV writer of the speech-out stage rounds."""
    return pcm16(torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32)))


@attrs.frozen
class AudioEvent:
    samples: np.ndarray  # float32 [n]
    is_final: bool
    # The bytes a response sends, made by the producer (the decoder's thread), not the event loop.
    pcm: bytes = attrs.field(default=attrs.Factory(lambda self: pcm16_bytes(self.samples), takes_self=True))


@attrs.frozen
class EndEvent:
    finished: FinishedRequest


@attrs.frozen
class AudioFailedEvent:
    message: str


class SpeechJob:
    """One accepted HTTP request: its engine request, and an asyncio queue the route reads. Producers
    (the engine's thread, the decoder's thread, a vLLM poller task) call `push` from any thread.

    A push only files the event in the job's mailbox; the event loop moves the mailbox into `events`
    when woken (`push(..., wake=True)`, or `wake_jobs` once for a producer's whole batch). Why: each
    wake-up is a callback the event loop runs holding the GIL, beside the engine's steps and the decoder;
    an audio stream's frames (but its first) are sent to nobody, and a step or a decode batch touching 8
    jobs needs one callback, not 8 (measured with one per event at 8 concurrent on a loaded 2-core host:
    the decoder started 5.4 ms after the step handed it the 8 first chunks, and the 8th first audio of a
    decode batch reached the event loop 4 ms after the 1st)."""

    def __init__(self, speech: SpeechRequest, request: NewRequest, arrival: float,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.speech, self.request, self.arrival, self.loop = speech, request, arrival, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self._mailbox: collections.deque = collections.deque()  # append / popleft: atomic across threads
        self.accepted: asyncio.Future = loop.create_future()  # None, or the ApiError refusing it
        self.on_first_audio: Callable[[], None] | None = None  # the router's: its first audio was sent (reader)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def push(self, event, *, wake: bool = True) -> None:
        """File `event` after every event pushed before it (from any thread); wake=False leaves it for
        the next wake-up (a batch's producer wakes once for all, `wake_jobs`)."""
        self._mailbox.append(event)
        if wake:
            wake_jobs((self,))

    def deliver(self) -> None:
        """(The event loop's thread) move what the mailbox holds into `events`, in order."""
        while self._mailbox:
            self.events.put_nowait(self._mailbox.popleft())

    def settle(self, refusal: Exception | None) -> None:
        """Accepted (None) or refused (the ApiError), from any thread; the first word counts."""
        def _set() -> None:
            if not self.accepted.done():
                self.accepted.set_result(refusal)
        try:
            self.loop.call_soon_threadsafe(_set)
        except RuntimeError:
            pass


def wake_jobs(jobs: Iterable[SpeechJob]) -> None:
    """Deliver these jobs' mailboxes: one callback per event loop (from any thread)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[SpeechJob]] = {}
    for job in jobs:
        by_loop.setdefault(job.loop, []).append(job)
    for loop, group in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver_all, group)
        except RuntimeError:  # the event loop is closed (server shutdown): nobody is listening any more
            pass


def _deliver_all(jobs: list[SpeechJob]) -> None:
    for job in jobs:
        job.deliver()


class JobRouter:
    """A Sink handing each step's frames and ends to their jobs, and the frames of jobs that want audio
    to an AudioStream (the talker's decoder on its own thread), whose PCM goes to the same jobs.

    Both backends feed it: the embedded one from its engine thread, the vLLM one from the frame poller.
    A job is forgotten once its stream has ended (its end, plus the final audio chunk for audio)."""

    def __init__(self, decoder: CodecDecoder | None, frame_width: int, *, threaded: bool = True,
                 first_chunk: int | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.frame_width = frame_width
        self._jobs: dict[str, SpeechJob] = {}
        self._lock = threading.Lock()  # the engine's thread, the decoder's thread and the event loop read _jobs
        # Jobs whose first frames went to the decoder and whose first audio is not out yet (wait_first_audio).
        self._first_pending: set[str] = set()
        self._first_done = threading.Condition(self._lock)
        self.on_end: Callable[[FinishReason], None] | None = None  # every job's engine end (metrics)
        self.audio: AudioStream | None = None
        self._audio_woken: list[SpeechJob] = []  # jobs given audio in the decode batch being handed out
        if decoder is not None:
            self.audio = AudioStream(decoder, self._on_audio, frame_width=frame_width, threaded=threaded,
                                     first_chunk=first_chunk, clock=clock, on_error=self._on_audio_error,
                                     on_batch_done=self._on_audio_batch)

    @property
    def sample_rate(self) -> int | None:
        return None if self.audio is None else self.audio.timing.sample_rate

    def register(self, job: SpeechJob) -> None:
        with self._lock:
            if job.request_id in self._jobs:
                raise ValueError(f"request {job.request_id!r} is already registered")
            self._jobs[job.request_id] = job
        rid = job.request_id
        job.on_first_audio = lambda: self.first_audio_sent(rid)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._jobs.pop(request_id, None)
            self._first_out(request_id)

    def _first_out(self, request_id: str) -> None:  # holding the lock
        if request_id in self._first_pending:
            self._first_pending.discard(request_id)
            if not self._first_pending:
                self._first_done.notify_all()

    def first_audio_sent(self, request_id: str) -> None:
        """The job's first audio has been sent (the reader calls it): a waiting engine may step on."""
        with self._lock:
            self._first_out(request_id)

    def wait_first_audio(self, timeout_s: float) -> bool:
        """Block (the engine's thread, between steps) until every job whose first frames were handed to the
        decoder has its first audio out, or `timeout_s`. Why: on a busy CPU the decoder's thread and the
        engine's next step share the cores and the GIL, and the first chunk waited behind a whole step
        (measured: 50-95 ms from first frame to first audio at 8 concurrent, 8 ms of it decoding), and the
        event loop that sends it waited too. "Out" is when the route has sent it (JobReader tells the router).
        Only steps that published some request's first frame pause, once per request. -> all out."""
        with self._lock:
            return self._first_done.wait_for(lambda: not self._first_pending, timeout=timeout_s)

    def __len__(self) -> int:
        return len(self._jobs)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._jobs)

    def job(self, request_id: str) -> SpeechJob | None:
        with self._lock:
            return self._jobs.get(request_id)

    # -- Sink ----------------------------------------------------------------------------

    def on_frames(self, step: int, frames: FrameBatch) -> None:
        """The step's frames into their jobs' mailboxes, the audio jobs' frames to the decoder first, then
        one wake-up of the event loop for the jobs that stream codes and those whose first frame this is.
        An audio job's later frames wake nobody: its route sends only audio, and they reach it with its
        next audio or its end. Its first frame does: the route sends the response's headers then, while
        the decoder works on the first audio (with headers and first audio at once, the client parsed 8
        responses' headers after the audio came: +6 ms at 8 concurrent)."""
        codes, index = frames.codes.numpy(), frames.frame_index.numpy()
        audio_rows, woken = [], []
        start = 0
        ids = frames.request_ids
        while start < len(ids):  # request-major: each request's rows are contiguous
            end = start
            while end < len(ids) and ids[end] == ids[start]:
                end += 1
            job = self.job(ids[start])
            if job is not None:
                job.push(FramesEvent(int(index[start]), codes[start:end].copy()), wake=False)
                if job.speech.wants_audio and self.audio is not None:
                    audio_rows.extend(range(start, end))
                    # The step that completes the request's first chunk (lookahead + 1 frames) sends it to be
                    # decoded: from then on its first audio is due (a decoder with lookahead has none before).
                    first_chunk = self.audio.chunker.first_chunk
                    if int(index[start]) < first_chunk <= int(index[end - 1]) + 1:
                        with self._lock:
                            self._first_pending.add(ids[start])
                    if int(index[start]) == 0:
                        woken.append(job)
                else:
                    woken.append(job)
            start = end
        if self.audio is not None and audio_rows:
            if len(audio_rows) < len(ids):  # only the jobs that asked for audio are decoded
                rows = torch.tensor(audio_rows, dtype=torch.int64)
                frames = FrameBatch(tuple(ids[i] for i in audio_rows), frames.frame_index[rows], frames.codes[rows],
                                    None if frames.payload is None else frames.payload[rows])
            self.audio.on_frames(step, frames)
        if woken:
            wake_jobs(woken)

    def on_finished(self, step: int, finished: FinishedRequest) -> None:
        job = self.job(finished.request_id)
        if job is None:
            return
        if self.on_end is not None:
            self.on_end(FinishReason(finished.reason))
        wants_audio = job.speech.wants_audio and self.audio is not None
        if wants_audio:
            self.audio.on_finished(step, finished)  # queues the final chunk (eos / length) or drops the rest
        job.push(EndEvent(finished))
        if not wants_audio or FinishReason(finished.reason) in _DROPPED:
            self.forget(finished.request_id)

    # -- the decoder's thread ------------------------------------------------------------

    def _on_audio(self, chunk: PcmChunk) -> None:
        job = self.job(chunk.request_id)
        if job is None:
            return
        job.push(AudioEvent(chunk.samples.numpy().astype(np.float32, copy=False), chunk.is_final), wake=False)
        self._audio_woken.append(job)  # only the decoder's worker (or, inline, the caller) runs this
        if chunk.is_final:
            self.forget(chunk.request_id)

    def _on_audio_batch(self) -> None:
        """A decode batch is handed out: one wake-up of the event loop for all of its jobs (one each, the
        8th first audio of a batch waited 4 ms behind the event loop sending the 1st)."""
        woken, self._audio_woken = self._audio_woken, []
        if woken:
            wake_jobs(dict.fromkeys(woken))

    def _on_audio_error(self, request_id: str, message: str) -> None:
        job = self.job(request_id)
        if job is not None:
            job.push(AudioFailedEvent(message))
            self.forget(request_id)

    def warm_up(self, max_requests: int) -> float:
        """Decode a first-chunk window once for every batch size up to `max_requests` (the decoder's
        max_batch at most); -> seconds spent. Why: a decoder's first call at a new batch shape costs
        several times a later one (measured on the tiny Qwen3-TTS decoder: 35 ms vs 8 ms at 2-8 windows,
        oneDNN's per-shape setup), and that first call would fall on some request's first audio."""
        if self.audio is None:
            return 0.0
        began = time.perf_counter()
        width = self.audio.chunker.first_chunk
        with torch.inference_mode():
            for batch in range(1, min(max_requests, self.audio.timing.max_batch) + 1):
                self.audio.decoder.decode(torch.zeros((batch, width, self.frame_width), dtype=torch.int64), False)
        return time.perf_counter() - began

    def close(self) -> None:
        if self.audio is not None:
            self.audio.close()
