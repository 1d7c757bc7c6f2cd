"""The speech API over the embedded loop, through a real HTTP client on loopback: 16 concurrent streams with
the offline engine's frames, WAV / PCM / SSE, disconnects, bad bodies, auth, limits, a model fault, metrics."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
import wave

import httpx
import numpy as np
import pytest

from api_util import FAULT_PREFIX, TALKER, decoded_pcm16, offline_codes, request_for
from mtp_fsm.api.app import build_embedded_app, load_embedded_backend
from mtp_fsm.api.limits import Limits
from mtp_fsm.api.loopback import LoopbackServer
from mtp_fsm.lifecycle import FinishReason

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = Limits(max_input_chars=200, max_new_tokens=64, max_concurrent=16)
TEXTS = ("Hello there.", "Short.", "Numbers: one two three.", "Good morning, everyone.")
LONG_TEXT = "A longer sentence to speak, with a comma."  # runs 42 frames on the tiny talker before EOS
SAMPLES_PER_FRAME = 1920


@pytest.fixture(scope="module")
def server():
    backend = load_embedded_backend(TALKER, max_slots=16, kernels="torch")
    app = build_embedded_app(backend, limits=LIMITS, api_keys=[KEY])
    with LoopbackServer(app) as srv:
        srv.backend = backend
        yield srv


def run(coro):
    return asyncio.run(coro)


def client(server, **kw) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120, **kw)


def body(i: int, **extra) -> dict:
    b = {"input": TEXTS[i % len(TEXTS)], "seed": 1000 + i, "max_new_tokens": 6 + i % 3}
    if i % 3 == 1:
        b["voice"] = "vivian"
    if i % 5 == 2:
        b["language"] = "english"
    return {**b, **extra}


async def read_stream(c: httpx.AsyncClient, b: dict) -> dict:
    """One streamed request: its codes (NDJSON / SSE codes) or int16 PCM, end record, headers."""
    out = {"codes": [], "pcm": b"", "end": None}
    async with c.stream("POST", "/v1/audio/speech", json=b) as r:
        assert r.status_code == 200, (r.status_code, await r.aread())
        out["headers"] = r.headers
        if b.get("stream_format") == "sse":
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if event["type"] == "speech.audio.delta":
                    out["pcm"] += base64.b64decode(event["audio"])
                elif event["type"] == "speech.codes.delta":
                    assert event["index"] == len(out["codes"])
                    out["codes"] += event["codes"]
                elif event["type"] == "speech.audio.done":
                    out["end"] = event
                else:
                    raise AssertionError(f"unexpected SSE event {event}")
        elif b["response_format"] == "codes":
            async for line in r.aiter_lines():
                if line:
                    record = json.loads(line)
                    if "codes" in record:
                        assert record["index"] == len(out["codes"])
                        out["codes"].append(record["codes"])
                    else:
                        out["end"] = record
        else:
            async for chunk in r.aiter_bytes():
                out["pcm"] += chunk
    return out


def test_health_is_open_and_the_api_needs_the_key(server):
    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as bare:
            assert (await bare.get("/health")).json() == {"status": "ok"}
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
                r = await bare.post("/v1/audio/speech", json=body(0), headers=headers)
                assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
                assert r.json()["error"]["type"] == "authentication_error"
    run(go())


def test_16_concurrent_streams_carry_the_offline_engines_frames(server):
    formats = ({"response_format": "codes"}, {"response_format": "pcm"},
               {"response_format": "codes", "stream_format": "sse"}, {"response_format": "pcm", "stream_format": "sse"})
    bodies = [body(i, stream=True, **formats[i % 4]) for i in range(16)]

    async def go():
        async with client(server) as c:
            return await asyncio.gather(*(read_stream(c, b) for b in bodies))

    results = run(go())
    ids = [r["headers"]["x-request-id"] for r in results]
    assert len(set(ids)) == 16
    want = offline_codes([request_for(rid, b) for rid, b in zip(ids, bodies)])
    for rid, b, got in zip(ids, bodies, results):
        codes, reason = want[rid]
        if got["end"] is not None:  # raw PCM carries samples only: its length says the frame count
            assert got["end"]["finish_reason"] == reason
            assert got["end"]["usage"]["frames"] == len(codes)
        if b["response_format"] == "codes":
            assert got["codes"] == codes, rid
        if b["response_format"] == "pcm":
            pcm = np.frombuffer(got["pcm"], dtype="<i2")
            reference = decoded_pcm16(codes)
            assert len(pcm) == len(codes) * SAMPLES_PER_FRAME == len(reference)
            # Chunked decode == whole decode to ~1e-6: at most one step of 16-bit rounding apart.
            assert np.abs(pcm.astype(np.int32) - reference).max() <= 1, rid
            assert int(got["headers"]["x-sample-rate"]) == 24000


def test_sse_codes_deltas_carry_the_frames(server):
    b = body(3, stream=True, response_format="codes", stream_format="sse", max_new_tokens=5)

    async def go():
        async with client(server) as c:
            async with c.stream("POST", "/v1/audio/speech", json=b) as r:
                return r.headers["x-request-id"], [json.loads(x[6:]) async for x in r.aiter_lines() if x.startswith("data: ")]

    rid, events = run(go())
    codes = [row for e in events if e["type"] == "speech.codes.delta" for row in e["codes"]]
    assert events[-1]["type"] == "speech.audio.done"
    assert codes == offline_codes([request_for(rid, b)])[rid][0]


def test_a_wav_response_is_a_valid_file_of_the_requests_audio(server):
    b = body(1, max_new_tokens=7)

    async def go():
        async with client(server) as c:
            return await c.post("/v1/audio/speech", json=b)

    r = run(go())
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    rid = r.headers["x-request-id"]
    codes, reason = offline_codes([request_for(rid, b)])[rid]
    assert r.headers["x-finish-reason"] == reason and r.headers["x-seed"] == str(b["seed"])
    with wave.open(io.BytesIO(r.content)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 24000)
        pcm = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
    assert len(pcm) == len(codes) * SAMPLES_PER_FRAME
    assert np.abs(pcm.astype(np.int32) - decoded_pcm16(codes)).max() <= 1
    assert np.abs(pcm).max() > 0  # audio, not silence


def _engine_reason(server, rid: str, timeout_s: float = 30.0):
    """How the engine ended a request (its serving metrics; written by the engine thread)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = server.backend.metrics.requests.get(rid)
        if record is not None and record.finish_reason is not None:
            return record.finish_reason, record.num_frames
        time.sleep(0.02)
    raise AssertionError(f"request {rid!r} did not end in the engine within {timeout_s} s")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_aborts_its_request_in_the_engine(server, stream):
    b = {"input": LONG_TEXT, "seed": 7, "max_new_tokens": 60, "stream": stream,
         "response_format": "pcm" if stream else "wav"}

    before = set(server.backend.metrics.requests)

    def new_request() -> str | None:
        new = set(server.backend.metrics.requests) - before
        return next(iter(new)) if new else None

    async def go():
        async with client(server) as c:
            if stream:
                async with c.stream("POST", "/v1/audio/speech", json=b) as r:
                    assert r.status_code == 200
                    rid = r.headers["x-request-id"]
                    async for _ in r.aiter_bytes():
                        break  # first audio, then hang up
                return rid
            task = asyncio.ensure_future(c.post("/v1/audio/speech", json=b))
            deadline = time.monotonic() + 30
            while new_request() is None and time.monotonic() < deadline:  # until it is in the engine
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            task.cancel()
            return new_request()

    rid = run(go())
    reason, frames = _engine_reason(server, rid)
    assert reason is FinishReason.ABORT and frames < 42  # it would have run 42 frames to its EOS

    async def metrics():
        async with client(server) as c:
            return (await c.get("/metrics")).text

    text = run(metrics())
    assert 'mtp_fsm_speech_aborts_total{reason="client_disconnect"}' in text
    assert 'mtp_fsm_speech_engine_ends_total{reason="abort"}' in text  # the engine's own word for it


