"""AudioStream: a Sink that turns each request's frames into PCM chunks with a codec decoder on a worker thread."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from typing import Callable

import attrs
import torch

from ..engine.plan import FinishedRequest, FrameBatch
from ..errors import MtpFsmError
from ..lifecycle import FinishReason
from .chunking import AudioChunk, ChunkingSink
from .codec import CodecDecoder, DecoderTiming

log = logging.getLogger(__name__)

# Ended by the client or by an error: whatever audio is still queued is dropped, nothing follows.
_DROP_REASONS = frozenset({FinishReason.ABORT, FinishReason.ERROR})
DEFAULT_CHUNK = 25
DEFAULT_QUEUE_DEPTH = 256
DEFAULT_MAX_FINISHED = 10_000


class AudioStreamError(MtpFsmError):
    """The decoder failed on a request's window, or a window could not give the audio asked of it."""

    def __init__(self, request_id: str, detail: str) -> None:
        self.request_id = request_id
        super().__init__(f"request {request_id!r}: {detail}")


@attrs.frozen
class PcmChunk:
    """Samples [start_sample, start_sample + len(samples)) of one request's audio, float32 mono.
    The final chunk (is_final) may be empty: it marks the end of the stream."""

    request_id: str
    index: int
    start_sample: int
    samples: torch.Tensor
    is_final: bool


@attrs.define
class AudioStats:
    """One request's audio: when its first samples were ready (clock reading), how many samples."""

    first_audio_time: float | None = None
    last_audio_time: float | None = None
    num_samples: int = 0
    finished: bool = False
    error: str | None = None


class _Emitter:
    __slots__ = ("emitted", "index")

    def __init__(self) -> None:
        self.emitted = 0  # samples handed out so far
        self.index = 0


_STOP = object()


