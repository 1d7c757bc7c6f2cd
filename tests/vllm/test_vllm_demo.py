"""`mtp-fsm demo --backend vllm`: the embedded demo's frames and summary, scheduled by vLLM."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from mtp_fsm import cli  # noqa: E402


def _frames(path):
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return sorted((r["request_id"], r["frame_index"], r["codes"]) for r in records if r["type"] == "frame")


def test_demo_backend_vllm_prints_the_same_summary_and_frames_as_the_embedded_demo(tmp_path, capsys):
    args = ["demo", "--requests", "4", "--max-frames", "10", "--max-slots", "2", "--no-progress"]
    assert cli.main([*args, "--out", str(tmp_path / "embedded")]) == 0
    embedded = capsys.readouterr().out
    assert cli.main([*args, "--out", str(tmp_path / "vllm"), "--backend", "vllm"]) == 0
    captured = capsys.readouterr()
    assert "vLLM 0.32" in captured.err
    labels = [line.split("  ")[0] for line in embedded.splitlines() if not line.startswith("wrote")]
    assert labels == [line.split("  ")[0] for line in captured.out.splitlines() if not line.startswith("wrote")]
    assert "frames                    " in captured.out and "preemptions" in captured.out
    assert _frames(tmp_path / "vllm" / "frames.jsonl") == _frames(tmp_path / "embedded" / "frames.jsonl")
    assert (tmp_path / "vllm" / "states.png").read_bytes()[:4] == b"\x89PNG"


def test_demo_backend_vllm_refuses_the_built_in_preemption_policy(tmp_path, capsys):
    rc = cli.main(["demo", "--backend", "vllm", "--preempt-after", "2", "--out", str(tmp_path)])
    assert rc == 2 and "vLLM preempts" in capsys.readouterr().err
