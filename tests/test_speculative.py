"""Speculative decoding (engine speculate=k, the `speculative` lifecycle): the frames are those
of plain decoding for any k, draft quality, batch, chunking and preemption schedule, and the
verify row's width rules hold. The reference is each request run alone in a plain (k = 0,
`single_codebook`) one-slot engine."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from mtp_fsm.engine import LockstepEngine, NewRequest, SchedulingPolicy, Span, StepPlan
from mtp_fsm.errors import ModelBindingError, PlanError
from mtp_fsm.lifecycle import FinishReason, State, Trigger, compile_lifecycle, lifecycle_for
from mtp_fsm.sampling import SamplingParams
from mtp_fsm.testing import ScriptInputs
from mtp_fsm.testing.alone import RequestDef, run_alone, scripted_mtp, scripted_single, torch_threads
from mtp_fsm.testing.scripted import ScriptedTalker
from mtp_fsm.testing.strategies import draft_policies

FAST = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
GREEDY = SamplingParams(top_k=1)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


def drafting_talker(draft_miss: int = 0) -> ScriptedTalker:
    return ScriptedTalker(num_codebooks=1, dtype=torch.float64, draft_miss=draft_miss)


@functools.lru_cache(maxsize=None)
def alone(definition: RequestDef):
    return run_alone(scripted_single, definition)


@st.composite
def request_defs(draw, max_context: int = 96):
    prompt = tuple(draw(st.lists(st.integers(0, 96), min_size=1, max_size=12)))
    frames = draw(st.sampled_from([1, 3, 8, 20, max_context]))  # max_context: ends by the context
    event = draw(st.sampled_from(["none", "none", "eos", "nan"]))
    at = draw(st.integers(0, 12))
    inputs = ScriptInputs(prompt, eos_at=at if event == "eos" else None, nan_at=at if event == "nan" else None)
    cb0 = draw(st.sampled_from([GREEDY, GREEDY, SamplingParams(), SamplingParams(temperature=0.5, top_k=3),
                                SamplingParams(repetition_penalty=1.3, top_k=2)]))
    return RequestDef(inputs, frames, draw(st.integers(0, 3)), cb0, min_frames=draw(st.sampled_from([None, 0, 2])))


def run_speculative(definitions, k: int, *, draft_miss: int, max_slots: int, policy: SchedulingPolicy,
                    preempt_at: dict[int, int], kernels: str = "torch", abort_at: dict[int, int] | None = None,
                    draft_policy=None):
    engine = LockstepEngine(drafting_talker(draft_miss), max_slots, kernels=kernels, policy=policy, speculate=k,
                            draft_policy=draft_policy)
    requests = [d.new_request(f"r{i}") for i, d in enumerate(definitions)]
    frames = {r.request_id: [] for r in requests}
    ended = {}
    for r in requests:
        engine.add_request(r)
    step = 0
    while (out := engine.step()) is not None:
        for f in out.frames:
            frames[f.request_id].append((f.index, tuple(int(c) for c in f.codes)))
        for f in out.finished:
            ended[f.request_id] = (f.reason, f.detail)
        victim = preempt_at.get(step)
        if victim is not None and f"r{victim}" in engine.ledger.records:
            engine.preempt(f"r{victim}")
        victim = (abort_at or {}).get(step)
        if victim is not None and f"r{victim}" not in ended:
            engine.abort(f"r{victim}")
        step += 1
        assert step < 2000, "speculative engine did not finish"
    return frames, ended, engine


@settings(FAST, max_examples=40)
@given(k=st.integers(1, 4), definitions=st.lists(request_defs(), min_size=1, max_size=5),
       draft_miss=st.sampled_from([0, 0, 2, 3]), max_slots=st.integers(1, 4),
       budget=st.integers(5, 24), chunk=st.integers(1, 16),
       preempt_at=st.dictionaries(st.integers(0, 30), st.integers(0, 4), max_size=4), draft_policy=draft_policies())
def test_frames_equal_plain_decoding_for_any_k_batch_and_preemption(k, definitions, draft_miss, max_slots, budget,
                                                                     chunk, preempt_at, draft_policy):
    """The central property: every request publishes exactly its plain-decoding frames (codes
    and indices) and ends for the same reason, whatever k, the draft policy (how many of the k
    drafts each step proposes), the draft quality, the batch, the prefill chunking and the
    preemptions (a resumed request re-drafts from its replay)."""
    policy = SchedulingPolicy(token_budget=max(budget, k + 1), prefill_chunk=chunk, preempt_after_steps=1)
    frames, ended, _ = run_speculative(definitions, k, draft_miss=draft_miss, max_slots=max_slots, policy=policy,
                                       preempt_at=preempt_at, draft_policy=draft_policy)
    for i, d in enumerate(definitions):
        want = alone(d)
        got = frames[f"r{i}"]
        assert [index for index, _ in got] == list(range(len(got))), f"r{i}: frame indices {got}"
        assert tuple(codes for _, codes in got) == want.frames, f"r{i} (k={k}): frames differ from plain decoding"
        assert ended[f"r{i}"][0] is want.reason, f"r{i}: ended {ended[f'r{i}']} but plain decoding {want.reason}"
        if want.reason is FinishReason.ERROR:
            assert ended[f"r{i}"][1] == want.detail


@settings(FAST, max_examples=15)
@given(k=st.integers(1, 4), definitions=st.lists(request_defs(), min_size=1, max_size=4),
       abort_at=st.dictionaries(st.integers(0, 12), st.integers(0, 3), min_size=1, max_size=3),
       preempt_at=st.dictionaries(st.integers(0, 12), st.integers(0, 3), max_size=2), draft_policy=draft_policies())
def test_aborted_requests_publish_a_prefix_of_plain_decoding(k, definitions, abort_at, preempt_at, draft_policy):
    """A client abort at any step boundary (a request verifying, drafting or preempted) ends
    only that request: its frames are a prefix of its plain ones, the others are untouched."""
    policy = SchedulingPolicy(token_budget=16, prefill_chunk=4, preempt_after_steps=1)
    frames, ended, engine = run_speculative(definitions, k, draft_miss=2, max_slots=2, policy=policy,
                                            preempt_at=preempt_at, abort_at=abort_at, draft_policy=draft_policy)
    for i, d in enumerate(definitions):
        want, got = alone(d), tuple(codes for _, codes in frames[f"r{i}"])
        if f"r{i}" not in ended:  # aborted while still queued: dropped, never admitted
            assert got == () and i in abort_at.values()
        elif ended[f"r{i}"][0] is FinishReason.ABORT:
            assert got == want.frames[: len(got)], f"r{i}: aborted frames are not a prefix"
        else:
            assert got == want.frames and ended[f"r{i}"][0] is want.reason, f"r{i}"
    assert engine.idle and engine.num_free_slots == 2


def test_good_drafts_publish_several_frames_per_step_and_bad_ones_one():
    """Greedy targets with the scripted drafter: most steps publish k + 1 frames; with every
    draft spoiled (draft_miss=1) each step publishes exactly one (the bonus) and the frames
    are still the plain ones."""
    definition = RequestDef(ScriptInputs((5, 6, 7)), 24, 1, GREEDY)
    policy = SchedulingPolicy(token_budget=64, prefill_chunk=64)
    good, _, engine_good = run_speculative([definition], 3, draft_miss=0, max_slots=1, policy=policy, preempt_at={})
    bad, _, engine_bad = run_speculative([definition], 3, draft_miss=1, max_slots=1, policy=policy, preempt_at={})
    assert tuple(c for _, c in good["r0"]) == tuple(c for _, c in bad["r0"]) == alone(definition).frames
    # Prefill (publishes frame 0), one verify step per further frame, a last step releasing the slot.
    assert engine_bad.step_count == 1 + 23 + 1
    assert engine_good.step_count <= 1 + 23 // 3 + 1, engine_good.step_count
    stats = engine_good.speculation
    assert stats.verify_rows == engine_good.step_count - 2 and stats.proposed == 3 * stats.verify_rows
    assert stats.frames == 23
    assert stats.acceptance_rate > 0.8 and engine_bad.speculation.accepted == 0


def test_rejected_positions_roll_back_num_computed_exactly():
    """After every step a decoding row's num_computed is prompt + frames - 1 (the newest frame
    is the next input): nothing a rejected draft computed is kept."""
    engine = LockstepEngine(drafting_talker(draft_miss=3), 2, kernels="torch", speculate=4,
                            policy=SchedulingPolicy(token_budget=32, prefill_chunk=4))
    for i, prompt in enumerate([(1, 2, 3, 4, 5, 6), (9,)]):
        engine.add_request(NewRequest(f"r{i}", ScriptInputs(prompt), 30, i, GREEDY))
    saw_decoding = False
    while engine.step() is not None:
        for rid, record in engine.ledger.records.items():
            slot = record.slot
            if engine.request_state(rid) is State.DECODING:
                saw_decoding = True
                want = record.base_prompt_len + record.num_frames - 1
                assert int(engine.table.num_computed[slot]) == want, rid
    assert saw_decoding


def test_a_verify_row_has_exactly_one_plus_k_tokens():
    engine = LockstepEngine(drafting_talker(), 1, kernels="torch", speculate=2)
    req = NewRequest("a", ScriptInputs((1, 2)), 10, 0, GREEDY)
    engine.step(StepPlan(new_requests=[req], rows=[Span("a", 2)]))
    with pytest.raises(PlanError, match="'a'.*decoding.*exactly 3 tokens.*got 1"):
        engine.step(StepPlan(rows=[Span("a", 1)]))
    out = engine.step(StepPlan(rows=[Span("a", 3)]))  # nothing was lost by the refused plan
    assert len(out.frames) >= 1 and out.frames.frame_index[0] == 1


def test_engines_that_cannot_speculate_are_refused_by_name():
    with pytest.raises(ModelBindingError, match="'scripted'.*single codebook"):
        LockstepEngine(ScriptedTalker(dtype=torch.float64), 1, speculate=2)  # four codebooks
    with pytest.raises(ModelBindingError, match="token budget 2 cannot hold one verify row of 4"):
        LockstepEngine(drafting_talker(), 1, speculate=3, policy=SchedulingPolicy(token_budget=2))
    with pytest.raises(ModelBindingError, match="speculate must be an int"):
        LockstepEngine(drafting_talker(), 1, speculate=-1)
    with pytest.raises(ModelBindingError, match="verify loop"):
        LockstepEngine(drafting_talker(), 1, speculate=2, lifecycle=lifecycle_for("single_codebook"))
    assert not scripted_mtp().can_draft or scripted_mtp().spec.num_codebooks > 1


def test_a_non_finite_draft_ends_only_its_request_loudly():
    class NaNDrafter(ScriptedTalker):
        def draft(self, inputs, choose):
            drafts = super().draft(inputs, choose)
            poisoned = torch.where((inputs.token_slots[inputs.last] == 0)[:, None], float("nan"), 0.0)
            choose(poisoned.expand(-1, self.spec.backbone_vocab_size).contiguous(), 0)
            return drafts

    engine = LockstepEngine(NaNDrafter(num_codebooks=1, dtype=torch.float64), 2, kernels="torch", speculate=2)
    results = engine.generate([NewRequest(f"r{i}", ScriptInputs((i + 1, 3)), 6, i, GREEDY) for i in range(2)])
    failed = [r for r in results.values() if r.finished.reason is FinishReason.ERROR]
    assert len(failed) == 1 and "drafter, draft 0" in failed[0].finished.detail
    ok = next(r for r in results.values() if r.finished.reason is not FinishReason.ERROR)
    assert len(ok.frames) == 6


def test_the_speculative_spec_declares_draft_verify_accept_reject():
    spec = lifecycle_for("speculative")
    compiled = compile_lifecycle(spec)
    assert compiled.dest(Trigger.ACCEPT, State.FRAME_READY) == State.VERIFYING
    assert compiled.dest(Trigger.BONUS, State.FRAME_READY) == State.DRAFTING
    assert compiled.dest(Trigger.REJECT, State.DRAFTING) == State.DRAFTING
    assert compiled.dest(Trigger.DRAFT, State.DRAFTING) == State.DECODING
    assert spec.verify_loop and not lifecycle_for("single_codebook").verify_loop


def _edge_recorder(spec, fired: set):
    """A wrapper of the torch executor's run_phase that walks the stage chains itself (rules,
    not outcome tables) and records the (trigger, source) of every row's fired edge."""
    from mtp_fsm.kernels import reference
    from mtp_fsm.lifecycle import Phase
    from mtp_fsm.lifecycle.compiled import RULE_DEST, RULE_MUST, RULE_MUST_NOT, RULE_PUBLISHES

    rules = compile_lifecycle(spec).rules
    real = reference.run_phase

    def walk(lc, phase, state, owned, facts, after_publish=None, *, last=False):
        published = torch.zeros_like(owned)
        now = state.clone()
        for stage in spec.stages_of(phase):
            seen = {p: torch.where(published, after_publish[p], m) if after_publish and p in after_publish else m
                    for p, m in facts.items()}
            words = sum(m.long() << int(p) for p, m in seen.items())
            for row in owned.nonzero().flatten().tolist():
                word, source = int(words[row]), State(int(now[row]))
                for trigger in stage.triggers:
                    dest = int(rules[RULE_DEST, trigger, source])
                    must, must_not = int(rules[RULE_MUST, trigger, source]), int(rules[RULE_MUST_NOT, trigger, source])
                    if dest >= 0 and word & must == must and not word & must_not:
                        fired.add((trigger, source))
                        now[row] = dest
                        published[row] |= bool(rules[RULE_PUBLISHES, trigger, source])
                        break
        result = real(lc, phase, state, owned, facts, after_publish, last=last)
        assert torch.equal(result.state.long(), now.long()), f"{phase.label}: the chains' walk and run_phase disagree"
        return result

    return walk


