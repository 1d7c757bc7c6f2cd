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
from mtp_fsm.testing.strategies import draft_policies


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


def _engine(k: int, slots: int, draft_miss: int, mode: str, buckets=(1, 2, 4, 8), draft_policy=None) -> LockstepEngine:
    model = ScriptedTalker(num_codebooks=1, dtype=torch.float64, draft_miss=draft_miss)
    return LockstepEngine(model, slots, kernels="torch", speculate=k, decode_graphs=mode, graph_buckets=buckets,
                          draft_policy=draft_policy)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(k=st.integers(1, 4), n=st.integers(1, 6), slots=st.integers(1, 5), draft_miss=st.sampled_from([0, 2, 3]),
       buckets=st.sampled_from([(1, 2, 4, 8), (3,), (8,), (2, 5)]), seed=st.integers(0, 50),
       interventions=st.dictionaries(st.integers(1, 12), st.tuples(st.sampled_from(["preempt", "abort"]),
                                                                   st.sampled_from([f"r{i}" for i in range(6)])),
                                     max_size=2), draft_policy=draft_policies())
def test_verify_rows_through_buckets_publish_what_the_plain_engine_publishes(k, n, slots, draft_miss, buckets, seed,
                                                                              interventions, draft_policy):
    """Whatever the draft policy: an adaptive one changes the decode width (1 + the drafts
    verified) and the drafts proposed from step to step, each pair on buckets of its own."""
    plain = _engine(k, slots, draft_miss, "off", draft_policy=draft_policy)
    padded = _engine(k, slots, draft_miss, "eager", buckets, draft_policy)
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


def test_a_width_that_changes_per_step_maps_to_buckets_of_each_width():
    """Spoiled drafts under an adaptive policy: k drafts at first (width k + 1), then none
    (width 1) and one-draft probes (width 2); every width and proposal count has its bucket
    step, and the frames are the unbucketed engine's."""
    from mtp_fsm.engine.draft_policy import DraftPolicy

    policy = DraftPolicy(prior=1.0, position_cost=0.4, probe_every=2, max_probe_every=4)
    request = NewRequest("a", ScriptInputs((1, 2, 3)), max_frames=30, seed=1, cb0_sampling=SamplingParams(top_k=1))
    padded = _engine(3, 2, 1, "eager", (2,), policy)
    plain = _engine(3, 2, 1, "off", draft_policy=policy)
    got, want = padded.generate([request]), plain.generate([request])
    assert [f.codes.tolist() for f in got["a"].frames] == [f.codes.tolist() for f in want["a"].frames]
    widths = {key[2] for key in padded.graphs.steps}
    proposals = {key[3] for key in padded.graphs.steps}
    assert {1, 2, 4} <= widths and {0, 1} <= proposals, padded.graphs.steps.keys()
    assert padded.speculation == plain.speculation and padded.speculation.accepted == 0
