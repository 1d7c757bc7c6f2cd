"""Preemption under slot pressure: everyone finishes, and frames match an unpressured run."""

from mtp_fsm.lifecycle import FinishReason
from serving_util import check_bookkeeping, loop, request


def _requests():
    return [request(f"r{i}", prompt_len=3 + (5 * i) % 11, max_frames=6 + i % 4, seed=100 + i) for i in range(7)]


def _run(max_slots, preempt_after_steps=None, abort_when_preempted=False):
    serving, sink = loop(max_slots=max_slots, token_budget=12, prefill_chunk=4, preempt_after_steps=preempt_after_steps)
    for req in _requests():
        serving.submit(req)
    preempted_seen, aborted = set(), None
    for _ in range(400):
        out = serving.step()
        if out is None:
            break
        check_bookkeeping(serving)
        states = serving.engine.requests()
        preempted_seen |= {rid for rid, s in states.items() if s == "preempted"}
        if abort_when_preempted and aborted is None and preempted_seen:
            aborted = next(iter(preempted_seen))
            assert serving.abort(aborted) == "scheduled"
    assert serving.idle
    return serving, sink, preempted_seen, aborted


def test_preemption_finishes_everyone_with_identical_frames():
    reference, ref_sink, _, _ = _run(max_slots=7)
    assert reference.scheduler.num_preemptions == 0
    serving, sink, preempted, _ = _run(max_slots=2, preempt_after_steps=1)
    assert serving.scheduler.num_preemptions >= 2 and preempted
    assert serving.metrics.summary().preemptions == serving.scheduler.num_preemptions
    assert sorted(sink.finished) == sorted(ref_sink.finished)
    for rid, finished in ref_sink.finished.items():
        assert sink.finished[rid].reason == finished.reason != FinishReason.ERROR
        assert sink.frames[rid] == ref_sink.frames[rid], f"{rid} frames differ after preemption/resume"
    # A waiting preempted request goes first, so pressure never preempts a second one meanwhile.
    assert max(serving.metrics.state_history()["preempted"]) == 1


def test_plan_never_schedules_a_request_it_preempts_or_aborts():
    serving, sink = loop(max_slots=2, token_budget=12, prefill_chunk=4, preempt_after_steps=0)
    for req in _requests():
        serving.submit(req)
    while not serving.idle:
        plan = serving.scheduler.schedule(serving.engine)
        gone = set(plan.preempts) | set(plan.aborts) | set(plan.releases)
        assert not gone & {s.request_id for s in plan.rows}
        assert not set(plan.preempts) & set(plan.resumes)
        serving.step()
    assert serving.scheduler.num_preemptions > 0 and len(sink.finished) == 7


def test_abort_of_preempted_request():
    serving, sink, preempted, aborted = _run(max_slots=2, preempt_after_steps=1, abort_when_preempted=True)
    assert aborted is not None and sink.finished[aborted].reason is FinishReason.ABORT
    others = {rid: f.reason for rid, f in sink.finished.items() if rid != aborted}
    assert len(others) == 6 and FinishReason.ABORT not in others.values()


def test_no_preemption_without_the_option():
    serving, sink, preempted, _ = _run(max_slots=2)
    assert not preempted and serving.scheduler.num_preemptions == 0 and len(sink.finished) == 7
