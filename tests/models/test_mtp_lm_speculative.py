"""The tiny MTP LM decoding speculatively with its own MTP layer as the drafter: the tokens are
those of plain decoding (the same model without `speculate`), for any k, batch and
preemption schedule, and its drafts are good enough to be accepted."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from models.mtp_lm import MtpLMInputs, tiny_demo_talker
from mtp_fsm.engine import LockstepEngine, NewRequest, SchedulingPolicy
from mtp_fsm.sampling import SamplingParams
from mtp_fsm.testing.alone import torch_threads

SAMPLINGS = [SamplingParams(top_k=1), SamplingParams(), SamplingParams(temperature=0.7, top_k=20, top_p=0.9)]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


def generate(requests, k: int, max_slots: int, preempt_at=()):
    policy = SchedulingPolicy(token_budget=24, prefill_chunk=7, preempt_after_steps=1)
    engine = LockstepEngine(tiny_demo_talker(), max_slots, kernels="torch", policy=policy, speculate=k)

    def preempt(engine, output):
        if output.step in preempt_at:
            running = sorted(engine.ledger.records)
            if running:
                engine.preempt(running[output.step % len(running)])

    results = engine.generate(requests, on_step=preempt)
    return {rid: ([int(f.codes[0]) for f in g.frames], g.finished.reason) for rid, g in results.items()}, engine


@settings(deadline=None, max_examples=8, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(1, 4), max_slots=st.integers(1, 3), data=st.data())
def test_speculative_tokens_equal_plain_decoding(k, max_slots, data):
    texts = data.draw(st.lists(st.text("abcdefgh ", min_size=1, max_size=10), min_size=1, max_size=4), label="texts")
    requests = [NewRequest(f"r{i}", MtpLMInputs(text=t), data.draw(st.integers(1, 40), label="frames"), seed=i,
                           cb0_sampling=data.draw(st.sampled_from(SAMPLINGS), label="sampling"))
                for i, t in enumerate(texts)]
    preempt_at = data.draw(st.sets(st.integers(0, 20), max_size=3), label="preempt at")
    plain, _ = generate(requests, 0, max_slots)
    speculative, engine = generate(requests, k, max_slots, preempt_at)
    assert speculative == plain
    assert engine.lifecycle.name == "speculative"


def test_the_mtp_drafter_is_accepted_often_on_greedy_text():
    requests = [NewRequest(f"r{i}", MtpLMInputs(text=t), 30, seed=i, cb0_sampling=SamplingParams(top_k=1))
                for i, t in enumerate(["hello", "speculate", "abc"])]
    plain, _ = generate(requests, 0, 3)
    speculative, engine = generate(requests, 2, 3)
    assert speculative == plain
    # Measured ~0.74 at k=2 on the tiny wired model (greedy); a random MTP layer gets ~0.
    assert engine.speculation.acceptance_rate > 0.5, engine.speculation
