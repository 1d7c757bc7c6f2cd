"""Example-based regressions, each named after the hazard it guards (reference/vllm-omni-mtp.md
section 6 and DESIGN.md section 1). Ground truth is always the same request run alone."""

from __future__ import annotations

import pytest
import torch

from mtp_fsm.engine import LockstepEngine, NewRequest, Span, StepPlan
from mtp_fsm.errors import (
    AdmissionError, DuplicateRequestError, LifecycleError, PlanError, SlotTableFullError, UnknownRequestError,
)
from mtp_fsm.lifecycle import FinishReason, State
from mtp_fsm.sampling import SamplingParams
from mtp_fsm.testing import ScriptedTalker, ScriptInputs
from mtp_fsm.testing.alone import RequestDef, run_alone, scripted_mtp, scripted_single, torch_threads


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


def req(rid: str, prompt=(3, 1, 4, 1, 5), max_frames: int = 6, seed: int = 11, **script) -> NewRequest:
    return NewRequest(rid, ScriptInputs(tuple(prompt), **script), max_frames=max_frames, seed=seed,
                      cb0_sampling=SamplingParams(0.9, 8, 0.95), mtp_sampling=SamplingParams(1.1, 0, 1.0))


def alone(request: NewRequest, factory=scripted_mtp):
    return run_alone(factory, RequestDef.of(request), kernels="torch")


def engine(slots: int = 3, factory=scripted_mtp) -> LockstepEngine:
    return LockstepEngine(factory(), slots, kernels="torch")


def frames(out) -> dict[str, tuple[int, tuple[int, ...]]]:
    return {f.request_id: (f.index, tuple(f.codes.tolist())) for f in out.frames}


def snapshot(e: LockstepEngine):
    cols = {k: v.clone() for k, v in e.table.columns().items()}
    recs = {rid: (r.slot, r.serial, r.num_computed, r.num_frames, r.state)
            for rid, r in e.ledger.records.items()}
    return cols, recs, e.ledger.allocator.num_free, e.model.cache.clone()


def assert_unchanged(before, after):
    for name in before[0]:
        assert torch.equal(before[0][name], after[0][name]), f"column {name} changed"
    assert before[1:3] == after[1:3]
    assert torch.equal(before[3], after[3]), "the model's KV cache changed"


def step(e: LockstepEngine, plan: StepPlan, collected: dict):
    """One step; appends each published frame to collected[request id] (indices checked)."""
    out = e.step(plan)
    for rid, (index, codes) in frames(out).items():
        collected.setdefault(rid, []).append(codes)
        assert index == len(collected[rid]) - 1, f"{rid!r} published frame {index} out of order"
    return out


def drive(e: LockstepEngine, rids, collected=None, max_steps=200):
    """Step every live request in `rids` (rest of its prompt, or decode) until all are
    terminal; returns frames per request (appended to `collected`)."""
    collected = collected if collected is not None else {}
    for _ in range(max_steps):
        live = [r for r in rids if e.request_state(r) in (State.WAITING, State.PREFILLING, State.DECODING)]
        if not live:
            return collected
        rows = []
        for rid in live:
            rec = e.ledger.records[rid]
            left = rec.prompt_len - rec.num_computed
            rows.append(Span(rid, left if left > 0 else 1))
        step(e, StepPlan(rows=tuple(rows)), collected)
    raise AssertionError("requests did not finish")


# -- request isolation under shape coincidence ------------------------------------------


