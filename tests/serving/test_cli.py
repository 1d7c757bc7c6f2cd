"""The mtp-fsm CLI: demo end to end (in-process and as the console script), bench / diagrams pass-through."""

import json
import os
import shutil
import subprocess
import sys
import types

import pytest

from mtp_fsm import cli
from mtp_fsm.serving.model_loader import MODEL_NAMES, SCRIPTED_MODEL, ModelLoadError, load_talker


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
    assert "\rrequests: 100%" in captured.err and "3/3" in captured.err and f"frames={len(frames)}" in captured.err


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
    with pytest.raises(ModelLoadError, match="or an import string"):
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


def _one_error_line(err: str, command: str, *fragments: str) -> None:
    """A user error: exactly one line on stderr, argparse-style, no traceback."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"mtp-fsm {command}: error: "), err
    assert "Traceback" not in err and all(f in lines[0] for f in fragments), err


def test_demo_out_that_is_a_file_or_under_a_file_is_a_user_error(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    base = ["demo", "--requests", "1", "--max-frames", "2", "--model", SCRIPTED_MODEL, "--no-progress"]
    assert cli.main([*base, "--out", str(afile)]) == 2
    _one_error_line(capsys.readouterr().err, "demo", "exists and is not a folder")
    assert cli.main([*base, "--out", str(afile / "sub")]) == 2
    _one_error_line(capsys.readouterr().err, "demo", "cannot create output folder")
    assert cli.main([*base, "--out", ""]) == 2
    _one_error_line(capsys.readouterr().err, "demo", "empty path")
    assert afile.read_text() == "not a folder"


def test_demo_write_failure_mid_run_is_one_line(tmp_path, capsys, monkeypatch):
    import mtp_fsm.serving.plots as plots

    def denied(metrics, path, title=""):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(plots, "plot_states", denied)
    rc = cli.main(["demo", "--requests", "1", "--max-frames", "2", "--model", SCRIPTED_MODEL, "--no-progress",
                   "--out", str(tmp_path / "o")])
    assert rc == 2
    err = capsys.readouterr().err
    banner, rest = err.split("\n", 1)  # the run had started: its banner line, then the error
    assert banner.startswith("mtp-fsm demo: scripted")
    _one_error_line(rest, "demo", "Permission denied", "states.png")


@pytest.mark.parametrize("argv, message", [
    (["--threads", "-1"], "argument --threads: must be an integer >= 0"),
    (["--seed", str(2**64)], "argument --seed: must be a 64-bit integer"),
    (["--seed", "x"], "argument --seed: must be a 64-bit integer"),
    (["--requests", "0"], "argument --requests: must be an integer >= 1"),
    (["--max-frames", "1.5"], "argument --max-frames: must be an integer >= 1"),
    (["--kernels", "cuda"], "argument --kernels: invalid choice"),
])
def test_demo_bad_option_values_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "Traceback" not in err


def test_demo_seed_overflow_and_a_raising_factory_are_user_errors(tmp_path, capsys):
    assert cli.main(["demo", "--seed", str(2**63 - 1), "--requests", "2", "--out", str(tmp_path / "o")]) == 2
    _one_error_line(capsys.readouterr().err, "demo", "overflows a 64-bit seed")
    assert cli.main(["demo", "--model", "os:getcwd", "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    _one_error_line(capsys.readouterr().err, "demo", "'os:getcwd'", "factory raised TypeError")


def test_diagrams_outside_the_repo(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # No README.md here: the diagrams are written, no README is touched.
    assert cli.main(["diagrams", "--out", "d"]) == 0
    assert (tmp_path / "d" / "mtp.mmd").exists() and "no README updated" in capsys.readouterr().out
    # A README without the block (someone else's project) is left alone by default ...
    (tmp_path / "README.md").write_text("# other project\n")
    assert cli.main(["diagrams", "--out", "d"]) == 0
    assert (tmp_path / "README.md").read_text() == "# other project\n"
    capsys.readouterr()
    # ... and named explicitly it is an error, before anything is written.
    assert cli.main(["diagrams", "--out", "d2", "--readme", "README.md"]) == 2
    _one_error_line(capsys.readouterr().err, "diagrams", "no lifecycle-diagram block")
    assert not (tmp_path / "d2").exists()
    assert cli.main(["diagrams", "--out", "d2", "--readme", "missing.md"]) == 2
    _one_error_line(capsys.readouterr().err, "diagrams", "'missing.md' does not exist")


def test_diagrams_unwritable_target_is_a_user_error(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    assert cli.main(["diagrams", "--out", "afile"]) == 2
    _one_error_line(capsys.readouterr().err, "diagrams", "exists and is not a folder")
    assert cli.main(["diagrams", "--out", "afile/sub"]) == 2
    _one_error_line(capsys.readouterr().err, "diagrams", "cannot write", "afile/sub")
    import mtp_fsm.lifecycle.diagrams as diagrams

    def denied(out_dir, svg=None):  # a folder without write access (the tests may run as root)
        raise PermissionError(13, "Permission denied", str(out_dir / "mtp.dot"))

    monkeypatch.setattr(diagrams, "render_all", denied)
    assert cli.main(["diagrams", "--out", "ro"]) == 2
    _one_error_line(capsys.readouterr().err, "diagrams", "Permission denied", "mtp.dot")


def test_bench_bad_threads_or_out_dir_fail_before_benchmarking(tmp_path, capsys, monkeypatch):
    calls = []
    fake = types.ModuleType("mtp_fsm.bench")
    fake.main = lambda argv: calls.append(argv) or 0
    monkeypatch.setitem(sys.modules, "mtp_fsm.bench", fake)
    (tmp_path / "afile").write_text("x")
    assert cli.main(["bench", "--threads", "-1"]) == 2
    _one_error_line(capsys.readouterr().err, "bench", "--threads: must be an integer >= 0")
    assert cli.main(["bench", f"--out-dir={tmp_path / 'afile'}"]) == 2
    _one_error_line(capsys.readouterr().err, "bench", "exists and is not a folder")
    assert cli.main(["bench", "--out-dir", str(tmp_path / "afile" / "x")]) == 2
    _one_error_line(capsys.readouterr().err, "bench", "is not a folder")
    assert calls == []
    assert cli.main(["bench", "--out-dir", str(tmp_path / "new" / "dir"), "--threads", "0"]) == 0
    assert not (tmp_path / "new").exists()  # checked, not created: the bench creates it when it writes


@pytest.mark.parametrize("name", sorted(MODEL_NAMES))
def test_demo_runs_every_talker_of_the_zoo(name, tmp_path):
    """`mtp-fsm demo --model NAME` for every short name (each lifecycle variant's talker):
    every request ends and the JSONL holds exactly the frames the endings count."""
    out = tmp_path / name
    rc = cli.main(["demo", "--requests", "2", "--max-frames", "6", "--max-slots", "2", "--model", name,
                   "--out", str(out), "--no-progress"])
    assert rc == 0
    records = _read_jsonl(out / "frames.jsonl")
    finished = [r for r in records if r["type"] == "finished"]
    assert len(finished) == 2
    assert len([r for r in records if r["type"] == "frame"]) == sum(r["num_frames"] for r in finished) > 0


def test_demo_speculate_publishes_the_plain_frames_and_reports_acceptance(tmp_path, capsys):
    """`mtp-fsm demo --model mtp_lm --speculate 2`: the same frames as --speculate 0 (in
    fewer steps), plus the acceptance line; a model without a drafter is a usage error."""
    frames = {}
    for k in (0, 2):
        out = tmp_path / f"k{k}"
        assert cli.main(["demo", "--requests", "3", "--max-frames", "12", "--max-slots", "2", "--model", "mtp_lm",
                         "--speculate", str(k), "--out", str(out), "--no-progress"]) == 0
        frames[k] = sorted((r["request_id"], r["frame_index"], r["codes"])
                           for r in _read_jsonl(out / "frames.jsonl") if r["type"] == "frame")
    assert frames[0] == frames[2] and frames[0]
    printed = capsys.readouterr().out
    assert "speculation: k=2, acceptance rate" in printed and "frames per verify row" in printed
    rc = cli.main(["demo", "--model", "chatterbox", "--speculate", "2", "--out", str(tmp_path / "x"), "--no-progress"])
    assert rc != 0 and "has no drafter" in capsys.readouterr().err
