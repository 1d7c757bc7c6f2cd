"""ServingLoop: client errors stay local, metrics and summary, chunk timing hook."""

import pytest

from mtp_fsm.errors import DuplicateRequestError
from mtp_fsm.lifecycle import FinishReason
from mtp_fsm.serving import STATE_COLUMNS, ChunkingSink
from mtp_fsm.testing import ScriptInputs
from mtp_fsm.engine import NewRequest
from serving_util import FakeClock, loop, request


def _good(n=3):
    return [request(f"g{i}", prompt_len=4 + i, max_frames=4, seed=i) for i in range(n)]


def _reference_frames():
    serving, sink = loop(max_slots=4)
    for req in _good():
        serving.submit(req)
    serving.run_until_idle(max_steps=100)
    return sink.frames


def test_bad_field_rejected_at_submit_others_unaffected():
    serving, sink = loop(max_slots=4)
    reqs = _good()
    assert serving.submit(reqs[0])
    assert not serving.submit(request("bad", max_frames=0))
    assert not serving.submit(request("wide", sampling_width=2))
    for req in reqs[1:]:
        assert serving.submit(req)
    serving.run_until_idle(max_steps=100)
    assert sink.finished["bad"].reason is FinishReason.ERROR
    assert "max_frames must be an int in [1, " in serving.metrics.requests["bad"].error
    assert "sampling width 2" in sink.finished["wide"].detail
    assert sink.frames == _reference_frames()


def test_prompt_problems_reject_only_that_request():
    # Too long for the context and empty: only the prepared prompt shows these. The engine
    # prepares a request when it is queued, so submit reports them, between good requests
    # that are served as if the bad ones had never been sent.
    serving, sink = loop(max_slots=4)
    good = _good()
    assert serving.submit(good[0])
    assert not serving.submit(request("long", prompt_len=200))
    assert serving.submit(good[1])
    assert not serving.submit(NewRequest("empty", ScriptInputs(prompt=()), max_frames=3))
    assert serving.submit(good[2])
    assert list(serving.engine.ledger.queued) == ["g0", "g1", "g2"]
    serving.run_until_idle(max_steps=100)
    for rid, what in (("long", "does not fit the context"), ("empty", "prompt is empty")):
        assert sink.finished[rid].reason is FinishReason.ERROR and sink.finished[rid].num_frames == 0
        assert what in serving.metrics.requests[rid].error
    assert sink.frames == _reference_frames()
    assert serving.metrics.summary().finished_by_reason["error"] == 2


def test_inputs_the_model_cannot_prepare_are_rejected():
    serving, sink = loop()
    assert not serving.submit(NewRequest("junk", ScriptInputs(prompt=("x",)), max_frames=3))
    assert "inputs rejected by the model: TypeError" in serving.metrics.requests["junk"].error
    assert serving.step() is None and sink.finished["junk"].reason is FinishReason.ERROR


def test_duplicate_id_raises_and_keeps_the_first():
    serving, sink = loop()
    serving.submit(request("a"))
    with pytest.raises(DuplicateRequestError, match="'a'.*unique"):
        serving.submit(request("a", prompt_len=9))
    serving.run_until_idle(max_steps=50)
    with pytest.raises(DuplicateRequestError, match="'a'"):
        serving.submit(request("a"))  # finished ids stay taken: metrics are keyed by them
    assert list(sink.finished) == ["a"]


def test_metrics_summary_and_state_history():
    chunks = []
    chunker = ChunkingSink(chunks.append, first_chunk=2, chunk=3, left_context=2)
    serving, sink = loop(max_slots=2, sinks=(chunker,), clock=FakeClock())
    for i in range(5):
        serving.submit(request(f"r{i}", eos_at=None if i != 4 else 0, max_frames=5))
    steps = serving.run_until_idle()
    m = serving.metrics
    summary = m.summary()
    assert summary.num_steps == steps == len(m.steps)
    assert summary.total_frames == sum(len(v) for v in sink.frames.values()) == sum(s.num_frames for s in m.steps)
    assert summary.frames_per_s > 0 and summary.wall_s > 0
    assert sum(summary.finished_by_reason.values()) == 5
    with_frames = [rid for rid in sink.frames]
    for rid in with_frames:
        rm = m.requests[rid]
        assert rm.first_frame_ms > 0 and rm.num_frames == len(sink.frames[rid])
        assert rm.first_chunk_ms >= rm.first_frame_ms
    # EOS first: an empty final chunk reaches the vocoder as the end of the stream, but it is no audio
    assert m.requests["r4"].first_frame_time is None and m.requests["r4"].first_chunk_time is None
    (empty,) = [c for c in chunks if c.request_id == "r4"]
    assert empty.is_final and not empty.has_audio
    assert summary.first_frame_ms_p50 <= summary.first_frame_ms_p95
    assert summary.first_chunk_ms_p50 is not None
    history = m.state_history()
    assert set(history) == set(STATE_COLUMNS) and all(len(v) == steps for v in history.values())
    assert history["queued"][0] == 3 and history["finished"][-1] == 5
    # every request is counted exactly once per step
    for k in range(steps):
        assert sum(history[name][k] for name in STATE_COLUMNS) == 5
    assert "frames/s" in summary.table() and "first-chunk latency p95" in summary.table()


def test_run_until_idle_respects_max_steps_and_on_step():
    serving, _ = loop()
    serving.submit(request("a", max_frames=10))
    seen = []
    assert serving.run_until_idle(max_steps=3, on_step=lambda out: seen.append(out.step)) == 3
    assert seen == [0, 1, 2] and not serving.idle
    serving.run_until_idle()
    assert serving.idle and serving.step() is None


def test_model_fault_in_one_request_ends_only_that_request():
    serving, sink = loop(max_slots=3)
    good = _good()
    serving.submit(good[0])
    serving.submit(NewRequest("nan", ScriptInputs(prompt=(1, 2, 3), nan_at=1), max_frames=5))
    serving.submit(good[1])
    serving.submit(NewRequest("mtp-nan", ScriptInputs(prompt=(4, 5), mtp_nan_at=2), max_frames=5))
    serving.submit(good[2])
    serving.run_until_idle(max_steps=100)
    assert sink.finished["nan"].reason is FinishReason.ERROR and len(sink.codes("nan")) == 1
    assert sink.finished["mtp-nan"].reason is FinishReason.ERROR and len(sink.codes("mtp-nan")) == 2
    assert {rid: f for rid, f in sink.frames.items() if rid.startswith("g")} == _reference_frames()
    assert serving.idle and serving.engine.num_free_slots == 3