def test_every_reachable_edge_of_the_speculative_spec_fires(monkeypatch):
    """A scripted run that hits every in-step edge the speculative spec declares (and the
    walk of the rules agrees with the executor at every phase). `draft` / `mtp_fail` from
    `verifying` are declared because the compiler cannot know that draft_accepted is false
    at a row's last position; they are the two that can never fire."""
    from mtp_fsm.engine.speculation import SpeculativeStep
    from mtp_fsm.kernels import reference
    from mtp_fsm.testing.verify_loop import verify_position_by_position

    spec = lifecycle_for("speculative")
    fired: set = set()
    monkeypatch.setattr(reference, "run_phase", _edge_recorder(spec, fired))
    # The engine evaluates every verify position at once (one table lookup per phase, no
    # run_phase); the loop it equals (tests/kernels/test_verify_rows.py) walks them through
    # run_phase, so the edges each position fires are seen.
    monkeypatch.setattr(SpeculativeStep, "verify_positions", verify_position_by_position)

    class PoisonedDrafter(ScriptedTalker):  # the drafter of slot 1's rows returns NaN logits at frame 2+
        def draft(self, inputs, choose):
            drafts = super().draft(inputs, choose)
            bad = (inputs.token_slots[inputs.last] == 1) & (inputs.positions[inputs.last] >= 5)
            choose(torch.where(bad[:, None], float("nan"), 0.0).expand(-1, self.spec.backbone_vocab_size).contiguous(), 1)
            return drafts

    requests = [
        NewRequest("long", ScriptInputs((1, 2, 3, 4, 5, 6)), 7, 0, GREEDY),  # chunked; length while verifying
        NewRequest("poisoned", ScriptInputs((9, 9)), 30, 1, GREEDY),  # drafter NaN: mtp_fail from drafting
        NewRequest("nan0", ScriptInputs((3,), nan_at=0), 5, 2, GREEDY),  # fail from waiting (one-token prompt)
        NewRequest("nan_late", ScriptInputs((4, 4), nan_at=3), 9, 3, GREEDY),  # fail from verifying/decoding
        NewRequest("eos", ScriptInputs((5, 1, 2), eos_at=4), 9, 4, GREEDY),
        NewRequest("sampled", ScriptInputs((6, 7)), 30, 5, SamplingParams()),  # misses (draft_miss): bonus, reject
        NewRequest("chunked_nan", ScriptInputs((1, 2, 3, 4, 5), nan_at=0), 5, 6, GREEDY),  # fail from prefilling
        NewRequest("decoding_nan", ScriptInputs((8,), nan_at=1), 5, 7, SamplingParams(top_k=1)),
    ]
    engine = LockstepEngine(PoisonedDrafter(num_codebooks=1, dtype=torch.float64, draft_miss=5), 8, kernels="torch",
                            speculate=3, policy=SchedulingPolicy(token_budget=64, prefill_chunk=2))
    engine.generate(requests)
    # An async overrun: a finished and an aborted request scheduled once more (one token each).
    engine.step(StepPlan(new_requests=[NewRequest("o1", ScriptInputs((2,)), 1, 0, GREEDY),
                                       NewRequest("o2", ScriptInputs((3,), nan_at=0), 3, 0, GREEDY)],
                         rows=[Span("o1", 1), Span("o2", 1)]))
    engine.step(StepPlan(rows=[Span("o1", 1), Span("o2", 1)]))
    in_step = {(t.trigger, s) for t in spec.transitions if t.guard is not None for s in t.sources}
    never = {(Trigger.DRAFT, State.VERIFYING), (Trigger.MTP_FAIL, State.VERIFYING)}
    missing = sorted((t.label, s.label) for t, s in in_step - never - fired)
    assert not missing, f"edges that never fired: {missing}; fired: {sorted((t.label, s.label) for t, s in fired)}"
    assert not (fired & never)
