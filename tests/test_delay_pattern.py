"""The delay pattern (Higgs Audio v3's): the engine's vectorised constraints against the
interpreter's per-row restatement, and published frames that show the exact ramp-up and
wind-down for any EOC step, under batching, chunked prefill and preemption."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from mtp_fsm.engine import LockstepEngine, SchedulingPolicy
from mtp_fsm.errors import AdmissionError
from mtp_fsm.lifecycle import FinishReason
from mtp_fsm.model_api import DelayPattern
from mtp_fsm.sampling import GREEDY, SamplingParams
from mtp_fsm.sampling.delay_pattern import DelayRows
from mtp_fsm.testing.alone import RequestDef, run_alone, scripted_delay, torch_threads
from mtp_fsm.testing.delay_check import delay_pattern_problems
from mtp_fsm.testing.interpreter import delay_pattern_row
from mtp_fsm.testing.scripted import ScriptInputs

FAST = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=60)
PATTERN = DelayPattern(boc=6, eoc=7)  # ids 0..5 are codes
SCRIPTED = scripted_delay().spec  # 4 codebooks; its own BOC / EOC


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


@st.composite
def histories(draw):
    """A row's published frames so far (any ids, fillers included) and the codebook to mask."""
    q = draw(st.integers(1, 6))
    frames = draw(st.lists(st.lists(st.integers(0, 7), min_size=q, max_size=q).map(tuple), max_size=9))
    return q, frames, draw(st.integers(0, q - 1))


@FAST
@given(st.lists(histories(), min_size=1, max_size=5), st.integers(0, 2**31))
def test_engine_constraints_equal_the_per_row_restatement(rows, seed):
    """DelayRows (one batch, tensors) masks exactly what delay_pattern_row (one row, ints) does."""
    g = torch.Generator().manual_seed(seed)
    for q in {r[0] for r in rows}:
        batch = [r for r in rows if r[0] == q]
        index = torch.tensor([len(f) for _, f, _ in batch])
        last = torch.tensor([list(f[-1]) if f else [0] * q for _, f, _ in batch], dtype=torch.int64)
        before = torch.tensor([list(f[-2]) if len(f) > 1 else [0] * q for _, f, _ in batch], dtype=torch.int64)
        delay = DelayRows(PATTERN, index, last, before)
        logits = torch.randn(len(batch), 8, generator=g, dtype=torch.float64)
        for codebook in range(q):
            got = delay.apply(logits, codebook)
            for i, (_, frames, _) in enumerate(batch):
                want = delay_pattern_row(logits[i], PATTERN, list(frames), codebook)
                assert torch.equal(got[i], want), (frames, codebook, got[i], want)


def _drive(definitions, max_slots, policy, preempt_at):
    """Frames and endings of the requests in one engine; preempt_at: step -> request ids."""
    engine = LockstepEngine(scripted_delay(), max_slots, kernels="torch", policy=policy)
    for i, d in enumerate(definitions):
        engine.add_request(d.new_request(f"r{i}"))
    frames = {f"r{i}": [] for i in range(len(definitions))}
    ended, preempted = {}, []
    for step in range(600):
        for rid in preempt_at.get(step, ()):
            if engine.preempt(rid):
                preempted.append((step, rid, len(frames[rid])))
        out = engine.step()
        if out is None:
            break
        for f in out.frames:
            assert f.index == len(frames[f.request_id])
            frames[f.request_id].append(tuple(int(c) for c in f.codes))
        ended.update({f.request_id: f.reason for f in out.finished})
    engine.close()
    return frames, ended, preempted


REQUESTS = st.builds(
    RequestDef,
    st.builds(ScriptInputs, st.lists(st.integers(0, 96), min_size=1, max_size=6).map(tuple),
              eos_at=st.one_of(st.none(), st.integers(0, 14))),
    max_frames=st.integers(1, 22), seed=st.integers(0, 2**40),
    cb0=st.sampled_from([GREEDY, SamplingParams(), SamplingParams(0.8, 3, 0.9)]),
    mtp=st.sampled_from([GREEDY, SamplingParams(), SamplingParams(1.2, 0, 0.7)]),
)


@settings(FAST, max_examples=25)
@given(st.lists(REQUESTS, min_size=1, max_size=4), st.integers(1, 4),
       st.builds(SchedulingPolicy, token_budget=st.integers(1, 12), prefill_chunk=st.integers(1, 6)),
       st.dictionaries(st.integers(0, 40), st.sets(st.sampled_from(["r0", "r1", "r2", "r3"]), max_size=2), max_size=4))
