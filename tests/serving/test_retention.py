"""Bounded retention in a long-running server (ServingMetrics, ChunkingSink) and first-audio
metrics for requests that produce no audio."""

import pytest
import torch

from mtp_fsm._util.stats import percentile
from mtp_fsm.engine import FinishedRequest, FrameBatch
from mtp_fsm.lifecycle import FinishReason
from mtp_fsm.serving import ChunkingSink, FrameOrderError, ServingMetrics
from serving_util import FakeClock, loop, request


def _run(n, *, metrics, chunker=None, eos_every=None, **loop_kwargs):
    serving, sink = loop(sinks=(chunker,) if chunker is not None else (), clock=FakeClock(), metrics=metrics,
                         **loop_kwargs)
    assert serving.metrics is metrics
    for i in range(n):
        eos = 0 if eos_every and i % eos_every == 0 else None
        serving.submit(request(f"r{i}", prompt_len=2 + i % 4, eos_at=eos, max_frames=1 + i % 5, seed=i))
    steps = serving.run_until_idle()
    return serving, sink, steps


def test_metrics_keep_a_window_and_exact_running_totals():
    chunker = ChunkingSink(lambda c: None, first_chunk=2, chunk=3, num_codebooks=4)
    full = ServingMetrics()  # a window larger than the run: the ground truth
    m = ServingMetrics(max_steps=5, max_finished=4)
    _, sink, steps = _run(30, metrics=full, chunker=ChunkingSink(lambda c: None, num_codebooks=4), eos_every=7,
                          max_slots=2, preempt_after_steps=1)
    serving, sink2, steps2 = _run(30, metrics=m, chunker=chunker, eos_every=7, max_slots=2, preempt_after_steps=1)
    assert steps2 == steps and sink2.frames == sink.frames  # same run (the clock is fake)
    assert len(m.steps) == 5 and [s.step for s in m.steps] == list(range(steps - 5, steps))
    last_finished = sorted(full.requests.values(), key=lambda r: r.finish_time)[-4:]
    assert set(m.requests) == {r.request_id for r in last_finished}
    s, f = m.summary(), full.summary()
    # Totals are over the whole run, whatever the window.
    for field in ("num_requests", "num_steps", "total_frames", "finished_by_reason", "preemptions", "wall_s"):
        assert getattr(s, field) == getattr(f, field), field
    assert s.num_requests == 30 and sum(s.finished_by_reason.values()) == 30 and s.preemptions > 0
    assert s.preemptions == serving.engine.scheduler.num_preemptions
    assert s.total_frames == sum(len(v) for v in sink2.frames.values())
    # Percentiles are over the retained finished requests, and say so.
    assert s.latency_window == 4 and f.latency_window == 30
    window = [m.requests[rid] for rid in m.requests]
    ff = [r.first_frame_ms for r in window if r.first_frame_ms is not None]
    assert s.first_frame_ms_p50 == (percentile(ff, 50) if ff else None)
    assert ("latency percentiles over", "the last 4 finished requests") in s.rows()
    assert all(len(v) == 5 for v in m.state_history().values())
    assert m.retained() == {"requests": 4, "steps": 5}


def test_metrics_window_zero_and_validation():
    m = ServingMetrics(max_steps=0, max_finished=0)
    serving, _, steps = _run(6, metrics=m)
    assert m.requests == {} and len(m.steps) == 0
    s = m.summary()
    assert s.num_requests == 6 and s.num_steps == steps and s.first_frame_ms_p50 is None and s.latency_window == 0
    for bad in (-1, 1.5, None):
        with pytest.raises(ValueError, match="max_steps"):
            ServingMetrics(max_steps=bad)
        with pytest.raises(ValueError, match="max_finished"):
            ServingMetrics(max_finished=bad)


def test_a_second_finish_is_not_counted_twice():
    m = ServingMetrics()
    m.on_submit("a", 0.0)
    m.on_finished("a", FinishReason.EOS, 1.0)
    m.on_finished("a", FinishReason.ABORT, 2.0)
    assert m.num_finished == 1 and m.finished_by_reason == {"eos": 1} and m.requests["a"].finish_time == 1.0


def test_plot_of_a_long_run_says_which_steps_it_shows(tmp_path, monkeypatch):
    from mtp_fsm.serving import plots

    m = ServingMetrics(max_steps=3)
    _run(4, metrics=m)
    titles = []
    from matplotlib.axes import Axes

    monkeypatch.setattr(Axes, "set_title", lambda self, t, *a, **k: titles.append(t))
    plots.plot_states(m, tmp_path / "s.png", title="run")
    assert titles == [f"run (last 3 of {m.num_steps} steps)"] and (tmp_path / "s.png").exists()


