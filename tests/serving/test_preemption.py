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
    assert reference.engine.scheduler.num_preemptions == 0
    serving, sink, preempted, _ = _run(max_slots=2, preempt_after_steps=1)
    assert serving.engine.scheduler.num_preemptions >= 2 and preempted
    assert serving.metrics.summary().preemptions == serving.engine.scheduler.num_preemptions
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
        plan = serving.engine.scheduler.schedule()
        gone = set(plan.preempts) | set(plan.aborts) | set(plan.releases)
        assert not gone & {s.request_id for s in plan.rows}
        assert not set(plan.preempts) & set(plan.resumes)
        serving.step()
    assert serving.engine.scheduler.num_preemptions > 0 and len(sink.finished) == 7


def test_abort_of_preempted_request():
    serving, sink, preempted, aborted = _run(max_slots=2, preempt_after_steps=1, abort_when_preempted=True)
    assert aborted is not None and sink.finished[aborted].reason is FinishReason.ABORT
    others = {rid: f.reason for rid, f in sink.finished.items() if rid != aborted}
    assert len(others) == 6 and FinishReason.ABORT not in others.values()


def test_no_preemption_without_the_option():
    serving, sink, preempted, _ = _run(max_slots=2)
    assert not preempted and serving.engine.scheduler.num_preemptions == 0 and len(sink.finished) == 7


def _trace(serving):
    """Run to idle; per step: (plan, output) with check_bookkeeping between steps."""
    eng, trace = serving.engine, []
    while not serving.idle:
        plan = eng.scheduler.schedule()
        trace.append((plan, serving.step()))
        check_bookkeeping(serving)
    return trace


def test_blocked_head_preempts_the_most_recently_admitted_and_resumes_go_before_admissions():
    lengths = {"a": 4, "b": 20, "c": 20, "d": 3}
    serving, sink = loop(max_slots=2, preempt_after_steps=1)
    for rid, max_frames in lengths.items():
        serving.submit(request(rid, max_frames=max_frames))
    trace = _trace(serving)
    preempts = [(k, plan.preempts, out.preempted) for k, (plan, out) in enumerate(trace) if plan.preempts]
    # c is the blocked head from step 1; blocked for more than 1 step, step 2 preempts b (admitted
    # after a) and admits c in its place. After its resume b is the newest again, so d's wait
    # (blocked from step 5) preempts b once more.
    assert preempts == [(2, ("b",), ("b",)), (6, ("b",), ("b",))]
    admits = {r.request_id: k for k, (plan, _) in enumerate(trace) for r in plan.new_requests}
    assert admits == {"a": 0, "b": 0, "c": 2, "d": 6}
    resumes = [(k, plan.resumes, [(s.request_id, s.num_tokens) for s in plan.rows if s.request_id == "b"])
               for k, (plan, _) in enumerate(trace) if plan.resumes]
    # a's slot frees at step 4: b (preempted) resumes there although d was queued earlier; its
    # resume prefill is the prompt (5) plus the frames published before (2, then 4), in chunks of 8.
    assert resumes == [(4, ("b",), [("b", 7)]), (9, ("b",), [("b", 8)])]
    assert serving.engine.scheduler.num_preemptions == 2 == serving.metrics.summary().preemptions
    reference, ref_sink = loop(max_slots=4)
    for rid, max_frames in lengths.items():
        reference.submit(request(rid, max_frames=max_frames))
    reference.run_until_idle(max_steps=100)
    assert sink.frames == ref_sink.frames and sink.reasons() == ref_sink.reasons()
    assert sink.finished["b"].num_frames == 20


def test_explicit_preempt_releases_the_slot_and_the_request_resumes_with_its_frames():
    serving, sink = loop(max_slots=1)
    serving.submit(request("a", max_frames=6))
    serving.submit(request("b", max_frames=3))
    serving.step()
    serving.step()
    eng = serving.engine
    assert eng.preempt("a") and not eng.preempt("b") and not eng.preempt("zzz")  # b is queued: no slot
    out = serving.step()
    assert out.preempted == ("a",) and [f.request_id for f in out.finished] == []
    record = eng.ledger.record("a", "inspect")
    assert (record.state.label, record.slot, record.num_frames) == ("preempted", None, 2)
    assert "b" in eng.ledger.records and not eng.ledger.queued  # a's slot went to b at the same boundary
    check_bookkeeping(serving)
    _trace(serving)
    assert [i for i, _ in sink.frames["a"]] == list(range(6)) and sink.finished["a"].reason is FinishReason.LENGTH
    reference, ref_sink = loop(max_slots=2)
    for req in (request("a", max_frames=6), request("b", max_frames=3)):
        reference.submit(req)
    reference.run_until_idle(max_steps=50)
    assert sink.frames == ref_sink.frames
