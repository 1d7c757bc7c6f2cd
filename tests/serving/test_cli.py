"""The mtp-fsm CLI: demo end to end (in-process and as the console script), bench / diagrams pass-through."""

import json
import os
import shutil
import subprocess
import sys
import types

import pytest

from mtp_fsm import cli
from mtp_fsm.serving.model_loader import SCRIPTED_MODEL, ModelLoadError, load_talker


def _read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_demo_in_process_writes_png_and_jsonl(tmp_path, capsys):
    out = tmp_path / "demo"
    rc = cli.main(["demo", "--requests", "3", "--max-frames", "6", "--max-slots", "2", "--model", SCRIPTED_MODEL,
                   "--out", str(out), "--preempt-after", "1"])
    assert rc == 0
    png = (out / "states.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    records = _read_jsonl(out / "frames.jsonl")
    finished = [r for r in records if r["type"] == "finished"]
    assert sorted(r["request_id"] for r in finished) == ["req-000", "req-001", "req-002"]
    frames = [r for r in records if r["type"] == "frame"]
    assert len(frames) == sum(r["num_frames"] for r in finished)
    captured = capsys.readouterr()
    assert "first-frame latency p50" in captured.out and "preemptions" in captured.out
    assert "\r[" in captured.err and "3/3 done" in captured.err


def test_demo_with_the_default_tiny_qwen3_tts(tmp_path, capsys):
    out = tmp_path / "demo"
    rc = cli.main(["demo", "--requests", "3", "--max-frames", "4", "--max-slots", "2", "--out", str(out),
                   "--no-progress"])
    assert rc == 0 and (out / "states.png").exists()
    finished = [r for r in _read_jsonl(out / "frames.jsonl") if r["type"] == "finished"]
    assert len(finished) == 3 and all(r["reason"] in ("eos", "length") for r in finished)
    assert "qwen3_tts" in capsys.readouterr().err


def test_console_script_runs_the_demo(tmp_path):
    script = shutil.which("mtp-fsm", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("the mtp-fsm console script is not installed next to this interpreter")
    proc = subprocess.run(
        [script, "demo", "--requests", "2", "--max-frames", "3", "--model", SCRIPTED_MODEL,
         "--out", str(tmp_path / "o"), "--no-progress"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "frames/s" in proc.stdout and (tmp_path / "o" / "states.png").exists()


def test_bench_and_diagrams_commands_pass_arguments_through(monkeypatch):
    calls = []
    fake = types.ModuleType("mtp_fsm.bench")
    fake.main = lambda argv: calls.append(("bench", argv)) or 0
    monkeypatch.setitem(sys.modules, "mtp_fsm.bench", fake)
    assert cli.main(["bench", "--quick", "x"]) == 0
    fake_diagrams = types.ModuleType("mtp_fsm.lifecycle.diagrams")
    fake_diagrams.main = lambda argv: calls.append(("diagrams", argv)) or 3
    monkeypatch.setitem(sys.modules, "mtp_fsm.lifecycle.diagrams", fake_diagrams)
    assert cli.main(["diagrams", "--out", "d"]) == 3
    assert calls == [("bench", ["--quick", "x"]), ("diagrams", ["--out", "d"])]


def test_model_import_string_errors_are_clear():
    with pytest.raises(ModelLoadError, match="expected an import string"):
        load_talker("no_colon")
    with pytest.raises(ModelLoadError, match="cannot import 'no_such_pkg_xyz'"):
        load_talker("no_such_pkg_xyz:factory")
    with pytest.raises(ModelLoadError, match="has no attribute 'nope'"):
        load_talker("mtp_fsm.serving.model_loader:nope")


def test_mtp_fsm_never_imports_models_statically():
    root = os.path.dirname(os.path.dirname(cli.__file__))
    offenders = []
    for dirpath, _, files in os.walk(os.path.join(root, "mtp_fsm")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    for line in f:
                        stripped = line.strip()
                        if stripped.startswith(("import models", "from models")):
                            offenders.append(f"{path}: {stripped}")
    assert not offenders, offenders


def test_demo_rejects_bad_settings_with_a_message_not_a_traceback(capsys):
    from mtp_fsm.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["demo", "--max-slots", "0"])
    assert exc.value.code == 2 and "--max-slots: must be an integer >= 1" in capsys.readouterr().err
    assert main(["demo", "--model", "no_such_package:factory", "--no-progress"]) == 2
    assert "cannot import 'no_such_package'" in capsys.readouterr().err