@pytest.mark.parametrize("final_chunk", [1, 3])
def test_mixed_prefill_and_decode_batch_never_mixes_frames(final_chunk):
    # Hazard (mtp.md 6.2): codes retained request-major but addressed by token row; with
    # num_reqs == num_tokens (a 1-token final prefill chunk + a decode row) the mix-up is
    # silent, with a longer chunk it reads the wrong row. Each request must get its own frame.
    a, b = req("a", prompt=(7, 7, 7), seed=1), req("b", prompt=(2, 9, 4, 4, 8), seed=2)
    ref_a, ref_b = alone(a).frames, alone(b).frames
    e = engine(2)
    out = e.step(StepPlan(new_requests=(a, b), rows=(Span("a", 3), Span("b", 5 - final_chunk))))
    assert frames(out) == {"a": (0, ref_a[0])}
    # b's final chunk and a's decode row in one step, b first: rows 2, tokens 1 + final_chunk.
    out = e.step(StepPlan(rows=(Span("b", final_chunk), None, Span("a", 1))))
    assert out.num_tokens == 1 + final_chunk
    assert frames(out) == {"b": (0, ref_b[0]), "a": (1, ref_a[1])}
    assert out.rows.valid.tolist() == [True, False, True]
    assert [tuple(c) for c in out.rows.codes.tolist()] == [ref_b[0], (0,) * 4, ref_a[1]]
    got = drive(e, ["a", "b"], {"a": list(ref_a[:2]), "b": [ref_b[0]]})
    assert got == {"a": list(ref_a), "b": list(ref_b)}


# -- steps with nothing to sample --------------------------------------------------------


@pytest.mark.parametrize("rows", ["non-final chunks only", "padding only", "empty plan"])
def test_step_without_kept_rows_is_a_noop(rows):
    # Hazard (mtp.md 6.1): post-sample crashed (AttributeError / "requires retained codes")
    # on a step with no multimodal outputs. A step that keeps no sample must do nothing.
    a, b = req("a", prompt=(1, 2, 3, 4, 5, 6)), req("b", prompt=(9, 8, 7))
    e = engine(3)
    e.step(StepPlan(new_requests=(a, b)))
    before = snapshot(e)
    plan = {
        "non-final chunks only": StepPlan(rows=(Span("a", 2), None, Span("b", 1))),
        "padding only": StepPlan(rows=(None, None, None)),
        "empty plan": StepPlan(),
    }[rows]
    out = e.step(plan)
    assert len(out.frames) == 0 and out.finished == ()
    assert not out.rows.valid.any() and not out.rows.codes.any()
    if rows == "non-final chunks only":
        assert e.request_state("a") is State.PREFILLING and e.request_state("b") is State.PREFILLING
    else:
        assert_unchanged(before, snapshot(e))
    assert drive(e, ["a", "b"]) == {"a": list(alone(a).frames), "b": list(alone(b).frames)}


# -- single-codebook model ----------------------------------------------------------------


def test_single_codebook_model_runs_without_an_mtp_stage():
    # Hazard (mtp.md 6.3): Chatterbox (no MTP hook) crashed once the MTP path became the
    # only path. A single-codebook model must run the same engine with no MTP stage at all.
    def no_mtp_model():
        model = ScriptedTalker(num_codebooks=1, dtype=torch.float64)

        def mtp(*args):
            raise AssertionError("the MTP hook must never run for a single-codebook model")

        model.mtp = mtp
        return model

    e = engine(2, no_mtp_model)
    assert e.lifecycle.name == "single_codebook" and not e.spec.has_mtp
    a, b = req("a", max_frames=5), req("b", prompt=(4, 4), eos_at=2, seed=5)
    out = e.step(StepPlan(new_requests=(a, b), rows=(Span("a", 5), Span("b", 1))))
    assert out.frames.codes.shape == (1, 1)
    got = drive(e, ["a", "b"], {"a": [tuple(out.frames.codes[0].tolist())]})
    assert got == {"a": list(alone(a, scripted_single).frames), "b": list(alone(b, scripted_single).frames)}
    assert all(len(c) == 1 for c in got["a"]) and len(got["b"]) == 2
    assert e.request_state("b") is State.FINISHED and e.request_state("a") is State.FINISHED


# -- admission errors -----------------------------------------------------------------------


def test_sampling_width_other_than_one_is_rejected_and_nothing_is_lost():
    # Hazard (mtp.md 6.4): with multi-token / speculative sampling one frame was built from
    # the first of k tokens (silent desync). Width != 1 must be refused at admission, naming
    # the request, and the requests already in the engine keep running unchanged.
    a = req("a", max_frames=4)
    e = engine(3)
    out = e.step(StepPlan(new_requests=(a,), rows=(Span("a", 5),)))
    got = {"a": [frames(out)["a"][1]]}
    wide = NewRequest("wide", ScriptInputs((1, 2)), max_frames=3, sampling_width=2)
    before = snapshot(e)
    with pytest.raises(AdmissionError, match="'wide'.*sampling width 2"):
        e.step(StepPlan(new_requests=(req("ok"), wide), rows=(Span("a", 1),)))
    assert_unchanged(before, snapshot(e))
    assert "ok" not in e.requests()  # the plan was rejected whole
    assert drive(e, ["a"], got) == {"a": list(alone(a).frames)}


