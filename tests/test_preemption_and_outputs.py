"""Preempt/resume, abort from every state, output ownership, token-major view, local faults."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mtp_fsm.engine import LockstepEngine, NewRequest, Span, StepPlan
from mtp_fsm.errors import LifecycleError
from mtp_fsm.lifecycle import FinishReason, State
from mtp_fsm.sampling import SamplingParams
from mtp_fsm.testing import ScriptedTalker, ScriptInputs
from mtp_fsm.testing.runs import frames_alone, next_rows, run_to_completion
from mtp_fsm.vllm import to_token_major

MODEL = ScriptedTalker()


def request(i: int, prompt_len: int = 6, eos_at: int | None = 9, max_frames: int = 40) -> NewRequest:
    return NewRequest(
        f"r{i}", ScriptInputs(tuple(range(i, i + prompt_len)), eos_at=eos_at), max_frames=max_frames, seed=100 + i,
        cb0_sampling=SamplingParams(0.8, 8, 0.95), mtp_sampling=SamplingParams(1.0, 0, 1.0),
    )


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 4),
    slots=st.integers(1, 4),
    chunk=st.integers(1, 7),
    preempt_steps=st.lists(st.tuples(st.integers(0, 25), st.integers(0, 3)), max_size=5),
)
def test_random_preemption_and_resume_never_change_frames(n, slots, chunk, preempt_steps):
    reqs = [request(i, prompt_len=3 + i, eos_at=6 + 2 * i) for i in range(n)]
    alone = {r.request_id: frames_alone(MODEL, r) for r in reqs}
    plan = {}
    for step, who in preempt_steps:
        plan.setdefault(step, set()).add(f"r{who}")

    def events(step, engine):
        live = {rid for rid, r in engine.ledger.records.items() if r.slot is not None and r.state in (State.WAITING, State.PREFILLING, State.DECODING)}
        return {"preempts": sorted(plan.get(step, set()) & live)}

    frames, reasons = run_to_completion(LockstepEngine(MODEL, slots), reqs, chunk=chunk, events=events)
    assert frames == alone
    assert set(reasons.values()) == {FinishReason.EOS}


def test_preempting_twice_before_the_resumed_request_runs_is_harmless():
    req = request(0, eos_at=7)
    engine = LockstepEngine(MODEL, 2)
    out = engine.step(StepPlan(new_requests=(req,), rows=(Span("r0", 6),)))
    frames = [tuple(out.frames.codes[0].tolist())]
    for _ in range(3):
        frames += [tuple(c.tolist()) for c in engine.step(StepPlan(rows=(Span("r0", 1),))).frames.codes]
    engine.step(StepPlan(preempts=("r0",)))
    engine.step(StepPlan(resumes=("r0",)))  # resumed, never scheduled ...
    engine.step(StepPlan(preempts=("r0",)))  # ... and preempted again
    engine.step(StepPlan(resumes=("r0",)))
    while engine.request_state("r0") not in (State.FINISHED,):
        rows = next_rows(engine, chunk=4)
        frames += [tuple(c.tolist()) for c in engine.step(StepPlan(rows=rows)).frames.codes]
    assert frames == [c for _, c in frames_alone(MODEL, req)]


@pytest.mark.parametrize("when", ["waiting", "prefilling", "decoding", "preempted"])
def test_abort_from_every_non_terminal_state_frees_the_slot_at_once(when):
    engine = LockstepEngine(MODEL, 1)
    engine.step(StepPlan(new_requests=(request(0),)))
    if when in ("prefilling", "decoding", "preempted"):
        engine.step(StepPlan(rows=(Span("r0", 3),)))
    if when in ("decoding", "preempted"):
        engine.step(StepPlan(rows=(Span("r0", 3),)))
    if when == "preempted":
        engine.step(StepPlan(preempts=("r0",)))
    assert engine.request_state("r0").label == when
    out = engine.step(StepPlan(aborts=("r0",), new_requests=(request(1),), rows=(Span("r1", 6),)))
    assert [(f.request_id, f.reason) for f in out.finished] == [("r0", FinishReason.ABORT)]
    assert set(out.frames.request_ids) <= {"r1"}  # nothing of r0 after the abort
    assert "r0" not in engine.requests() and engine.requests()["r1"] == "decoding"


def test_abort_of_a_finished_request_is_a_lifecycle_error_and_changes_nothing():
    engine = LockstepEngine(MODEL, 1)
    engine.step(StepPlan(new_requests=(request(0, eos_at=0),), rows=(Span("r0", 6),)))
    assert engine.request_state("r0") is State.FINISHED
    with pytest.raises(LifecycleError, match="'r0' in state 'finished': trigger 'abort'"):
        engine.step(StepPlan(aborts=("r0",)))
    assert engine.request_state("r0") is State.FINISHED


def test_published_data_is_owned_by_the_caller():
    engine = LockstepEngine(MODEL, 2)
    out = engine.step(StepPlan(new_requests=(request(0), request(1)), rows=(Span("r0", 6), Span("r1", 6))))
    kept = out.frames.codes.clone(), out.frames.frame_index.clone(), out.rows.codes.clone()
    for _ in range(3):
        engine.step(StepPlan(rows=(Span("r0", 1), Span("r1", 1))))
    engine.table.frame_codes.fill_(-7)
    engine.table.frame_log.fill_(-7)
    assert torch.equal(out.frames.codes, kept[0]) and torch.equal(out.frames.frame_index, kept[1])
    assert torch.equal(out.rows.codes, kept[2])
    out.frames.codes.fill_(5)  # and the caller mutating its copy does not reach the engine
    assert not (engine.table.frame_codes[:2] == 5).any()


def test_token_major_view_marks_only_the_last_token_of_kept_rows():
    engine = LockstepEngine(MODEL, 3)
    engine.step(StepPlan(new_requests=(request(0), request(1), request(2, prompt_len=9))))
    out = engine.step(StepPlan(rows=(Span("r0", 6), None, Span("r2", 4), Span("r1", 2))))
    tm = to_token_major(out, num_tokens=16)
    # rows: r0 tokens 0..5 (final chunk -> frame at 5), padding, r2 6..9 (non-final), r1 10..11 (non-final)
    assert tm.valid.nonzero().flatten().tolist() == [5]
    assert torch.equal(tm.codes[5], out.frames.codes[0]) and tm.request_ids[5] == "r0"
    assert not tm.valid[12:].any() and tm.request_ids[12:] == (None,) * 4
    out = engine.step(StepPlan(rows=(Span("r1", 1), Span("r0", 1), Span("r2", 5), Span("r1", 0) if False else None)))
    tm = to_token_major(out)
    assert tm.valid.tolist() == [False, True, False, False, False, False, True]
    assert torch.equal(tm.codes[tm.valid], out.rows.codes[out.rows.valid])


class ExplodingTalker(ScriptedTalker):
    """Raises in forward whenever a chosen slot is in the batch."""

    explode = False

    def forward(self, inputs_embeds, positions, token_slots):
        if self.explode:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().forward(inputs_embeds, positions, token_slots)


def test_a_model_exception_ends_that_steps_requests_and_the_engine_keeps_serving():
    model = ExplodingTalker()
    engine = LockstepEngine(model, 3)
    reqs = [request(0, eos_at=None, max_frames=6), request(1, eos_at=None, max_frames=6), request(2, eos_at=None, max_frames=6)]
    engine.step(StepPlan(new_requests=tuple(reqs), rows=(Span("r0", 6), Span("r1", 6))))
    model.explode = True
    out = engine.step(StepPlan(rows=(Span("r0", 1),)))
    model.explode = False
    assert [(f.request_id, f.reason) for f in out.finished] == [("r0", FinishReason.ERROR)]
    assert "illegal memory access" in out.finished[0].detail and len(out.frames) == 0
    # The host ended r0: its slot is free at once (like a client abort), so it left the engine.
    assert engine.requests() == {"r1": "decoding", "r2": "waiting"} and engine.num_free_slots == 1
    frames, _ = run_to_completion(engine, [], chunk=6)
    expected = {r.request_id: frames_alone(model, r) for r in reqs[1:]}
    expected["r1"] = expected["r1"][1:]  # r1's frame 0 came in the first step above
    assert frames == expected


class ResetExplodingTalker(ScriptedTalker):
    """Raises while clearing the slot state of an admitted request."""

    explode = False

    def reset_slots(self, slots):
        if self.explode:
            raise RuntimeError("out of memory while clearing the KV cache")
        return super().reset_slots(slots)


def test_a_model_exception_during_admission_ends_only_the_admitted_requests():
    model = ResetExplodingTalker()
    engine = LockstepEngine(model, 3)
    engine.step(StepPlan(new_requests=(request(0, eos_at=None, max_frames=5),), rows=(Span("r0", 6),)))
    model.explode = True
    out = engine.step(StepPlan(new_requests=(request(1),), rows=(Span("r1", 6),)))
    model.explode = False
    assert [(f.request_id, f.reason) for f in out.finished] == [("r1", FinishReason.ERROR)]
    assert "out of memory" in out.finished[0].detail
    # The failed admission's slot is freed at once (the host ended it) and can be reused.
    assert engine.requests() == {"r0": "decoding"} and engine.num_free_slots == 2
    frames, reasons = run_to_completion(engine, [request(2)], chunk=6)
    assert reasons["r2"] == FinishReason.EOS and frames["r2"] == frames_alone(model, request(2))
    assert [i for i, _ in frames["r0"]] == [1, 2, 3, 4]
