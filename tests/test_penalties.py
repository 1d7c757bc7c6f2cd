"""CB0 history rules: repetition penalty and min_frames (contract, batch invariance, resume, admission).

The engine's frames with these rules are also held to the interpreter (an HF-style
restatement: gather / penalise / scatter over the generated ids) by the stateful suite and
tests/test_interpreter.py, whose request strategies draw penalties and min_frames.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mtp_fsm.engine import LockstepEngine, NewRequest
from mtp_fsm.errors import AdmissionError
from mtp_fsm.lifecycle import FinishReason, State
from mtp_fsm.sampling import GREEDY, SamplingParams, sample_tokens
from mtp_fsm.sampling.penalties import apply_repetition_penalty, suppress_eos
from mtp_fsm.testing import ScriptedTalker, ScriptInputs
from mtp_fsm.testing.alone import scripted_mtp_stop_deferred, torch_threads
from mtp_fsm.testing.runs import frames_alone, run_to_completion

PROPS = settings(max_examples=40, deadline=None)
MODEL = ScriptedTalker()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


def hf_penalty(row: torch.Tensor, generated: list[int], penalty: float) -> torch.Tensor:
    """One row, the way HF's processor reads: each distinct generated id once, float32."""
    out, p = row.clone(), torch.tensor(penalty, dtype=torch.float32)
    for token in set(generated):
        out[token] = out[token] * p if out[token] < 0 else out[token] / p
    return out


@PROPS
@given(st.integers(1, 5), st.integers(2, 40), st.integers(0, 2**31 - 1),
       st.lists(st.sampled_from([1.0, 1.05, 1.3, 0.6, 7.0]), min_size=5, max_size=5), st.data())
def test_penalty_equals_the_hf_restatement_row_by_row(rows, vocab, seed, penalties, data):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[logits.abs() < 0.2] = float("-inf")  # masked ids stay masked
    generated = [data.draw(st.lists(st.integers(0, vocab - 1), max_size=12)) for _ in range(rows)]
    counts = torch.stack([torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=vocab) for ids in generated])
    got = apply_repetition_penalty(logits, counts.int(), torch.tensor(penalties[:rows]))
    for r in range(rows):
        assert torch.equal(got[r], hf_penalty(logits[r], generated[r], penalties[r])), r


