"""bench.serving: the client-side serving table runs end to end (tiny run) and reports its target."""

from mtp_fsm.bench.serving import TARGET_CONCURRENCY, bench_serving, serving_section


def test_bench_serving_times_first_audio_at_the_client_against_the_engine():
    lines = []
    r = bench_serving("qwen3_tts", concurrency=(1, 2), max_frames=3, min_requests=2, out=lines.append)
    assert [row["concurrency"] for row in r["rows"]] == [1, 2]
    for row in r["rows"]:
        assert row["requests"] >= 2 and row["streams_per_s"] > 0
        # First audio at the client comes after the engine's first frame (which starts later, at admission).
        assert row["ttfa_ms_p95"] >= row["ttfa_ms_p50"] > 0 and row["engine_first_frame_ms_p50"] > 0
        # The engine's thread takes a request before (or as) it submits it: from receipt is never shorter.
        assert row["engine_first_frame_ms_p50"] >= row["engine_first_frame_from_submit_ms_p50"] > 0
    assert r["target"]["concurrency"] == TARGET_CONCURRENCY and r["target"]["met"] is None  # 8 was not run
    table = serving_section(r)
    assert "| 2 | " in table and "unresolved" in table