def test_top_p_beyond_the_fixed_point_vocabulary_is_refused_at_admission():
    # Hazard: the fixed-point top-p mass is exact only up to MAX_VOCAB_FIXED ids; a request
    # using top_p < 1 on a bigger vocabulary must be refused up front, not fail mid-step.
    from mtp_fsm.sampling.topp import MAX_VOCAB_FIXED

    big = 20000
    assert big > MAX_VOCAB_FIXED
    e = LockstepEngine(ScriptedTalker(codebook_size=big), 2, kernels="torch")
    prompt = ScriptInputs((3, 1, 4))
    for rid, cb0, mtp in [("cb0", SamplingParams(0.9, 0, 0.9), SamplingParams(1.1, 0, 1.0)),
                          ("mtp", SamplingParams(0.9, 8, 1.0), SamplingParams(1.1, 0, 0.5))]:
        before = snapshot(e)
        bad = NewRequest(rid, prompt, max_frames=2, cb0_sampling=cb0, mtp_sampling=mtp)
        with pytest.raises(AdmissionError, match=f"'{rid}'.*{rid} sampling: top_p < 1.*{MAX_VOCAB_FIXED}"):
            e.step(StepPlan(new_requests=(bad,)))
        assert_unchanged(before, snapshot(e))
    ok = NewRequest("ok", prompt, max_frames=2, cb0_sampling=SamplingParams(0.9, 8, 1.0),
                    mtp_sampling=SamplingParams(1.1, 0, 1.0))
    e.step(StepPlan(new_requests=(ok,), rows=(Span("ok", 3),)))
    assert "ok" in e.requests()
    # Without an MTP stage the MTP parameters are never used, so they are not checked.
    single = LockstepEngine(ScriptedTalker(num_codebooks=1, codebook_size=big), 1, kernels="torch")
    single.step(StepPlan(new_requests=(NewRequest("s", prompt, max_frames=2, cb0_sampling=SamplingParams(0.9, 8, 1.0),
                                                  mtp_sampling=SamplingParams(1.1, 0, 0.5)),)))
    assert "s" in single.requests()


@pytest.mark.parametrize("case", [
    "duplicate id", "duplicate in one plan", "unknown abort", "unknown release", "unknown row",
    "table full", "prompt longer than the context", "max_frames 0", "release a live request",
])
def test_bad_requests_raise_a_clear_error_and_leave_the_engine_untouched(case):
    # Hazard: RuntimeError guards deep in the worker (DESIGN 1). Every bad input is refused
    # before anything changes, with an error naming the request; the next valid step works.
    a, b = req("a", max_frames=3), req("b", prompt=(5, 5), max_frames=3, seed=3)
    e = engine(2)
    e.step(StepPlan(new_requests=(a, b), rows=(Span("a", 3),)))
    long_prompt = ScriptInputs(tuple(range(e.spec.max_context)))
    plan, error, name = {
        "duplicate id": (StepPlan(new_requests=(req("a"),)), DuplicateRequestError, "a"),
        "duplicate in one plan": (StepPlan(new_requests=(req("c"), req("c"))), DuplicateRequestError, "c"),
        "unknown abort": (StepPlan(aborts=("zz",)), UnknownRequestError, "zz"),
        "unknown release": (StepPlan(releases=("zz",)), UnknownRequestError, "zz"),
        "unknown row": (StepPlan(rows=(Span("a", 2), Span("zz", 1))), PlanError, "zz"),
        "table full": (StepPlan(new_requests=(req("c"),)), SlotTableFullError, "c"),
        "prompt longer than the context": (
            StepPlan(new_requests=(NewRequest("c", long_prompt, max_frames=2),)), AdmissionError, "c"),
        "max_frames 0": (StepPlan(new_requests=(req("c", max_frames=0),)), AdmissionError, "c"),
        "release a live request": (StepPlan(releases=("b",)), LifecycleError, "b"),
    }[case]
    before = snapshot(e)
    with pytest.raises(error) as info:
        e.step(plan)
    assert f"'{name}'" in str(info.value)
    assert_unchanged(before, snapshot(e))
    got = {}
    step(e, StepPlan(rows=(Span("b", 2), Span("a", 2))), got)
    assert drive(e, ["a", "b"], got) == {"a": list(alone(a).frames), "b": list(alone(b).frames)}


