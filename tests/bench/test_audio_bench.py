"""bench.audio: the audio on / off comparison runs and reports its figures (tiny run)."""

import pytest

from mtp_fsm.bench.audio import bench_audio, markdown_rows


def test_bench_audio_reports_both_sides_and_the_audio_figures():
    lines = []
    r = bench_audio("qwen3_tts", requests=3, max_slots=3, max_frames=6, repeats=1, out=lines.append)
    assert r["frames_per_s_off"] > 0 and r["frames_per_s_on"] > 0
    assert r["ratio"] == pytest.approx(r["frames_per_s_on"] / r["frames_per_s_off"])
    assert r["first_audio_ms_p50"] >= r["first_frame_ms_p50"] > 0  # audio comes after its first frame
    assert r["audio_errors"] == 0 and r["audio_seconds"] > 0 and r["decoder_rtf"] > 0
    assert "audio bench qwen3_tts" in lines[0]
    assert "| qwen3_tts |" in markdown_rows([r])
