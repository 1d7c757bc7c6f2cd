"""The HTTP routes: POST /v1/audio/speech (WAV, PCM, codes; whole, streamed or SSE), GET /health, GET /metrics."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import logging
import secrets
import time
import uuid
import wave

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ..lifecycle import FinishReason
from .errors import ApiError
from .jobs import SpeechJob
from .reader import JobReader
from .schema import parse_speech_request
from .service import SpeechService

log = logging.getLogger("mtp_fsm.api")

STATE_KEY = "mtp_fsm_speech"  # app.state attribute holding the SpeechService
_DISCONNECTED = object()
_END = object()


def speech_router(*, health: bool = True, metrics_registry: CollectorRegistry | None = None) -> APIRouter:
    """The speech routes; health=False and no registry under vLLM, whose own /health and /metrics serve."""
    router = APIRouter()
    router.add_api_route("/v1/audio/speech", create_speech, methods=["POST"])
    if health:
        router.add_api_route("/health", get_health, methods=["GET"])
    if metrics_registry is not None:
        async def get_metrics() -> Response:
            return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)
        router.add_api_route("/metrics", get_metrics, methods=["GET"])
    return router


async def get_health(request: Request) -> Response:
    why = getattr(request.app.state, STATE_KEY).backend.health()
    if why is None:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unavailable", "detail": why}, status_code=503)


def error_response(svc: SpeechService, error: ApiError) -> JSONResponse:
    svc.refused(error)
    return JSONResponse(error.body(), status_code=error.status)


class _Flight:
    """One accepted request's end: the stream gate released once, one log line (id, reason, frames, TTFA)."""

    def __init__(self, svc: SpeechService, job: SpeechJob) -> None:
        self.svc, self.job = svc, job
        self.reader: JobReader | None = None
        self.handed_over = False  # a streaming body ends the flight itself
        self._ended = False

    def end(self, error: ApiError | None = None, *, disconnected: bool = False) -> None:
        if self._ended:
            return
        self._ended = True
        self.svc.gate.release()
        reader, rid = self.reader, self.job.request_id
        if reader is not None:
            reader.close()
            if not reader.done:  # the client left, or the audio failed: the engine must stop this request
                self.svc.backend.abort(rid)
        if disconnected:
            self.svc.metrics.aborts.labels(reason="client_disconnect").inc()
        if error is not None:
            self.svc.metrics.failure(error.status, error.reason)
        finished = None if reader is None else reader.finished
        reason = ("client_disconnect" if disconnected else error.reason if error is not None
                  else FinishReason(finished.reason).label if finished is not None else "-")
        ttfa = "-" if reader is None or reader.first_audio_s is None else f"{1e3 * reader.first_audio_s:.1f} ms"
        frames = 0 if reader is None else reader.frames
        level = logging.WARNING if error is not None and error.status >= 500 else logging.INFO
        log.log(level, "speech %s ended: %s, %d frames, first audio %s%s", rid, reason, frames, ttfa,
                "" if error is None else f" ({error.status}: {error.message})")


async def create_speech(request: Request) -> Response:
    svc: SpeechService = getattr(request.app.state, STATE_KEY)
    arrival = time.perf_counter()  # before anything else: time to first audio counts our own work too
    rid = f"speech-{uuid.uuid4().hex}"
    try:
        speech = parse_speech_request(await request.body())
        svc.check(speech)
        seed = speech.seed if speech.seed is not None else secrets.randbits(63)
        svc.gate.acquire()
        try:
            new = svc.backend.build(speech, rid, seed=seed, max_frames=svc.limits.frames_for(speech))
        except BaseException:
            svc.gate.release()
            raise
    except ApiError as exc:
        exc.request_id = exc.request_id or rid
        return error_response(svc, exc)
    job = SpeechJob(speech, new, arrival, asyncio.get_running_loop())
    flight = _Flight(svc, job)
    try:
        await svc.backend.start(job)
        refused = await job.accepted
        if refused is not None:
            raise refused
        flight.reader = JobReader(job, svc.metrics, svc.backend.sample_rate)
        headers = {"X-Request-Id": rid, "X-Seed": str(seed)}
        if svc.backend.sample_rate is not None and speech.wants_audio:
            headers["X-Sample-Rate"] = str(svc.backend.sample_rate)
        if speech.stream:
            return await _streamed(request, svc, flight, headers)
        return await _whole(request, svc, flight, headers)
    except ApiError as exc:
        exc.request_id = exc.request_id or rid
        flight.end(exc)
        log.debug("speech %s: %s", rid, exc.message)
        return JSONResponse(exc.body(), status_code=exc.status)
    finally:
        if not flight.handed_over:
            flight.end()


