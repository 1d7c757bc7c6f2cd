"""Decode buckets for verify rows: a speculative engine's decode-only steps (every row k + 1
tokens wide) run over the padded bucket buffers a CUDA graph replays; in mode "eager" on a CPU
that path is checked against the same engine with decode_graphs="off", step by step: same
frames and endings, same held slots, same drafts accepted, whatever the batch, buckets, k,
draft quality, preemptions and aborts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mtp_fsm.engine import LockstepEngine, NewRequest
from mtp_fsm.engine.decode_graphs import resolve_mode
from mtp_fsm.gpu.step_harness import live_slots_differ, outputs_equal
from mtp_fsm.kernels import reference
from mtp_fsm.sampling import SamplingParams
from mtp_fsm.testing import ScriptInputs
from mtp_fsm.testing.alone import torch_threads
from mtp_fsm.testing.scripted import ScriptedTalker


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


def _requests(n: int, seed: int) -> list[NewRequest]:
    return [NewRequest(f"r{i}", ScriptInputs(tuple(range(i, i + 2 + (seed + i) % 4)),
                                             eos_at=(None, 3 + (seed + i) % 9)[(seed + i) % 2],
                                             nan_at=5 if (seed + i) % 7 == 3 else None),
                       max_frames=4 + (seed * 3 + i) % 13, seed=seed * 31 + i,
                       cb0_sampling=SamplingParams(0.0 if i % 3 == 0 else 0.9, (0, 5)[i % 2], (1.0, 0.8)[(i // 2) % 2],
                                                   repetition_penalty=(None, 1.3)[(seed + i) % 3 == 1]))
            for i in range(n)]


def _engine(k: int, slots: int, draft_miss: int, mode: str, buckets=(1, 2, 4, 8)) -> LockstepEngine:
    model = ScriptedTalker(num_codebooks=1, dtype=torch.float64, draft_miss=draft_miss)
    return LockstepEngine(model, slots, kernels="torch", speculate=k, decode_graphs=mode, graph_buckets=buckets)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(k=st.integers(1, 4), n=st.integers(1, 6), slots=st.integers(1, 5), draft_miss=st.sampled_from([0, 2, 3]),
       buckets=st.sampled_from([(1, 2, 4, 8), (3,), (8,), (2, 5)]), seed=st.integers(0, 50),
       interventions=st.dictionaries(st.integers(1, 12), st.tuples(st.sampled_from(["preempt", "abort"]),
                                                                   st.sampled_from([f"r{i}" for i in range(6)])),
                                     max_size=2))
def test_verify_rows_through_buckets_publish_what_the_plain_engine_publishes(k, n, slots, draft_miss, buckets, seed,
                                                                              interventions):
    plain, padded = _engine(k, slots, draft_miss, "off"), _engine(k, slots, draft_miss, "eager", buckets)
    assert plain.graphs is None
    for engine in (plain, padded):
        for request in _requests(n, seed):
            engine.add_request(request)
    steps = 0
    while not plain.idle:
        a, b = plain.step(), padded.step()
        steps += 1
        assert outputs_equal(a, b), f"step {steps}"
        assert live_slots_differ(plain, padded) == [], f"step {steps}"
        action = interventions.get(steps)
        if action is not None:
            assert getattr(plain, action[0])(action[1]) == getattr(padded, action[0])(action[1])
    assert padded.idle and plain.speculation == padded.speculation
    if n == 1 and not interventions and steps >= 4:  # one request alone: its verify steps are bucketed
        assert padded.graphs.replays > 0


def test_a_lone_request_verifies_through_a_bucket():
    engine = _engine(3, 4, 0, "eager", (2,))
    engine.generate([NewRequest("a", ScriptInputs((1, 2, 3)), max_frames=20, seed=1,
                                cb0_sampling=SamplingParams(top_k=1))])
    (step,) = engine.graphs.steps.values()
    assert engine.graphs.replays >= 3 and step.width == 4 and step.batch.num_tokens == 8
    assert engine.speculation.accepted > 0


def test_auto_keeps_graphs_for_one_token_rows_until_verify_rows_are_checked_on_a_gpu():
    class Capturable:  # what the Triton module says about itself
        __name__ = "triton_kernels"
        CUDA_GRAPHS = True

    cuda = torch.device("cuda")
    assert resolve_mode("auto", cuda, Capturable, 1) == "cuda"
    assert resolve_mode("auto", cuda, Capturable, 4) == "off"
    assert resolve_mode("cuda", cuda, Capturable, 4) == "cuda"
    assert resolve_mode("eager", torch.device("cpu"), reference, 4) == "eager"