# -- async overrun ----------------------------------------------------------------------------


@pytest.mark.parametrize("end", ["length", "eos", "error"])
def test_terminal_request_scheduled_again_publishes_nothing(end):
    # Hazard (mtp.md 6.6): under async scheduling the step after EOS runs the request once
    # more; its frame must be invalid. A finished/aborted row scheduled again is inert.
    script = {"length": {}, "eos": {"eos_at": 2}, "error": {"nan_at": 2}}[end]
    a, b = req("a", max_frames=2 if end == "length" else 9, **script), req("b", prompt=(6,), max_frames=9, seed=4)
    e, collected = engine(2), {}
    step(e, StepPlan(new_requests=(a, b), rows=(Span("a", 5), Span("b", 1))), collected)
    while e.request_state("a") not in (State.FINISHED, State.ABORTED):
        step(e, StepPlan(rows=(Span("b", 1), Span("a", 1))), collected)
    state, num = e.request_state("a"), len(collected["a"])
    assert state is (State.ABORTED if end == "error" else State.FINISHED) and num == 2
    for _ in range(3):
        out = step(e, StepPlan(rows=(Span("a", 1), Span("b", 1))), collected)
        assert out.rows.valid.tolist() == [False, True] and not out.rows.codes[0].any()
        assert "a" not in frames(out) and all(f.request_id != "a" for f in out.finished)
        assert e.request_state("a") is state and int(e.table.num_frames[e.ledger.records["a"].slot]) == num
    assert collected["a"] == list(alone(a).frames)
    assert collected["b"] == list(alone(b).frames)[: len(collected["b"])]


# -- chunked prefill ---------------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [(4, 1), (1, 1, 1, 1, 1), (5,), (2, 2, 1)])
def test_one_token_final_prefill_chunk_is_prefill_not_decode(chunks):
    # Hazard (mtp.md 6.11, Breeze-TTS-2 #7084): phase taken from the span length, so a
    # 1-token final chunk looked like a decode row (and a mid-prompt hidden state produced a
    # frame). Phase comes from num_computed < prompt_len: only the final chunk samples, and
    # it samples frame 0 from the prompt.
    a, d = req("a"), req("d", prompt=(8, 8), seed=9)
    ref = alone(a).frames
    e = engine(2)
    e.step(StepPlan(new_requests=(a, d), rows=(Span("d", 2),)))
    for i, n in enumerate(chunks):
        out = e.step(StepPlan(rows=(Span("d", 1), Span("a", n))))
        final = i == len(chunks) - 1
        assert ("a" in frames(out)) == final
        assert e.request_state("a") is (State.DECODING if final else State.PREFILLING)
    assert frames(out)["a"] == (0, ref[0])
    assert e.ledger.records["a"].num_computed == 5


def test_context_exhaustion_finishes_with_length():
    # Hazard: a decode input past the KV cache. The request ends with reason length once the
    # next input would not fit (frames = context - prompt + 1), never writing out of range.
    model = lambda: ScriptedTalker(max_context=8, dtype=torch.float64)  # noqa: E731
    a = req("a", prompt=(1, 2, 3, 4, 5, 6), max_frames=100)
    e = engine(1, model)
    out = e.step(StepPlan(new_requests=(a,), rows=(Span("a", 6),)))
    got = drive(e, ["a"], {"a": [frames(out)["a"][1]]})
    run = run_alone(model, RequestDef.of(a), kernels="torch")
    assert got["a"] == list(run.frames) and len(got["a"]) == 3 and run.reason is FinishReason.LENGTH


# -- slot reuse ----------------------------------------------------------------------------------


