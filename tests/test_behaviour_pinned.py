"""Behaviour pinned across host-side refactors: each talker's demo `frames.jsonl` (frames, finishes and
the step each landed in, with chunked prefill and preemption), the speculative demo and the vLLM route
hash to what was recorded in tests/fixtures/pinned_demo_frames.json before the host redesign.

Regenerate (only for an intended change of behaviour, saying why in the commit):
    .venv/bin/python tests/test_behaviour_pinned.py
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

FIXTURE = Path(__file__).parent / "fixtures" / "pinned_demo_frames.json"
TALKERS = ("qwen3_tts", "qwen3_omni", "moss_tts_local", "chatterbox", "higgs_audio_v3", "voxcpm2", "mtp_lm")
COMMON = ["--requests", "6", "--max-slots", "4", "--max-frames", "12", "--token-budget", "48", "--prefill-chunk", "8",
          "--kernels", "torch", "--no-progress"]
EMBEDDED = ["--preempt-after", "2"]  # the built-in scheduler preempts; under vLLM, vLLM does
RUNS = {**{name: ["--model", name, *EMBEDDED] for name in TALKERS},
        "mtp_lm_speculative": ["--model", "mtp_lm", "--speculate", "2", *EMBEDDED],
        "scripted": ["--model", "mtp_fsm.serving.model_loader:scripted_talker", *EMBEDDED]}
VLLM_RUNS = {"qwen3_tts_vllm": ["--model", "qwen3_tts", "--backend", "vllm"]}


def demo_digest(args: list[str], out: Path) -> str:
    from mtp_fsm.cli import main

    assert main(["demo", *args, *COMMON, "--out", str(out)]) == 0
    return hashlib.sha256((out / "frames.jsonl").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def pinned() -> dict[str, str]:
    return json.loads(FIXTURE.read_text())


@pytest.mark.parametrize("name", list(RUNS))
def test_demo_frames_are_the_recorded_ones(name, pinned, tmp_path):
    assert demo_digest(RUNS[name], tmp_path) == pinned[name]


@pytest.mark.parametrize("name", list(VLLM_RUNS))
def test_vllm_route_frames_are_the_recorded_ones(name, pinned, tmp_path):
    assert demo_digest(VLLM_RUNS[name], tmp_path) == pinned[name]


if __name__ == "__main__":
    import tempfile

    digests = {}
    for name, args in {**RUNS, **VLLM_RUNS}.items():
        with tempfile.TemporaryDirectory() as out:
            digests[name] = demo_digest(args, Path(out))
            print(name, digests[name], file=sys.stderr)
    FIXTURE.write_text(json.dumps(digests, indent=2, sort_keys=True) + "\n")
