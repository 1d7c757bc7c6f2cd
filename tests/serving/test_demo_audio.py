"""`mtp-fsm demo --audio`: one valid WAV per request (sample rate, 16-bit mono, frames x samples per frame),
first-audio latency and real-time factor logged; the WavWriter's own rules."""

import json
import logging
import os
import wave

import pytest
import torch

from mtp_fsm.cli import main
from mtp_fsm.serving.audio_stream import PcmChunk
from mtp_fsm.serving.codec import CodecUnavailableError, load_decoder
from mtp_fsm.serving.wav import WavWriter, pcm16


def audio_frames(model: str, rows: list[list[int]]) -> int:
    """Frames of audio in a request's published rows (Higgs: its delay pattern undone)."""
    if model != "higgs_audio_v3":
        return len(rows)
    eoc, q = 1025, 8
    ends = [i for i, r in enumerate(rows) if r[0] == eoc]
    return ends[0] if ends else max(0, len(rows) - (q - 1))


@pytest.mark.parametrize("model", ["qwen3_tts", "qwen3_omni", "higgs_audio_v3", "voxcpm2"])
def test_demo_writes_one_wav_per_request(model, tmp_path, caplog):
    try:
        decoder = load_decoder(model)
    except CodecUnavailableError as exc:
        pytest.skip(str(exc))
    out = tmp_path / model
    with caplog.at_level(logging.INFO):
        rc = main(["demo", "--audio", "--model", model, "--requests", "3", "--max-slots", "2", "--max-frames", "20",
                   "--out", str(out), "--no-progress"])
    assert rc == 0
    rows: dict[str, list[list[int]]] = {}
    for line in (out / "frames.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["type"] == "frame":
            rows.setdefault(record["request_id"], []).append(record["codes"][:8])
    assert sorted(os.listdir(out / "audio")) == ["req-000.wav", "req-001.wav", "req-002.wav"]
    for rid in ("req-000", "req-001", "req-002"):
        with wave.open(str(out / "audio" / f"{rid}.wav"), "rb") as wav:
            assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, decoder.sample_rate)
            n = audio_frames(model, rows.get(rid, []))
            assert n > 0 and wav.getnframes() == n * decoder.samples_per_frame, rid
    text = caplog.text
    assert "first audio from arrival: p50" in text and "real-time factor: decoder" in text and "0 failed" in text


def test_demo_audio_refuses_a_talker_without_a_decoder(tmp_path, capsys):
    assert main(["demo", "--audio", "--model", "moss_tts_local", "--out", str(tmp_path), "--no-progress"]) == 2
    assert "talker 'moss_tts_local' has no audio output" in capsys.readouterr().err


def test_demo_audio_is_embedded_only(tmp_path, capsys):
    assert main(["demo", "--audio", "--backend", "vllm", "--out", str(tmp_path), "--no-progress"]) == 2
    assert "--audio runs on the embedded backend only" in capsys.readouterr().err


def test_wav_writer_streams_and_removes_unended_files(tmp_path):
    writer = WavWriter(str(tmp_path), 8000)
    writer.on_audio(PcmChunk("a/b", 0, 0, torch.tensor([0.0, 0.5, -2.0]), False))
    writer.on_audio(PcmChunk("left", 0, 0, torch.tensor([0.1]), False))
    writer.on_audio(PcmChunk("a/b", 1, 3, torch.tensor([1.0]), True))
    writer.close()
    assert sorted(os.listdir(tmp_path)) == ["a_b.wav"]  # the unended stream left nothing
    with wave.open(writer.paths["a/b"], "rb") as wav:
        assert wav.getframerate() == 8000 and wav.readframes(4) == pcm16(torch.tensor([0.0, 0.5, -1.0, 1.0]))
    assert pcm16(torch.tensor([0.5])) == (16384).to_bytes(2, "little", signed=True)
