"""The engine's built-in policy: token budget, chunk size, FCFS admission, completion, aborts."""

import pytest

from mtp_fsm.engine import SchedulingPolicy, Span, StepPlan
from mtp_fsm.errors import DuplicateRequestError
from mtp_fsm.lifecycle import FinishReason
from mtp_fsm.serving import SchedulerStallError, ServingStallError
from serving_util import check_bookkeeping, engine, loop, request


def drive(serving, max_steps=500):
    """Step a ServingLoop to idle, recording every plan the engine ran and checking that
    each is the plan engine.scheduler.schedule() previewed just before the step."""
    eng = serving.engine
    plans = []
    real_stage = eng.stage

    def recording(plan: StepPlan):
        plans.append(plan)
        return real_stage(plan)

    eng.stage = recording
    try:
        for _ in range(max_steps):
            preview = None if serving.idle else eng.scheduler.schedule()
            if serving.step() is None:
                assert preview is None
                return plans
            assert plans[-1] == preview
            check_bookkeeping(serving)
    finally:
        del eng.stage
    raise AssertionError(f"not idle after {max_steps} steps")


def _decoding(eng):
    """Requests holding a slot with their prompt done and still live, in admission order."""
    held = [r for _, r in eng.ledger.all_records() if r.slot is not None and r.state in eng.ledger.live_states]
    return [r.request_id for r in sorted(held, key=lambda r: r.serial) if not r.in_prefill]


def test_token_budget_and_chunk_size_are_respected():
    serving, sink = loop(max_slots=4, token_budget=10, prefill_chunk=4)
    for i in range(6):
        serving.submit(request(f"r{i}", prompt_len=9 + i, max_frames=5))
    eng, decode_rows, plans = serving.engine, [], []
    while not serving.idle:
        decode_rows.append(_decoding(eng))
        plans.append(eng.scheduler.schedule())
        serving.step()
        check_bookkeeping(serving)
    assert any(sum(s.num_tokens for s in p.rows) == 10 for p in plans)  # the budget binds
    for plan, decoding in zip(plans, decode_rows):
        assert sum(s.num_tokens for s in plan.rows) <= 10
        assert all(1 <= s.num_tokens <= 4 for s in plan.rows)
        ids = [s.request_id for s in plan.rows]
        assert len(set(ids)) == len(ids)
        # decode rows (1 token, prompt done), in admission order, come before any prefill chunk
        assert ids[: len(decoding)] == decoding and not set(decoding) & set(ids[len(decoding):])
        assert all(s.num_tokens == 1 for s in plan.rows[: len(decoding)])
    for i in range(6):  # the toy model may sample the codec EOS on its own
        assert len(sink.codes(f"r{i}")) == sink.finished[f"r{i}"].num_frames
        assert sink.finished[f"r{i}"].reason in (FinishReason.LENGTH, FinishReason.EOS)


def test_decode_rows_come_first_then_prefill_in_fcfs_order():
    eng = engine(4, token_budget=6, prefill_chunk=4)
    eng.add_request(request("a", prompt_len=3, max_frames=9))
    plan = eng.scheduler.schedule()
    assert [r.request_id for r in plan.new_requests] == ["a"] and plan.rows == (Span("a", 3),)
    eng.step(plan)  # a: whole prompt in one chunk, frame 0
    assert eng.ledger.record("a", "inspect").num_frames == 1
    eng.add_request(request("b", prompt_len=12))
    eng.add_request(request("c", prompt_len=12))
    plan = eng.scheduler.schedule()
    assert [r.request_id for r in plan.new_requests] == ["b", "c"]
    assert [(s.request_id, s.num_tokens) for s in plan.rows] == [("a", 1), ("b", 4), ("c", 1)]
    eng.step(plan)
    plan = eng.scheduler.schedule()
    assert plan.new_requests == ()
    assert [(s.request_id, s.num_tokens) for s in plan.rows] == [("a", 1), ("b", 4), ("c", 1)]
    eng.step()  # the built-in plan is the same one
    progress = {rid: eng.ledger.record(rid, "inspect").num_computed for rid in "bc"}
    assert progress == {"b": 8, "c": 2}


def test_fcfs_admission_up_to_the_slots_rest_queued_then_admitted():
    serving, sink = loop(max_slots=2)
    for i in range(5):
        serving.submit(request(f"r{i}", eos_at=2 + i % 2, max_frames=8))
    serving.step()
    ledger = serving.engine.ledger
    assert sorted(ledger.records) == ["r0", "r1"] and all(r.slot is not None for r in ledger.records.values())
    assert list(ledger.queued) == ["r2", "r3", "r4"]
    assert {rid: serving.engine.requests()[rid] for rid in ledger.queued} == dict.fromkeys(ledger.queued, "free")
    plans = drive(serving)
    admitted = [r.request_id for p in plans for r in p.new_requests]
    assert admitted == ["r2", "r3", "r4"]  # in submission order
    assert {rid: f.reason for rid, f in sink.finished.items()} == {f"r{i}": FinishReason.EOS for i in range(5)}
    assert serving.engine.num_free_slots == 2 and serving.idle


