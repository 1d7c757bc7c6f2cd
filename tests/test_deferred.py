"""The deferred schedule (MOSS-TTS Local's canonical path, variant mtp_stop_deferred): the same
frames as the current-step schedule, each published one step later."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from mtp_fsm.engine import LockstepEngine, SchedulingPolicy
from mtp_fsm.lifecycle import FinishReason
from mtp_fsm.lifecycle.variants import mtp_stop_lifecycle
from mtp_fsm.testing.alone import (
    run_alone, scripted_mtp_stop, scripted_mtp_stop_deferred, torch_threads,
)
from mtp_fsm.testing.interpreter import interpret
from mtp_fsm.testing.references import reference_runs
from mtp_fsm.testing.stateful import scripted_requests

SPEC = scripted_mtp_stop_deferred().spec
FAST = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


def timeline(factory, requests, max_slots: int, policy: SchedulingPolicy, kernels: str = "torch", on_step=None):
    """(step, request, frame index, codes) of every frame and (step, request, reason, detail) of every end."""
    engine = LockstepEngine(factory(), max_slots, kernels=kernels, policy=policy)
    frames, ends, step = [], [], 0
    for r in requests:
        engine.add_request(r)
    while (out := engine.step()) is not None:
        frames += [(step, f.request_id, f.index, tuple(f.codes.tolist())) for f in out.frames]
        ends += [(step, f.request_id, f.reason, f.detail) for f in out.finished]
        if on_step is not None:
            on_step(engine, step)
        step += 1
    return frames, ends


@FAST
@given(st.lists(scripted_requests(SPEC), min_size=1, max_size=4), st.integers(1, 16), st.data())
def test_deferred_publishes_the_current_step_frames_one_step_later(defs, chunk, data):
    """Every request holds a slot from the start and prefill never waits on the budget, so the
    two schedules step in lockstep: each frame, and each end decided at or after the MTP
    stage, comes exactly one step later; a faulty CB0 sample ends the request in the step that
    sampled it on both schedules."""
    requests = [d.new_request(f"r{i}") for i, d in enumerate(defs)]
    policy = SchedulingPolicy(token_budget=4096, prefill_chunk=chunk)
    current = timeline(scripted_mtp_stop, requests, len(requests), policy)
    deferred = timeline(scripted_mtp_stop_deferred, requests, len(requests), policy)
    later = [(s + 1, *rest) for s, *rest in current[0]]
    ends = [(s + (not detail.startswith("CB0 sampling")), rid, reason, detail) for s, rid, reason, detail in current[1]]
    assert sorted(deferred[0]) == sorted(later)  # within a step, rows may come in another order
    assert sorted(deferred[1], key=lambda e: e[:2]) == sorted(ends, key=lambda e: e[:2])


@FAST
@given(st.lists(scripted_requests(SPEC), min_size=1, max_size=5), st.integers(1, 3), st.integers(1, 24),
       st.integers(1, 8), st.data())
def test_deferred_frames_equal_the_reference_under_preemption_and_aborts(defs, max_slots, budget, chunk, data):
    """Any policy, preemptions and client aborts: each request's frames are its reference
    frames (the current-step interpreter's), a prefix of them when aborted; a stopped stream
    never emits again."""
    refs = reference_runs(scripted_mtp_stop_deferred)
    requests = [d.new_request(f"r{i}") for i, d in enumerate(defs)]
    policy = SchedulingPolicy(token_budget=budget, prefill_chunk=chunk, preempt_after_steps=data.draw(
        st.one_of(st.none(), st.integers(0, 3)), label="preempt_after"))
    actions = data.draw(st.lists(st.tuples(st.sampled_from(["abort", "preempt"]), st.integers(0, len(defs) - 1),
                                           st.integers(0, 30)), max_size=4), label="actions")

    dropped = []  # aborted while still queued: engine.abort says so, no step reports them

    def act(engine, step):
        for what, i, at in actions:
            if at == step and getattr(engine, what)(f"r{i}") == "dropped":
                dropped.append((step, f"r{i}", FinishReason.ABORT, ""))

    frames, ends = timeline(scripted_mtp_stop_deferred, requests, max_slots, policy, on_step=act)
    ends += dropped
    ended = {rid: (reason, detail) for _, rid, reason, detail in ends}
    assert sorted(ended) == sorted(r.request_id for r in requests) and len(ends) == len(ended)
    last_step = {rid: s for s, rid, _, _ in ends}
    for i, d in enumerate(defs):
        rid, ref = f"r{i}", refs.get(d)
        got = [(idx, codes) for s, r, idx, codes in frames if r == rid]
        assert [idx for idx, _ in got] == list(range(len(got)))
        assert all(s <= last_step[rid] for s, r, _, _ in frames if r == rid)  # nothing after its end
        reason, detail = ended[rid]
        if reason is FinishReason.ABORT:
            assert tuple(c for _, c in got) == ref.frames[: len(got)]
        else:
            assert (tuple(c for _, c in got), reason, detail) == (ref.frames, ref.reason, ref.detail)


@FAST
@given(scripted_requests(SPEC))
def test_deferred_alone_equals_the_current_step_interpreter(definition):
    engine = run_alone(scripted_mtp_stop_deferred, definition, kernels="torch")
    assert engine == interpret(scripted_mtp_stop_deferred(), mtp_stop_lifecycle(), definition)