def test_any_eoc_step_gives_the_exact_ramp_up_and_wind_down(definitions, max_slots, policy, preempt_at):
    """Whatever frame codebook 0 first samples EOC at (forced at eos_at, or sampled), the
    frames hold BOC in codebook q before frame q, EOC in codebook q from q + 1 frames after it,
    no filler elsewhere, and the request ends eos exactly with the wind-down's last frame (or
    by length before it); batching, chunking and preemption change no frame."""
    preempt_at = {s: {r for r in rids if int(r[1:]) < len(definitions)} for s, rids in preempt_at.items()}
    frames, ended, _ = _drive(definitions, max_slots, policy, preempt_at)
    for i, d in enumerate(definitions):
        rid = f"r{i}"
        alone = run_alone(scripted_delay, d)
        assert tuple(frames[rid]) == alone.frames and ended[rid] is alone.reason
        assert delay_pattern_problems(frames[rid], SCRIPTED.delay_pattern, ended[rid]) == []
        eoc_at = next((f for f, c in enumerate(frames[rid]) if c[0] == SCRIPTED.delay_pattern.eoc), None)
        if d.inputs.eos_at is not None and d.inputs.eos_at < d.max_frames:
            assert eoc_at is not None and eoc_at <= d.inputs.eos_at
        wind_down = SCRIPTED.num_codebooks - 1
        if eoc_at is not None and eoc_at + wind_down < d.max_frames:
            assert ended[rid] is FinishReason.EOS and len(frames[rid]) == eoc_at + wind_down + 1


def _upstream_wind_down(num_codebooks: int, frames: list[tuple[int, ...]], eoc: int):
    """boson-multimodal's `_sample_audio_tokens` delay bookkeeping, restated as a counter over
    the frames: which codebooks each frame must hold as EOC, and after how many frames the
    audio ends (None: not ended). Codebook 0's first EOC starts `num_remaining_delays` at
    Q - 1; each later frame forces codebooks [0, Q - remaining) to EOC, then counts down;
    the frame that brings it to 0 is the last."""
    remaining, forced = None, []
    for f, codes in enumerate(frames):
        if remaining is not None:
            forced.append(set(range(num_codebooks - remaining)))
            remaining -= 1
        elif codes[0] == eoc:
            forced.append({0})
            remaining = num_codebooks - 1
        else:
            forced.append(set())
        if remaining is not None and remaining <= 0:
            return forced, f + 1
    return forced, None


@pytest.mark.parametrize("eos_at", [0, 2, 3, 6])
def test_the_wind_down_is_upstreams(eos_at):
    """Issue 31, mismatch 1: frame e + j holds EOC on codebooks 0..j-1 exactly (e + 1 repeats
    e's single EOC; the last frame keeps codebook Q-1's real code), and the request ends eos
    with the frame upstream's countdown ends on."""
    d = RequestDef(ScriptInputs((5, 6, 7), eos_at=eos_at), max_frames=40, seed=11, cb0=GREEDY, mtp=SamplingParams())
    run = run_alone(scripted_delay, d)
    eoc, q = SCRIPTED.delay_pattern.eoc, SCRIPTED.num_codebooks
    forced, ends = _upstream_wind_down(q, list(run.frames), eoc)
    assert run.reason is FinishReason.EOS and ends == len(run.frames), (ends, run.frames)
    for f, codes in enumerate(run.frames):
        assert {c for c in range(q) if codes[c] == eoc} == forced[f], (f, codes)
    assert run.frames[-1][q - 1] != eoc


def test_preempted_mid_wind_down_resumes_the_same_countdown():
    """A request preempted two frames into its wind-down (and again in its ramp-up) replays
    its frames and continues the countdown where it was: the frames equal its alone run."""
    d = RequestDef(ScriptInputs((5, 6, 7), eos_at=4), max_frames=20, seed=3, cb0=GREEDY, mtp=SamplingParams())
    alone = run_alone(scripted_delay, d)
    assert alone.reason is FinishReason.EOS and len(alone.frames) == 8
    whole = SchedulingPolicy(token_budget=64, prefill_chunk=64)
    # Step 0 prefills and publishes frame 0; frame f is published at step f.
    frames, ended, preempted = _drive([d], 1, whole, {2: {"r0"}, 7: {"r0"}})
    assert tuple(frames["r0"]) == alone.frames and ended["r0"] is FinishReason.EOS
    # Once in the ramp-up (2 frames published), once two frames into the wind-down (EOC at 4).
    assert [n for _, _, n in preempted] == [2, 6], preempted


@pytest.mark.parametrize("field, value, needle", [
    ("cb0", SamplingParams(repetition_penalty=1.3), "repetition_penalty"),
    ("min_frames", 2, "min_frames"),
])
def test_history_rules_are_refused_by_name(field, value, needle):
    engine = LockstepEngine(scripted_delay(), 2, kernels="torch")
    d = RequestDef(ScriptInputs((1, 2)), max_frames=5)
    with pytest.raises(AdmissionError, match=rf"'bad'.*{needle}.*delay pattern"):
        engine.add_request(d.new_request("bad", **{"cb0_sampling" if field == "cb0" else field: value}))
    engine.add_request(d.new_request("good"))  # nothing accepted was lost; the engine goes on
    result = engine.generate([])
    assert "good" in result or engine.idle
    engine.close()