def _batch(rid, index, q=2):
    return FrameBatch((rid,), torch.tensor([index]), torch.full((1, q), index, dtype=torch.int64))


def test_chunking_sink_drops_finished_streams_and_remembers_a_bounded_window():
    chunks = []
    sink = ChunkingSink(chunks.append, first_chunk=2, chunk=2, left_context=2, num_codebooks=2, max_closed=3)
    for r in range(10):
        rid = f"r{r}"
        for i in range(3):
            sink.on_frames(0, _batch(rid, i))
        assert sink.retained()["streams"] == 1
        sink.on_finished(1, FinishedRequest(rid, FinishReason.LENGTH if r % 2 else FinishReason.ABORT, 3))
        assert sink.retained()["streams"] == 0  # final chunk out (or dropped by the abort): nothing kept
    assert sink.retained() == {"streams": 0, "closed": 3}
    # Within the window, late frames and a second finish are still named ...
    with pytest.raises(FrameOrderError, match=r"'r9'.*after the request finished"):
        sink.on_frames(2, _batch("r9", 3))
    with pytest.raises(FrameOrderError, match="finished twice"):
        sink.on_finished(2, FinishedRequest("r9", FinishReason.LENGTH, 3))
    sink.on_frames(2, _batch("r8", 3))  # ... and frames in flight after an abort are dropped
    assert [c.request_id for c in chunks].count("r8") == 1  # its first chunk only
    with pytest.raises(ValueError, match="max_closed"):
        ChunkingSink(chunks.append, max_closed=-1)


def test_eos_first_request_has_no_first_audio():
    chunks = []
    chunker = ChunkingSink(chunks.append, first_chunk=2, chunk=3)
    m = ServingMetrics()
    _run(6, metrics=m, chunker=chunker, eos_every=2)  # r0, r2, r4: EOS as their first sample
    silent = ["r0", "r2", "r4"]
    for rid in silent:
        rm = m.requests[rid]
        assert rm.num_frames == 0 and rm.finish_reason is FinishReason.EOS
        assert rm.first_frame_time is None and rm.first_chunk_time is None
        (end,) = [c for c in chunks if c.request_id == rid]
        assert end.is_final and not end.has_audio and len(end.frames) == 0  # the vocoder still sees the end
    audible = [m.requests[rid] for rid in m.requests if rid not in silent]
    assert all(r.first_chunk_time is not None and r.first_chunk_time <= r.finish_time for r in audible)
    s = m.summary()
    fc = [r.first_chunk_ms for r in audible]
    assert (s.first_chunk_ms_p50, s.first_chunk_ms_p95) == (percentile(fc, 50), percentile(fc, 95))


def test_first_audio_in_a_final_chunk_is_timed_before_the_finish():
    # 1 frame, first chunk of 2: the request's only audio is its final chunk.
    chunker = ChunkingSink(lambda c: None, first_chunk=2, chunk=3)
    m = ServingMetrics()
    serving, _, _ = _run(1, metrics=m, chunker=chunker)  # r0: max_frames 1
    rm = m.requests["r0"]
    assert rm.num_frames == 1 and rm.first_frame_time < rm.first_chunk_time < rm.finish_time


def test_metrics_on_chunk_ignores_empty_chunks():
    m = ServingMetrics()
    m.on_submit("a", 0.0)
    m.on_chunk("a", 1.0, num_frames=0)
    assert m.requests["a"].first_chunk_time is None
    m.on_chunk("a", 2.0, num_frames=2)
    m.on_chunk("a", 3.0, num_frames=2)
    assert m.requests["a"].first_chunk_time == 2.0


def test_serving_loop_preempt_passes_through():
    serving, sink = loop(max_slots=2)
    serving.submit(request("a", max_frames=6))
    assert not serving.preempt("a")  # queued: nothing to preempt
    serving.step()
    assert serving.preempt("a")
    serving.run_until_idle()
    assert serving.engine.scheduler.num_preemptions == 1 and sink.finished["a"].reason is FinishReason.LENGTH
    assert len(sink.codes("a")) == 6


def test_first_frame_from_received_counts_the_wait_before_submit():
    m = ServingMetrics()
    m.on_submit("a", 2.0, received=1.5)  # taken in a batch at 1.5, submitted after the others' admission
    m.on_submit("b", 2.0)
    m.on_frame("a", 3.0)
    m.on_frame("b", 3.0)
    assert m.requests["a"].first_frame_from_received_ms == 1500.0 and m.requests["a"].first_frame_ms == 1000.0
    assert m.requests["b"].first_frame_from_received_ms == m.requests["b"].first_frame_ms == 1000.0
    with pytest.raises(ValueError, match="'c': received at 3.0, after its submit at 2.0"):
        m.on_submit("c", 2.0, received=3.0)
