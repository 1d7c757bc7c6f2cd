"""Verify positions as rows (`SpeculativeStep.verify_positions`: one draw over every position,
the verify loop's stages over all positions at once) against the loop it replaced, run
position by position (`mtp_fsm.testing.verify_loop`), at every step of random speculative
runs: the same packed frames and the same slot table after each step, on the torch backend
and (interpret mode) the Triton one."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from mtp_fsm.engine import LockstepEngine, SchedulingPolicy
from mtp_fsm.engine.speculation import SpeculativeStep
from mtp_fsm.kernels.contract import OUT_CODES, OUT_NUM_COMPUTED, OUT_STATE, OUT_VALID
from mtp_fsm.sampling import SamplingParams
from mtp_fsm.testing import ScriptInputs
from mtp_fsm.testing.alone import RequestDef, torch_threads
from mtp_fsm.testing.scripted import ScriptedTalker
from mtp_fsm.testing.verify_loop import verify_position_by_position

FAST = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


def _columns(table) -> dict[str, torch.Tensor]:
    """Every column's real rows (the scratch row's content is never read)."""
    return {name: column[: table.max_slots].clone() for name, column in table.columns().items()}


class Compared:
    """Wraps SpeculativeStep.verify_positions: each call runs the per-position loop on the
    table as it is, keeps its result and table, restores the table, runs the real executor
    and compares."""

    def __init__(self):
        self.calls = self.frames = 0
        self.real = SpeculativeStep.verify_positions

    def __call__(self, step, batch, verify, drafts, hidden):
        table = step.table
        before = {name: column.clone() for name, column in table.columns().items()}
        want = verify_position_by_position(step, batch, verify, drafts, hidden)
        want_table = _columns(table)
        for name, column in table.columns().items():
            column.copy_(before[name])
        got = self.real(step, batch, verify, drafts, hidden)
        assert torch.equal(got[:, OUT_VALID], want[:, OUT_VALID])
        valid = want[:, OUT_VALID] == 1
        assert torch.equal(got[valid], want[valid]), "published frames differ"
        assert torch.equal(got[:, OUT_STATE:OUT_NUM_COMPUTED + 1], want[:, OUT_STATE:OUT_NUM_COMPUTED + 1])
        assert torch.equal(got[:, OUT_CODES:], want[:, OUT_CODES:])
        for name, column in _columns(table).items():
            assert torch.equal(column, want_table[name]), f"column {name} differs"
        self.calls += 1
        self.frames += int(valid.sum())
        return got


@st.composite
def workloads(draw):
    defs = []
    for _ in range(draw(st.integers(1, 5))):
        prompt = tuple(draw(st.lists(st.integers(0, 96), min_size=1, max_size=10)))
        event = draw(st.sampled_from(["none", "none", "eos", "nan"]))
        at = draw(st.integers(0, 10))
        inputs = ScriptInputs(prompt, eos_at=at if event == "eos" else None, nan_at=at if event == "nan" else None)
        cb0 = draw(st.sampled_from([SamplingParams(top_k=1), SamplingParams(), SamplingParams(temperature=0.5, top_k=3),
                                    SamplingParams(repetition_penalty=1.3, top_k=2),
                                    SamplingParams(repetition_penalty=0.7, temperature=0.8)]))
        frames = draw(st.sampled_from([1, 2, 5, 12, 96]))
        defs.append(RequestDef(inputs, frames, draw(st.integers(0, 3)), cb0, min_frames=draw(st.sampled_from([None, 0, 3]))))
    return defs


def run_compared(monkeypatch, kernels: str, k: int, definitions, draft_miss: int, slots: int, chunk: int,
                 max_context: int = 96) -> Compared:
    compared = Compared()

    def verify_positions(step, batch, verify, drafts, hidden):
        return compared(step, batch, verify, drafts, hidden)

    monkeypatch.setattr(SpeculativeStep, "verify_positions", verify_positions)
    model = ScriptedTalker(num_codebooks=1, dtype=torch.float64, draft_miss=draft_miss, max_context=max_context)
    engine = LockstepEngine(model, slots, kernels=kernels, speculate=k,
                            policy=SchedulingPolicy(token_budget=24, prefill_chunk=chunk, preempt_after_steps=1))
    engine.generate([d.new_request(f"r{i}") for i, d in enumerate(definitions)])
    return compared


@settings(FAST, max_examples=30)
@given(k=st.integers(1, 4), definitions=workloads(), draft_miss=st.sampled_from([0, 0, 2, 3]),
       slots=st.integers(1, 4), chunk=st.sampled_from([1, 3, 64]))
def test_rows_executor_equals_the_per_position_loop(monkeypatch, k, definitions, draft_miss, slots, chunk):
    compared = run_compared(monkeypatch, "torch", k, definitions, draft_miss, slots, chunk)
    assert compared.calls > 0


def test_the_comparison_sees_accepts_misses_ends_and_the_context_edge(monkeypatch):
    """A fixed run that exercises the verify loop's every outcome (so the property above can
    fail where it matters): long accepted runs, misses, EOS, a NaN sample, length and context ends."""
    definitions = [
        RequestDef(ScriptInputs((1, 2, 3)), 40, 1, SamplingParams(top_k=1)),
        RequestDef(ScriptInputs((5, 6), eos_at=6), 40, 2, SamplingParams(top_k=1), min_frames=3),
        RequestDef(ScriptInputs((7,), nan_at=4), 40, 3, SamplingParams(top_k=1)),
        RequestDef(ScriptInputs((9, 9, 9)), 7, 4, SamplingParams(temperature=0.9, top_k=5, repetition_penalty=1.4)),
        RequestDef(ScriptInputs((2, 4)), 200, 5, SamplingParams(top_k=1)),  # ends by the context
    ]
    compared = run_compared(monkeypatch, "torch", 3, definitions, draft_miss=3, slots=3, chunk=2, max_context=24)
    assert compared.calls > 5 and compared.frames > 40


@pytest.mark.parametrize("k,draft_miss,penalty", [(1, 0, None), (3, 2, 1.3), (4, 3, 0.8)])
def test_triton_rows_executor_equals_the_per_position_loop(monkeypatch, k, draft_miss, penalty):
    """The Triton kernels (interpret mode) against the per-position loop run with the Triton
    backend's own sample and publish stages."""
    if torch.cuda.is_available():
        pytest.skip("the scripted talkers run on the CPU; `make gpu-check` covers the GPU")
    pytest.importorskip("triton")
    definitions = [
        RequestDef(ScriptInputs((1, 2, 3)), 14, 1, SamplingParams(top_k=1, repetition_penalty=penalty)),
        RequestDef(ScriptInputs((5, 6), eos_at=5), 14, 2, SamplingParams(top_k=1), min_frames=2),
        RequestDef(ScriptInputs((7,), nan_at=3), 14, 3, SamplingParams(top_k=1)),
        RequestDef(ScriptInputs((9, 9, 9)), 6, 4, SamplingParams(temperature=0.9, top_k=5, repetition_penalty=penalty)),
        RequestDef(ScriptInputs((2, 4)), 200, 5, SamplingParams(top_k=1)),  # ends by the context
    ]
    compared = run_compared(monkeypatch, "triton", k, definitions, draft_miss, slots=3, chunk=2, max_context=20)
    assert compared.calls > 3 and compared.frames > 20