def test_slot_cap_never_exceeded_and_every_request_finishes():
    serving, sink = loop(max_slots=3, token_budget=7, prefill_chunk=3)
    for i in range(10):
        serving.submit(request(f"r{i}", prompt_len=2 + i % 5, eos_at=(None if i % 3 else 1 + i % 4), max_frames=4 + i % 3))
    holding = []

    def on_step(out):
        check_bookkeeping(serving)
        holding.append(sum(r.slot is not None for r in serving.engine.ledger.records.values()))

    serving.run_until_idle(max_steps=300, on_step=on_step)
    assert serving.idle and max(holding) == 3
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
    assert "b" not in serving.engine.ledger.queued and "b" not in serving.engine.requests()
    assert serving.abort("b") == "ignored"
    assert sink.finished["b"].reason is FinishReason.ABORT and sink.finished["b"].num_frames == 0
    plans = drive(serving)
    assert all(s.request_id != "b" for p in plans for s in p.rows) and "b" not in sink.frames
    assert all(r.request_id != "b" for p in plans for r in p.new_requests)
    assert sink.finished["a"].reason is FinishReason.LENGTH


def test_withdrawing_a_queued_request_keeps_the_others_in_order():
    eng = engine(1)
    for rid in "abcd":
        eng.add_request(request(rid, max_frames=2))
    assert list(eng.ledger.queued) == ["a", "b", "c", "d"]
    assert eng.abort("c") == "dropped" and eng.abort("c") == "ignored" and eng.abort("zzz") == "ignored"
    assert list(eng.ledger.queued) == ["a", "b", "d"]
    admitted = []
    while not eng.idle:
        plan = eng.scheduler.schedule()
        admitted += [r.request_id for r in plan.new_requests]
        eng.step(plan)
    assert admitted == ["a", "b", "d"]


def test_duplicate_ids_are_refused_and_the_first_kept():
    eng = engine(1)
    eng.add_request(request("a"))
    eng.add_request(request("b"))
    with pytest.raises(DuplicateRequestError, match=r"'a'.*already in the engine"):
        eng.add_request(request("a", prompt_len=9))  # queued
    assert list(eng.ledger.queued) == ["a", "b"] and eng.ledger.queued["a"].prompt_len == 5
    eng.step()
    with pytest.raises(DuplicateRequestError, match=r"'a'"):
        eng.add_request(request("a"))  # running
    assert list(eng.ledger.queued) == ["b"]


def test_abort_of_running_request():
    serving, sink = loop(max_slots=2)
    serving.submit(request("a", max_frames=20))
    serving.submit(request("b", max_frames=4))
    for _ in range(3):
        serving.step()
    frames_before = len(sink.codes("a"))
    assert serving.abort("a") == "scheduled" and serving.abort("a") == "ignored"  # second one: already aborting
    plan = serving.engine.scheduler.schedule()
    assert plan.aborts == ("a",) and "a" not in {s.request_id for s in plan.rows}
    out = serving.step()
    assert ("a", FinishReason.ABORT) in [(f.request_id, f.reason) for f in out.finished]
    assert "a" not in out.frames.request_ids
    assert "a" not in serving.engine.requests() and serving.abort("a") == "ignored"
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
    plan = serving.engine.scheduler.schedule()
    assert plan.releases == ("a",) and plan.aborts == ()
    serving.step()
    assert serving.abort("a") == "ignored"  # released
    assert serving.abort("never-submitted") == "ignored"
    drive(serving)
    assert sink.finished["a"].reason is FinishReason.EOS and sink.finished["b"].reason is FinishReason.LENGTH


def test_schedule_is_side_effect_free_and_explicit_plans_are_committed_too():
    eng = engine(2, token_budget=16, prefill_chunk=4)
    eng.add_request(request("a", prompt_len=7))
    first = eng.scheduler.schedule()
    assert first == eng.scheduler.schedule()
    assert list(eng.ledger.queued) == ["a"] and eng.num_free_slots == 2 and eng.step_count == 0
    # An embedder's own plan (2 tokens instead of the policy's chunk of 4): the policy
    # carries on from what that plan did.
    eng.step(StepPlan(new_requests=(eng.ledger.queued["a"].request,), rows=(Span("a", 2),)))
    assert not eng.ledger.queued and eng.ledger.record("a", "inspect").num_computed == 2
    assert eng.scheduler.schedule() == StepPlan(rows=(Span("a", 4),))
    eng.step(StepPlan(rows=(Span("a", 1),)))
    assert eng.scheduler.schedule() == StepPlan(rows=(Span("a", 4),))  # 4 left of 7
    eng.step()
    assert not eng.ledger.record("a", "inspect").in_prefill
    assert eng.scheduler.schedule() == StepPlan(rows=(Span("a", 1),))


def test_policy_validates():
    with pytest.raises(ValueError, match="token_budget"):
        SchedulingPolicy(token_budget=0)
    with pytest.raises(ValueError, match="prefill_chunk"):
        SchedulingPolicy(prefill_chunk=2.0)
    with pytest.raises(ValueError, match="preempt_after_steps"):
        SchedulingPolicy(preempt_after_steps=-1)
    assert SchedulingPolicy(4, 4, preempt_after_steps=0).preempt_after_steps == 0


def test_a_plan_of_nothing_with_work_pending_is_a_stall(monkeypatch):
    serving, _ = loop(max_slots=1)
    serving.submit(request("a"))
    assert ServingStallError is SchedulerStallError
    monkeypatch.setattr(serving.engine.scheduler, "schedule", lambda: StepPlan())
    with pytest.raises(ServingStallError, match="nothing can be scheduled: 1 queued"):
        serving.step()
    assert serving.engine.step_count == 0 and list(serving.engine.ledger.queued) == ["a"]
    monkeypatch.undo()
    serving.run_until_idle(max_steps=50)
    assert serving.idle and serving.metrics.requests["a"].finish_reason is FinishReason.LENGTH
