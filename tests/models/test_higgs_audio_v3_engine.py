"""Higgs Audio v3 in the engine: every published frame set shows the exact delay pattern
(ramp-up, EOC wind-down, nothing after the wind-down's last frame), and unsupported sampling is
refused at admission by name. Batched == alone and preemption are tests/models/test_zoo.py's."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from mtp_fsm.engine import LockstepEngine, NewRequest, SchedulingPolicy
from mtp_fsm.errors import AdmissionError
from mtp_fsm.lifecycle import FinishReason
from mtp_fsm.sampling import GREEDY, SamplingParams
from mtp_fsm.testing.alone import torch_threads
from mtp_fsm.testing.delay_check import delay_pattern_problems

higgs = pytest.importorskip("models.higgs_audio_v3")


@pytest.fixture(scope="module")
def model():
    with torch_threads(1):
        yield higgs.tiny_demo_talker(seed=0)


SAMPLING = st.sampled_from([GREEDY, SamplingParams(), SamplingParams(0.8, 20, 0.9), SamplingParams(1.2, 0, 1.0)])


@settings(deadline=None, max_examples=8, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.text(alphabet="ab xyz.", min_size=1, max_size=10).filter(str.strip), min_size=1, max_size=4),
       seeds=st.lists(st.integers(0, 2**40), min_size=4, max_size=4), sampling=SAMPLING,
       max_frames=st.integers(1, 40), budget=st.integers(1, 24))
def test_published_frames_follow_the_delay_pattern(model, texts, seeds, sampling, max_frames, budget):
    spec = model.spec
    engine = LockstepEngine(model, 3, kernels="torch",
                            policy=SchedulingPolicy(token_budget=budget, prefill_chunk=5, preempt_after_steps=2))
    try:
        requests = [NewRequest(f"r{i}", higgs.text_inputs(t), max_frames, seeds[i], sampling, sampling)
                    for i, t in enumerate(texts)]
        with torch_threads(1):
            results = engine.generate(requests)
    finally:
        engine.close()
    for rid, result in results.items():
        frames = [tuple(int(c) for c in f.codes) for f in result.frames]
        assert delay_pattern_problems(frames, spec.delay_pattern, result.finished.reason) == [], rid
        if result.finished.reason is not FinishReason.EOS:
            assert result.finished.reason is FinishReason.LENGTH and len(frames) == max_frames


@pytest.mark.parametrize("overrides, needle", [
    ({"cb0_sampling": SamplingParams(repetition_penalty=1.2)}, "repetition_penalty"),
    ({"min_frames": 3}, "min_frames"),
])
def test_unsupported_sampling_is_refused_by_name(model, overrides, needle):
    engine = LockstepEngine(model, 1, kernels="torch")
    try:
        request = NewRequest("pen", higgs.text_inputs("ab"), 4, **overrides)
        with pytest.raises(AdmissionError, match=rf"'pen'.*{needle}.*higgs_audio_v3.*delay pattern"):
            engine.add_request(request)
        assert not engine.ledger.records  # nothing half-admitted
    finally:
        engine.close()