async def _whole(request: Request, svc: SpeechService, flight: _Flight, headers: dict) -> Response:
    speech, reader = flight.job.speech, flight.reader
    frames, audio = [], []

    async def collect() -> None:
        async for kind, item in reader.items():
            (frames if kind == "frames" else audio).append(item)

    if await _until_disconnect(request, collect()) is _DISCONNECTED:
        flight.end(disconnected=True)
        return Response(status_code=499)  # nobody reads it; uvicorn drops it
    headers["X-Finish-Reason"] = FinishReason(reader.finished.reason).label
    if speech.response_format == "codes":
        codes = [row for event in frames for row in event.codes.tolist()]
        return JSONResponse({"request_id": flight.job.request_id, "finish_reason": headers["X-Finish-Reason"],
                             "frames": codes}, headers=headers)
    pcm = b"".join(audio)  # 16-bit PCM per chunk: the same bytes as the whole converted at once
    if speech.response_format == "pcm":
        return Response(pcm, media_type="audio/pcm", headers=headers)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(svc.backend.sample_rate)
        wav.writeframes(pcm)
    return Response(buffer.getvalue(), media_type="audio/wav", headers=headers)


async def _streamed(request: Request, svc: SpeechService, flight: _Flight, headers: dict) -> Response:
    """Headers wait for the first item, so a request that fails before any audio still gets its status
    (a 500 for a model fault); after that a fault is an SSE `error` event, an NDJSON error line, or for
    raw PCM a cut connection (the client sees an incomplete body, never a silently short one)."""
    speech, reader = flight.job.speech, flight.reader
    items = reader.items()
    first = await _until_disconnect(request, _first(items))
    if first is _DISCONNECTED:
        flight.end(disconnected=True)
        return Response(status_code=499)
    sse, codes = speech.stream_format == "sse", speech.response_format == "codes"
    rid = flight.job.request_id

    def encode(kind: str, item) -> bytes | None:
        if kind == "frames":
            if not codes:
                return None
            if sse:
                return _sse({"type": "speech.codes.delta", "index": item.first_index, "codes": item.codes.tolist()})
            return b"".join(_line({"index": item.first_index + i, "codes": row})
                            for i, row in enumerate(item.codes.tolist()))
        pcm = item
        return _sse({"type": "speech.audio.delta", "audio": base64.b64encode(pcm).decode("ascii")}) if sse else pcm

    def done() -> bytes:
        usage = {"frames": reader.frames}
        if svc.backend.sample_rate is not None and not codes:
            usage["audio_seconds"] = reader.samples / svc.backend.sample_rate
        end = {"finish_reason": FinishReason(reader.finished.reason).label, "usage": usage}
        if sse:
            return _sse({"type": "speech.audio.done", **end})
        return _line(end) if codes else b""

    async def body():
        try:
            try:
                if first is not _END:
                    chunk = encode(*first)
                    if chunk:
                        yield chunk
                async for item in items:
                    chunk = encode(*item)
                    if chunk:
                        yield chunk
                tail = done()
                if tail:
                    yield tail
            except ApiError as exc:
                flight.end(exc)
                if sse:
                    yield _sse({"type": "error", **exc.body()})
                elif codes:
                    yield _line(exc.body())
                else:
                    raise
        finally:
            flight.end(disconnected=not reader.done)

    media = "text/event-stream" if sse else "application/x-ndjson" if codes else "audio/pcm"
    flight.handed_over = True
    log.debug("speech %s streaming (%s)", rid, media)
    return _FlightResponse(body(), flight, media_type=media, headers={**headers, "Cache-Control": "no-cache"})


class _FlightResponse(StreamingResponse):
    """Ends its flight however the response ends: a body that never started (the client left before the
    headers went out) runs no `finally` of its own, and the gate slot and the engine request would leak."""

    def __init__(self, content, flight: _Flight, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._flight = flight

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            reader = self._flight.reader
            self._flight.end(disconnected=reader is not None and not reader.done)


async def _first(items):
    try:
        return await items.__anext__()
    except StopAsyncIteration:
        return _END


async def _until_disconnect(request: Request, work):
    """Run `work` until it ends (its result or exception) or the client goes away (_DISCONNECTED, the work
    cancelled). Only the body has been read: what `receive` gets next is the disconnect."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, ApiError):
            await task
        return _DISCONNECTED
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _line(payload: dict) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode() + b"\n"