@pytest.mark.parametrize("payload, status, param", [
    (b"not json", 400, "body"),
    (b"[1, 2]", 400, "body"),
    (b"{}", 400, "input"),
    (b'{"input": "   "}', 400, "input"),
    (b'{"input": 5}', 400, "input"),
    (b'{"input": "hi", "voise": "vivian"}', 400, "voise"),
    (b'{"input": "hi", "speed": 1.5}', 400, "speed"),
    (b'{"input": "hi", "response_format": "mp3"}', 400, "response_format"),
    (b'{"input": "hi", "stream": true, "response_format": "wav"}', 400, "response_format"),
    (b'{"input": "hi", "stream": "yes"}', 400, "stream"),
    (b'{"input": "hi", "stream_format": "sse"}', 400, "stream_format"),
    (b'{"input": "hi", "seed": 1.5}', 400, "seed"),
    (b'{"input": "hi", "max_new_tokens": 0}', 400, "max_new_tokens"),
    (b'{"input": "hi", "voice": "nobody"}', 400, "voice"),
    (b'{"input": "hi", "language": "klingon"}', 400, "language"),
    (b'{"input": "hi", "model": "other-model"}', 404, "model"),
    (b'{"input": "' + b"x" * 201 + b'"}', 413, "input"),
    (b'{"input": "hi", "max_new_tokens": 65}', 413, "max_new_tokens"),
])
def test_bad_requests_are_refused_naming_the_field(server, payload, status, param):
    async def go():
        async with client(server) as c:
            return await c.post("/v1/audio/speech", content=payload, headers={"Content-Type": "application/json"})

    r = run(go())
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}:"), error
    assert error["request_id"].startswith("speech-")