@PROPS
@given(st.integers(2, 6), st.integers(3, 30), st.integers(0, 2**31 - 1), st.data())
def test_rules_are_batch_invariant(rows, vocab, seed, data):
    """A row's token and fault under penalty + EOS suppression do not depend on its batch."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 2
    counts = torch.randint(0, 3, (rows, vocab), generator=g, dtype=torch.int32)
    penalty = torch.tensor(data.draw(st.lists(st.sampled_from([1.0, 1.05, 2.0, 0.5]), min_size=rows, max_size=rows)))
    frames = torch.randint(0, 4, (rows,), generator=g)
    min_frames = torch.randint(0, 4, (rows,), generator=g)
    temperature = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.9]), min_size=rows, max_size=rows)))
    top_k = torch.randint(0, vocab, (rows,), generator=g)
    top_p = torch.full((rows,), 1.0)
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=g)
    eos = vocab - 1

    def run(index):
        def rules(x):
            x = apply_repetition_penalty(x, counts[index], penalty[index])
            return suppress_eos(x, eos, frames[index], min_frames[index])
        return sample_tokens(logits[index], temperature[index], top_k[index], top_p[index], seeds[index],
                             frames[index], 0, rules=rules)

    together = run(torch.arange(rows))
    for r in range(rows):
        alone = run(torch.tensor([r]))
        assert together[0][r] == alone[0][0] and together[1][r] == alone[1][0]
    early = frames < min_frames
    assert not (together[0][early] == eos).any(), "EOS sampled before min_frames"


def test_a_suppressed_eos_that_was_the_only_choice_is_an_empty_row_fault():
    logits = torch.full((1, 5), float("-inf"))
    logits[0, 4] = 1.0
    rules = lambda x: suppress_eos(x, 4, torch.tensor([0]), torch.tensor([1]))  # noqa: E731
    _, fault = sample_tokens(logits, torch.zeros(1), torch.zeros(1, dtype=torch.int64), torch.ones(1),
                             torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 0, rules=rules)
    assert int(fault[0]) != 0


def penalised(i: int, *, eos_at: int | None, min_frames: int | None, penalty: float, greedy: bool) -> NewRequest:
    cb0 = SamplingParams(0.0, 0, 1.0, penalty) if greedy else SamplingParams(0.9, 6, 1.0, penalty)
    return NewRequest(f"r{i}", ScriptInputs(tuple(range(i, i + 3 + i)), eos_at=eos_at), max_frames=12, seed=40 + i,
                      cb0_sampling=cb0, mtp_sampling=SamplingParams(1.0, 0, 1.0), min_frames=min_frames)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 3), slots=st.integers(1, 3), chunk=st.integers(1, 5),
       penalties=st.lists(st.sampled_from([1.0, 1.05, 1.8, 0.5]), min_size=3, max_size=3),
       min_frames=st.lists(st.sampled_from([None, 0, 2, 5]), min_size=3, max_size=3),
       greedy=st.booleans(),
       preempt_steps=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 2)), max_size=5))
def test_preemption_never_changes_penalised_frames_and_counts_are_rebuilt(
        n, slots, chunk, penalties, min_frames, greedy, preempt_steps):
    reqs = [penalised(i, eos_at=4 + 2 * i, min_frames=min_frames[i], penalty=penalties[i], greedy=greedy)
            for i in range(n)]
    alone = {r.request_id: frames_alone(MODEL, r) for r in reqs}
    plan: dict[int, set[str]] = {}
    for step, who in preempt_steps:
        plan.setdefault(step, set()).add(f"r{who}")
    checked = []

    def events(step, engine):
        # Every slot-holding request's counts column equals the CB0 ids of the frames it
        # published (its log; a resumed row's was restaged from the host's copy).
        for rid, record in engine.ledger.records.items():
            if record.slot is not None and record.state is not State.PREEMPTED:
                n = int(engine.table.num_frames[record.slot])
                log = engine.table.frame_log[record.slot, :n, 0]
                want = torch.bincount(log, minlength=MODEL.spec.backbone_vocab_size)
                assert torch.equal(engine.table.cb0_counts[record.slot].long(), want), rid
                checked.append(rid)
        live = {rid for rid, r in engine.ledger.records.items()
                if r.slot is not None and r.state in (State.WAITING, State.PREFILLING, State.DECODING)}
        return {"preempts": sorted(plan.get(step, set()) & live)}

    engine = LockstepEngine(copy.deepcopy(MODEL), slots)
    frames, reasons = run_to_completion(engine, reqs, chunk=chunk, events=events)
    engine.close()
    assert frames == alone
    for r in reqs:
        floor = MODEL.spec.min_frames if r.min_frames is None else r.min_frames
        assert reasons[r.request_id] is not FinishReason.EOS or len(frames.get(r.request_id, [])) >= floor
    assert checked


@settings(max_examples=25, deadline=None)
@given(eos_at=st.integers(0, 5), min_frames=st.integers(0, 6), seed=st.integers(0, 50))
def test_no_request_ends_with_eos_before_min_frames(eos_at, min_frames, seed):
    req = NewRequest("m", ScriptInputs((1, 2, 3), eos_at=eos_at), max_frames=10, seed=seed,
                     cb0_sampling=GREEDY, min_frames=min_frames)
    result = LockstepEngine(copy.deepcopy(MODEL), 1).generate([req])["m"]
    n = len(result.frames)
    if result.finished.reason is FinishReason.EOS:
        assert n >= min_frames
    if eos_at >= min_frames:  # the forced EOS is not masked: the request ends there at the latest
        assert result.finished.reason is FinishReason.EOS and n <= eos_at


def test_model_defaults_fill_unset_fields_and_explicit_values_win():
    from models.qwen3_tts import Qwen3TTSTalker, TTSInputs, tiny_config
    talker = Qwen3TTSTalker(tiny_config(), seed=0)
    engine = LockstepEngine(talker, 2)
    engine.add_request(NewRequest("default", TTSInputs(text="hi"), max_frames=4))
    engine.add_request(NewRequest("explicit", TTSInputs(text="hi"), max_frames=4, min_frames=0,
                                  cb0_sampling=SamplingParams(repetition_penalty=1.0)))
    engine.step()
    slots = {rid: r.slot for rid, r in engine.ledger.records.items()}
    assert engine.table.cb0_penalty[slots["default"]] == torch.tensor(1.05, dtype=torch.float32)
    assert int(engine.table.min_frames[slots["default"]]) == 2
    assert engine.table.cb0_penalty[slots["explicit"]] == 1.0 and int(engine.table.min_frames[slots["explicit"]]) == 0


@pytest.mark.parametrize("fields, message", [
    ({"cb0_sampling": SamplingParams(repetition_penalty=0.0)}, "cb0 sampling: repetition_penalty must be a finite"),
    ({"cb0_sampling": SamplingParams(repetition_penalty=float("nan"))}, "repetition_penalty must be a finite"),
    ({"cb0_sampling": SamplingParams(repetition_penalty=True)}, "repetition_penalty must be a finite"),
    ({"mtp_sampling": SamplingParams(repetition_penalty=1.2)}, "applies to CB0 only"),
    ({"min_frames": -1}, "min_frames must be an int"),
    ({"min_frames": 2.0}, "min_frames must be an int"),
    ({"min_frames": True}, "min_frames must be an int"),
])
def test_bad_rule_values_are_refused_naming_the_request(fields, message):
    engine = LockstepEngine(ScriptedTalker(), 1)
    good = NewRequest("ok", ScriptInputs((1, 2)), max_frames=2)
    engine.add_request(good)
    with pytest.raises(AdmissionError, match=f"'bad'.*{message}"):
        engine.add_request(NewRequest("bad", ScriptInputs((1, 2)), max_frames=2, **fields))
    finished = []
    engine.generate([], on_step=lambda _, out: finished.extend(f.request_id for f in out.finished))
    assert finished == ["ok"]  # what was accepted still runs


def test_a_deferred_lifecycle_refuses_history_rules():
    engine = LockstepEngine(scripted_mtp_stop_deferred(), 1)
    for fields in ({"min_frames": 1}, {"cb0_sampling": SamplingParams(repetition_penalty=1.1)}):
        with pytest.raises(AdmissionError, match="not supported on a deferred lifecycle"):
            engine.add_request(NewRequest("d", ScriptInputs((1, 2)), max_frames=2, **fields))
    engine.add_request(NewRequest("d", ScriptInputs((1, 2)), max_frames=2, min_frames=0))