def test_recycled_slot_exposes_nothing_of_its_previous_owner():
    # Hazard (mtp.md 6.13): a recycled slot read the previous request's frame, seed or
    # generator. After release + re-admission every column equals a fresh row's except the
    # identity serial, and the new request's frames equal its alone run.
    old = req("old", prompt=(9, 9, 9, 9), max_frames=4, seed=123456789)
    new = req("new", prompt=(2, 7), max_frames=3, seed=42)
    e = engine(1)
    e.step(StepPlan(new_requests=(old,)))
    drive(e, ["old"])
    assert e.table.frame_log[0].any() and e.table.frame_embed[0].any()
    e.step(StepPlan(releases=("old",), new_requests=(new,)))
    fresh = engine(1)
    fresh.step(StepPlan(new_requests=(new,)))
    recycled, clean = e.table.row(0), fresh.table.row(0)
    for name in clean:
        if name != "serial":
            assert torch.equal(recycled[name], clean[name]), f"column {name} carries the previous owner's data"
    assert int(recycled["serial"]) == 2 and int(clean["serial"]) == 1
    assert not recycled["frame_embed"].any() and not recycled["frame_codes"].any() and not recycled["frame_log"].any()
    assert int(recycled["seed"]) == 42 and int(recycled["num_frames"]) == 0 and int(recycled["num_computed"]) == 0
    assert int(recycled["state"]) == State.WAITING and int(recycled["error"]) == 0
    assert not e.model.cache[0].any()
    assert drive(e, ["new"]) == {"new": list(alone(new).frames)}


# -- seeds --------------------------------------------------------------------------------------


def test_request_seed_gives_the_same_frames_in_any_batch_and_slot():
    # Hazard (mtp.md 6.9): per-row generators not honoured in batches / graphs. Noise is a
    # function of (seed, frame, codebook, token): same frames whatever the batch and slot.
    x = req("x", prompt=(5, 3, 5), max_frames=6, seed=-77)
    ref = list(alone(x).frames)
    fillers = [req(f"f{i}", prompt=(i, i + 1), max_frames=8, seed=i) for i in range(3)]
    e, got = engine(4), {}
    step(e, StepPlan(new_requests=tuple(fillers), rows=tuple(Span(f.request_id, 2) for f in fillers)), got)
    step(e, StepPlan(new_requests=(x,), rows=(Span("f2", 1), Span("x", 3), None, Span("f0", 1))), got)
    assert e.ledger.records["x"].slot == 3
    drive(e, ["x", "f0", "f1", "f2"], got)
    assert got["x"] == ref
    # A different seed does change the frames (the seed is really used).
    assert list(alone(RequestDef.of(x).new_request("x", seed=-78)).frames) != ref


# -- non-finite model outputs -----------------------------------------------------------------


@pytest.mark.parametrize("fault", ["nan_at", "mtp_nan_at"])
def test_nonfinite_row_ends_that_request_with_error_only(fault):
    # Hazard: a NaN in one row poisoning the batch or the slot table. The bad row's request
    # ends with reason error (after the frames before it); every other request is unchanged.
    a, bad, c = req("a", seed=1), req("bad", prompt=(4, 2), seed=2, **{fault: 1}), req("c", prompt=(6, 6, 6), seed=3)
    e, collected, ended = engine(3), {}, {}
    step(e, StepPlan(new_requests=(a, bad, c), rows=(Span("bad", 2), Span("c", 3), Span("a", 5))), collected)
    while any(e.request_state(r) not in (State.FINISHED, State.ABORTED) for r in ("a", "bad", "c")):
        rows = tuple(Span(r, 1) for r in ("c", "bad", "a") if e.request_state(r) is State.DECODING)
        out = step(e, StepPlan(rows=rows), collected)
        ended.update({f.request_id: f for f in out.finished})
    assert ended["bad"].reason is FinishReason.ERROR and ended["bad"].num_frames == 1
    assert e.request_state("bad") is State.ABORTED and len(collected["bad"]) == 1
    assert collected["a"] == list(alone(a).frames) and collected["c"] == list(alone(c).frames)
    assert not e.table.error.any()
    e.step(StepPlan(releases=("bad",), new_requests=(req("d", seed=8, max_frames=2),), rows=(Span("d", 5),)))