def test_past_the_stream_limit_a_request_gets_429_and_the_others_go_on(server):
    b = {"input": LONG_TEXT, "seed": 3, "max_new_tokens": 60, "stream": True, "response_format": "pcm"}

    async def go():
        async with client(server) as c:
            streams = [c.stream("POST", "/v1/audio/speech", json=b) for _ in range(LIMITS.max_concurrent)]
            opened = [await s.__aenter__() for s in streams]
            try:
                assert all(r.status_code == 200 for r in opened)
                refused = await c.post("/v1/audio/speech", json=body(0))
            finally:
                for s in streams:
                    await s.__aexit__(None, None, None)
            return refused

    refused = run(go())
    assert refused.status_code == 429, refused.text
    assert "16 requests are in flight" in refused.json()["error"]["message"]
    deadline = time.monotonic() + 30  # the hung-up streams are aborted; then there is room again
    while server.backend.metrics.num_finished < len(server.backend.metrics.requests) and time.monotonic() < deadline:
        time.sleep(0.05)

    async def again():
        async with client(server) as c:
            return await c.post("/v1/audio/speech", json=body(0, response_format="codes"))

    assert run(again()).status_code == 200


def test_a_model_fault_fails_that_request_with_500_and_the_others_complete(server):
    bodies = [body(i, response_format="codes") for i in range(3)]
    bad = {"input": f"{FAULT_PREFIX}: this prompt is NaN", "seed": 5, "max_new_tokens": 6}

    async def go():
        async with client(server) as c:
            posts = [c.post("/v1/audio/speech", json=b) for b in bodies]
            streamed = read_error_stream(c, {**bad, "stream": True, "response_format": "pcm"})
            return await asyncio.gather(c.post("/v1/audio/speech", json=bad), streamed, *posts)

    async def read_error_stream(c, b):
        async with c.stream("POST", "/v1/audio/speech", json=b) as r:
            return r.status_code, json.loads(await r.aread())

    whole, (stream_status, stream_error), *good = run(go())
    assert whole.status_code == 500 and whole.json()["error"]["code"] == "model_fault"
    assert "a logit is NaN" in whole.json()["error"]["message"] or "NaN" in whole.json()["error"]["message"]
    assert stream_status == 500 and stream_error["error"]["code"] == "model_fault"
    ids = [r.headers["x-request-id"] for r in good]
    want = offline_codes([request_for(rid, b) for rid, b in zip(ids, bodies)])
    for rid, r in zip(ids, good):
        assert r.status_code == 200 and r.json()["frames"] == want[rid][0]

    async def health():
        async with client(server) as c:
            return (await c.get("/health")).json()

    assert run(health()) == {"status": "ok"}


def test_metrics_count_first_audio_frames_and_refusals_by_reason(server):
    async def go():
        async with client(server) as c:
            assert (await c.post("/v1/audio/speech", json=body(2, response_format="pcm"))).status_code == 200
            assert (await c.post("/v1/audio/speech", json=body(2, speed=2.0))).status_code == 400
            assert (await c.post("/v1/audio/speech", json=body(2), headers={"Authorization": "Bearer no"})).status_code == 401
            return (await c.get("/metrics")).text

    text = run(go())

    def value(prefix: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))

    assert value("mtp_fsm_speech_time_to_first_audio_seconds_count") >= 1
    assert value("mtp_fsm_speech_real_time_factor_count") >= 1
    assert value("mtp_fsm_speech_frames_total") >= 6
    assert value("mtp_fsm_speech_audio_seconds_total") > 0
    assert value('mtp_fsm_speech_requests_finished_total{reason="eos"}') + value(
        'mtp_fsm_speech_requests_finished_total{reason="length"}') >= 1
    assert value('mtp_fsm_speech_failures_total{reason="unsupported_speed",status="400"}') >= 1
    assert value('mtp_fsm_speech_failures_total{reason="unauthorized",status="401"}') >= 1
    assert value("mtp_fsm_speech_requests_active") == 0 and value("mtp_fsm_speech_requests_queued") == 0
