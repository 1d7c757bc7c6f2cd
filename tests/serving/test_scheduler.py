"""Scheduler policy: token budget, chunk size, FCFS admission, completion, aborts."""

import pytest

from mtp_fsm.engine import StepPlan
from mtp_fsm.lifecycle import FinishReason
from mtp_fsm.serving import Scheduler, SchedulerError
from serving_util import check_bookkeeping, engine, loop, request


def drive(serving, max_steps=500):
    """Step a ServingLoop to idle, recording every plan the engine ran."""
    plans = []
    real_step = serving.engine.step

    def recording(plan: StepPlan):
        out = real_step(plan)
        plans.append(plan)
        return out

    serving.engine.step = recording
    try:
        for _ in range(max_steps):
            if serving.step() is None:
                return plans
            check_bookkeeping(serving)
    finally:
        del serving.engine.step
    raise AssertionError(f"not idle after {max_steps} steps")


def test_token_budget_and_chunk_size_are_respected():
    serving, sink = loop(max_slots=4, token_budget=10, prefill_chunk=4)
    for i in range(6):
        serving.submit(request(f"r{i}", prompt_len=9 + i, max_frames=5))
    plans = drive(serving)
    assert any(sum(s.num_tokens for s in p.rows) == 10 for p in plans)  # the budget binds
    for plan in plans:
        assert sum(s.num_tokens for s in plan.rows) <= 10
        assert all(1 <= s.num_tokens <= 4 for s in plan.rows)
        # decode rows (1 token, prompt done) come before any prefill chunk
        ids = [s.request_id for s in plan.rows]
        assert len(set(ids)) == len(ids)
    for i in range(6):  # the toy model may sample the codec EOS on its own
        assert len(sink.codes(f"r{i}")) == sink.finished[f"r{i}"].num_frames
        assert sink.finished[f"r{i}"].reason in (FinishReason.LENGTH, FinishReason.EOS)


def test_decode_rows_come_first_then_prefill_in_fcfs_order():
    eng = engine(4)
    sched = Scheduler(4, token_budget=6, prefill_chunk=4)
    sched.add(request("a", prompt_len=3, max_frames=9), 3)
    plan = sched.schedule(eng)
    sched.update(eng.step(plan))  # a: whole prompt in one chunk, frame 0
    sched.add(request("b", prompt_len=12), 12)
    sched.add(request("c", prompt_len=12), 12)
    plan = sched.schedule(eng)
    assert [(s.request_id, s.num_tokens) for s in plan.rows] == [("a", 1), ("b", 4), ("c", 1)]
    sched.update(eng.step(plan))
    plan = sched.schedule(eng)
    assert [(s.request_id, s.num_tokens) for s in plan.rows] == [("a", 1), ("b", 4), ("c", 1)]


def test_fcfs_admission_up_to_max_slots_rest_queued_then_admitted():
    serving, sink = loop(max_slots=2, engine_slots=3)  # the scheduler's cap binds before the engine's
    for i in range(5):
        serving.submit(request(f"r{i}", eos_at=2 + i % 2, max_frames=8))
    serving.step()
    assert sorted(serving.engine.requests()) == ["r0", "r1"]
    assert [r.request_id for r in serving.scheduler.queue] == ["r2", "r3", "r4"]
    plans = drive(serving)
    admitted = [r.request_id for p in plans for r in p.new_requests]
    assert admitted == ["r2", "r3", "r4"]  # in submission order
    assert {rid: f.reason for rid, f in sink.finished.items()} == {f"r{i}": FinishReason.EOS for i in range(5)}
    assert serving.engine.num_free_slots == 3 and serving.idle


def test_slot_cap_never_exceeded_and_every_request_finishes():
    serving, sink = loop(max_slots=3, token_budget=7, prefill_chunk=3)
    for i in range(10):
        serving.submit(request(f"r{i}", prompt_len=2 + i % 5, eos_at=(None if i % 3 else 1 + i % 4), max_frames=4 + i % 3))
    holding = []
    serving.run_until_idle(max_steps=300, on_step=lambda out: holding.append(len(serving.engine.requests())))
    assert serving.idle and max(holding) <= 3
    assert sorted(sink.finished) == sorted(f"r{i}" for i in range(10))
    for rid, frames in sink.frames.items():
        assert [i for i, _ in frames] == list(range(len(frames)))
        assert sink.finished[rid].num_frames == len(frames)


def test_abort_of_queued_request_drops_it():
    serving, sink = loop(max_slots=1)
    serving.submit(request("a", max_frames=3))
    serving.submit(request("b", max_frames=3))
    serving.step()
    assert serving.abort("b") == "dropped"
    assert sink.finished["b"].reason is FinishReason.ABORT and sink.finished["b"].num_frames == 0
    plans = drive(serving)
    assert all(s.request_id != "b" for p in plans for s in p.rows) and "b" not in sink.frames
    assert sink.finished["a"].reason is FinishReason.LENGTH


def test_abort_of_running_request():
    serving, sink = loop(max_slots=2)
    serving.submit(request("a", max_frames=20))
    serving.submit(request("b", max_frames=4))
    for _ in range(3):
        serving.step()
    frames_before = len(sink.codes("a"))
    assert serving.abort("a") == "scheduled" and serving.abort("a") == "ignored"  # second one: already aborting
    plan = serving.scheduler.schedule(serving.engine)
    assert plan.aborts == ("a",) and "a" not in {s.request_id for s in plan.rows}
    out = serving.step()
    assert ("a", FinishReason.ABORT) in [(f.request_id, f.reason) for f in out.finished]
    assert "a" not in out.frames.request_ids
    drive(serving)
    assert len(sink.codes("a")) == frames_before and sink.finished["b"].reason is FinishReason.LENGTH
    assert serving.metrics.requests["a"].finish_reason is FinishReason.ABORT


def test_abort_of_finished_request_is_ignored():
    serving, sink = loop(max_slots=2)
    serving.submit(request("a", eos_at=1, max_frames=5))
    serving.submit(request("b", max_frames=6))
    while "a" not in sink.finished:
        serving.step()
    assert serving.abort("a") == "ignored"  # finished, slot not yet released
    plan = serving.scheduler.schedule(serving.engine)
    assert plan.releases == ("a",) and plan.aborts == ()
    serving.step()
    assert serving.abort("a") == "ignored"  # released
    assert serving.abort("never-submitted") == "ignored"
    drive(serving)
    assert sink.finished["a"].reason is FinishReason.EOS and sink.finished["b"].reason is FinishReason.LENGTH


def test_schedule_is_side_effect_free_and_update_needs_schedule():
    eng = engine(2)
    sched = Scheduler(2, 16, 4)
    sched.add(request("a"), 5)
    assert sched.schedule(eng) == sched.schedule(eng)
    out = eng.step(sched.schedule(eng))
    sched.update(out)
    with pytest.raises(SchedulerError, match="without a schedule"):
        sched.update(out)


def test_constructor_validates():
    with pytest.raises(ValueError, match="token_budget"):
        Scheduler(2, 0, 4)
    with pytest.raises(ValueError, match="preempt_after_steps"):
        Scheduler(2, 4, 4, preempt_after_steps=-1)