class AudioStream:
    """A Sink: frames are chunked (a small first chunk, then `chunk` frames, left context as the
    decoder asks), decoded beside the step loop on one worker thread (a bounded queue: a full
    queue makes the loop wait rather than memory grow), and each request's PCM is handed to
    `on_audio` in order, from the worker thread.

    Windows of equal length from different requests are decoded in one batch (up to the
    decoder's max_batch); requests never share a window. A request aborted or failed gets
    nothing once on_finished returned: its queued windows are dropped. A request's state is
    dropped when its final chunk is out; stats of the last `max_finished` ended requests stay.
    threaded=False decodes inline, in the caller's thread (tests, the audio-off baseline).
    worker_nice (Linux): the worker thread's nice increment, for a CPU too busy for both: the step
    loop then wins the CPU and first audio waits (measured on 1 free core: x1.00 engine frames/s
    at nice 15 but first audio 1.5 s, x0.94 and 0.27 s at nice 0).
    on_error(request_id, message): called (from the worker thread) when a request's audio fails; no
    final chunk follows for it, so a consumer waiting for one (an HTTP stream) learns it here.
    on_batch_done(): called after each batch of hand-outs (one worker wake-up's windows), so a consumer
    may pass a batch's chunks on at once (the HTTP server wakes its event loop once, not per chunk).
    """

    def __init__(
        self,
        decoder: CodecDecoder,
        on_audio: Callable[[PcmChunk], None],
        *,
        frame_width: int,
        first_chunk: int | None = None,
        chunk: int = DEFAULT_CHUNK,
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
        threaded: bool = True,
        clock: Callable[[], float] = time.perf_counter,
        max_finished: int = DEFAULT_MAX_FINISHED,
        worker_nice: int | None = None,
        on_error: Callable[[str, str], None] | None = None,
        on_batch_done: Callable[[], None] | None = None,
    ) -> None:
        self.decoder, self.timing = decoder, DecoderTiming.of(decoder)
        if first_chunk is None:
            first_chunk = self.timing.first_chunk_frames
        if type(queue_depth) is not int or queue_depth < 1:
            raise ValueError(f"queue_depth must be an int >= 1, got {queue_depth!r}")
        self.on_audio, self.clock, self.max_finished, self.worker_nice = on_audio, clock, max_finished, worker_nice
        self.on_error, self.on_batch_done = on_error, on_batch_done
        self.chunker = ChunkingSink(self._submit, first_chunk, chunk, self.timing.left_context_frames,
                                    num_codebooks=frame_width)
        self.stats: OrderedDict[str, AudioStats] = OrderedDict()
        self.decode_seconds = 0.0  # worker time inside decoder.decode
        self.decode_calls = 0
        self.windows = 0
        self._emitters: dict[str, _Emitter] = {}
        self._batch: list[AudioChunk] | None = None  # chunks of the on_frames call in progress
        self._dropped: set[str] = set()  # aborted / failed, until their marker leaves the queue
        self._lock = threading.Lock()  # the dropped set and every hand-out to on_audio
        self._queue: queue.Queue | None = None
        self._worker: threading.Thread | None = None
        if threaded:
            self._queue = queue.Queue(maxsize=queue_depth)
            self._worker = threading.Thread(target=self._run, name="audio-decoder", daemon=True)
            self._worker.start()

    # -- Sink ----------------------------------------------------------------------------

    def on_frames(self, step: int, frames: FrameBatch) -> None:
        # The step's chunks go to the worker as one item: woken by the first of several puts, it would
        # decode that one alone and the rest in a second call (measured: 8 first chunks in two calls of
        # 16 and 20 ms instead of one).
        self._batch = []
        try:
            self.chunker.on_frames(step, frames)
        finally:
            batch, self._batch = self._batch, None
            if batch:
                self._put(("batch", batch))

    def on_finished(self, step: int, finished: FinishedRequest) -> None:
        rid = finished.request_id
        if FinishReason(finished.reason) in _DROP_REASONS:
            with self._lock:  # after this, no hand-out for rid can start
                self._dropped.add(rid)
            try:
                self.chunker.on_finished(step, finished)  # may refuse a second finish, by name
            finally:
                self._put(("drop", rid))  # the marker that forgets rid once its queued windows are gone
            return
        self.chunker.on_finished(step, finished)  # emits the final chunk through _submit

    def add_observer(self, observer: Callable[[AudioChunk], None]) -> None:
        """See each frame chunk as it is queued for decoding (ServingLoop times chunks with it)."""
        self.chunker.add_observer(observer)

    # -- control -------------------------------------------------------------------------

    def flush(self) -> None:
        """Wait until every queued window is decoded and handed out."""
        if self._queue is not None:
            self._queue.join()

    def close(self) -> None:
        """Flush, then stop the worker."""
        if self._worker is not None and self._worker.is_alive():
            self.flush()
            self._queue.put(_STOP)
            self._worker.join()

    def retained(self) -> dict[str, int]:
        """Entries held now: chunker streams, open emitters, queued items, ended-request stats."""
        return {**self.chunker.retained(), "emitters": len(self._emitters),
                "queued": 0 if self._queue is None else self._queue.qsize(), "stats": len(self.stats)}

    def __enter__(self) -> "AudioStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- worker --------------------------------------------------------------------------

    def _submit(self, chunk: AudioChunk) -> None:
        if self._batch is not None:  # inside on_frames (the loop's thread): sent with the step's others
            self._batch.append(chunk)
        else:
            self._put(("chunk", chunk))

    def _put(self, item) -> None:
        if self._queue is None:
            self._process([item])
        else:
            self._queue.put(item)

    def _run(self) -> None:
        if self.worker_nice:
            _lower_priority(self.worker_nice)
        while True:
            items = [self._queue.get()]
            while len(items) < 4 * self.timing.max_batch:  # drain what is waiting: more to batch
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(item is _STOP for item in items)
            try:
                self._process([item for item in items if item is not _STOP])
            except Exception:  # never let the worker die: the loop would block on a full queue
                log.exception("audio worker: unexpected failure")
            finally:
                for _ in items:
                    self._queue.task_done()
            if stop:
                return

    def _process(self, items: list) -> None:
        try:
            self._process_items(items)
        finally:
            if self.on_batch_done is not None:
                try:
                    self.on_batch_done()
                except Exception:  # the worker must survive a failing consumer
                    log.exception("audio worker: on_batch_done failed")

    def _process_items(self, items: list) -> None:
        items = [(kind, c) for kind, payload in items for c in (payload if kind == "batch" else (payload,))]
        items = [("chunk" if kind == "batch" else kind, payload) for kind, payload in items]
        chunks = []
        for kind, payload in items:
            if kind != "chunk":
                continue
            if payload.request_id not in self._dropped:
                chunks.append(payload)
            elif payload.is_final:  # a failed request has ended: nothing more of it will come
                with self._lock:
                    self._dropped.discard(payload.request_id)
        pcm = self._decode_all(chunks)
        for chunk in chunks:
            if chunk.is_final and chunk.request_id in self._dropped:  # failed in this very call: it has ended
                with self._lock:
                    self._dropped.discard(chunk.request_id)
                continue
            if chunk.request_id in pcm:
                try:
                    self._hand_out(chunk, pcm[chunk.request_id].pop(0))
                except Exception as exc:  # the consumer (on_audio) failed: this request ends, others go on
                    self._fail(chunk.request_id, f"handing out the audio of {_span(chunk)} failed: "
                               f"{type(exc).__name__}: {exc}")
        for kind, payload in items:
            if kind == "drop":
                with self._lock:
                    self._dropped.discard(payload)
                self._emitters.pop(payload, None)
                self._stats_for(payload).finished = True

    def _decode_all(self, chunks: list[AudioChunk]) -> dict[str, list[torch.Tensor]]:
        """Every chunk's window decoded, batched by (length, final); request -> PCM rows in chunk order."""
        groups: dict[tuple[int, bool], list[int]] = {}
        for i, chunk in enumerate(chunks):
            # An empty final chunk still decodes its context: a decoder with lookahead holds back
            # the last frames' audio until it knows the stream ends.
            if chunk.has_audio or (chunk.is_final and len(chunk.context_frames)):
                groups.setdefault((len(chunk.context_frames) + len(chunk.frames), chunk.is_final), []).append(i)
        rows: list[torch.Tensor | None] = [None] * len(chunks)
        for (_, final), members in groups.items():
            for start in range(0, len(members), self.timing.max_batch):
                part = members[start:start + self.timing.max_batch]
                windows = torch.stack([torch.cat((chunks[i].context_frames, chunks[i].frames)) for i in part])
                began = time.perf_counter()
                try:
                    with torch.inference_mode():
                        out = self.decoder.decode(windows, final)
                except Exception as exc:
                    for i in part:
                        self._fail(chunks[i].request_id, f"decoder {type(self.decoder).__name__} failed on "
                                   f"frames [{chunks[i].start_frame}, {chunks[i].end_frame}): {exc}")
                    continue
                finally:
                    self.decode_seconds += time.perf_counter() - began
                    self.decode_calls += 1
                    self.windows += len(part)
                for row, i in enumerate(part):
                    rows[i] = out[row]
        empty = torch.zeros(0, dtype=torch.float32)
        by_request: dict[str, list[torch.Tensor]] = {}
        for chunk, row in zip(chunks, rows):
            if chunk.request_id in self._dropped:
                continue
            by_request.setdefault(chunk.request_id, []).append(empty if row is None else row)
        return by_request

    def _hand_out(self, chunk: AudioChunk, pcm: torch.Tensor) -> None:
        rid = chunk.request_id
        emitter = self._emitters.setdefault(rid, _Emitter())
        samples = pcm
        if len(chunk.context_frames) + len(chunk.frames):
            window_start = (chunk.start_frame - len(chunk.context_frames)) * self.timing.samples_per_frame
            offset = emitter.emitted - window_start
            if offset < 0:
                self._fail(rid, f"the window from frame {chunk.start_frame - len(chunk.context_frames)} starts "
                           f"after sample {emitter.emitted}, the first not yet emitted: left context too short")
                return
            samples = pcm[offset:]  # what this window adds: the samples past those already out
        with self._lock:
            if rid in self._dropped:
                return
            if len(samples) or chunk.is_final:
                out = PcmChunk(rid, emitter.index, emitter.emitted, samples.to(torch.float32).clone(), chunk.is_final)
                emitter.index += 1
                emitter.emitted += len(samples)
                stats = self._stats_for(rid)
                if len(samples):
                    stats.last_audio_time = self.clock()
                    if stats.first_audio_time is None:
                        stats.first_audio_time = stats.last_audio_time
                stats.num_samples += len(samples)
                self.on_audio(out)
        if chunk.is_final:
            self._emitters.pop(rid, None)
            self._stats_for(rid).finished = True

    def _fail(self, rid: str, detail: str) -> None:
        error = AudioStreamError(rid, detail)
        log.error("%s", error)
        with self._lock:
            self._dropped.add(rid)
        self._emitters.pop(rid, None)
        stats = self._stats_for(rid)
        stats.error, stats.finished = str(error), True
        if self.on_error is not None:
            try:
                self.on_error(rid, str(error))
            except Exception:  # the worker must survive a failing consumer
                log.exception("audio worker: on_error failed for request %r", rid)

    def _stats_for(self, rid: str) -> AudioStats:
        stats = self.stats.get(rid)
        if stats is None:
            stats = self.stats[rid] = AudioStats()
            while len(self.stats) > self.max_finished:  # oldest first; open requests are recent
                oldest = next(iter(self.stats))
                if not self.stats[oldest].finished:
                    break
                self.stats.popitem(last=False)
        return stats


def _span(chunk: AudioChunk) -> str:
    return f"frames [{chunk.start_frame}, {chunk.end_frame})"


def _lower_priority(nice: int) -> None:
    """Raise this thread's nice value (Linux: a thread id is a process id to setpriority)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except (AttributeError, OSError) as exc:  # not Linux, or not permitted: run at the caller's priority
        log.warning("audio worker: cannot lower its priority by %d: %s", nice, exc)
