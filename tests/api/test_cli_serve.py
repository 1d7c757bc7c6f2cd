"""`mtp-fsm serve` and `mtp-fsm --version`: the command serves the speech API (a subprocess on loopback),
refuses bad settings with one line, and shuts down cleanly on Ctrl-C."""

from __future__ import annotations

import io
import signal
import socket
import subprocess
import sys
import time
import wave

import httpx
import pytest

from mtp_fsm.api.server import package_version
from mtp_fsm.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"mtp-fsm {package_version()}"


@pytest.mark.parametrize("argv, message", [
    (["--api-server-count", "2"], "--api-server-count is for --backend vllm"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--model", "no_such_talker"], "no_such_talker"),
])
def test_bad_settings_are_one_line_and_exit_2(capsys, argv, message):
    assert main(["serve", "--backend", "embedded", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mtp-fsm serve: error:") and message in err


def test_mtp_fsm_serve_embedded_answers_and_stops_on_ctrl_c(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mtp_fsm.cli", "serve", "--backend", "embedded", "--port", str(port),
                             "--max-slots", "2", "--api-key", "k", "--log-level", "warning"], stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        r = httpx.post(f"{url}/v1/audio/speech", json={"input": "Hello there.", "max_new_tokens": 4, "seed": 1},
                       headers={"Authorization": "Bearer k"}, timeout=60)
        assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
        with wave.open(io.BytesIO(r.content)) as wav:
            assert wav.getnframes() == 4 * 1920 or r.headers["x-finish-reason"] == "eos"
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
        log.close()
    assert code == 0, (tmp_path / "serve.log").read_text()
    assert "Traceback" not in (tmp_path / "serve.log").read_text()
