"""Engine-owned padded decode buckets (`decode_graphs`): decode-only steps run over persistent
buffers padded to a bucket size, the path a CUDA graph replays. In mode "eager" the same
buffers run without capture, so on a CPU the path is checked against the plain engine
(decode_graphs="off"), a separate dispatch, step by step: same frames, same endings, the
same held slots (integer columns bit for bit, float columns to rounding: a matmul over a
padded batch may round differently), whatever the batch, buckets, variant, preemptions and
aborts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from mtp_fsm.engine import LockstepEngine, NewRequest
from mtp_fsm.errors import KernelBackendError
from mtp_fsm.gpu.step_harness import live_slots_differ, outputs_equal
from mtp_fsm.sampling import SamplingParams
from mtp_fsm.testing import ScriptInputs
from mtp_fsm.testing.alone import (
    scripted_delay, scripted_mtp, scripted_mtp_stop_deferred, scripted_single, scripted_stop_head, torch_threads,
)

MODELS = {"mtp": scripted_mtp, "single_codebook": scripted_single, "mtp_stop_deferred": scripted_mtp_stop_deferred,
          "delay_pattern": scripted_delay, "stop_head": scripted_stop_head}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


def _requests(n: int, seed: int) -> list[NewRequest]:
    out = []
    for i in range(n):
        eos = (None, 3 + (seed + i) % 6)[(seed + i) % 2]
        out.append(NewRequest(
            f"r{i}", ScriptInputs(tuple(range(i, i + 2 + (seed + i) % 4)), eos_at=eos,
                                  nan_at=4 if (seed + i) % 7 == 3 else None),
            max_frames=4 + (seed * 3 + i) % 9, seed=seed * 31 + i,
            cb0_sampling=SamplingParams(0.0 if i % 3 == 0 else 0.9, (0, 5)[i % 2], (1.0, 0.8)[(i // 2) % 2]),
            mtp_sampling=SamplingParams(0.8, 4, 1.0)))
    return out


def _run_pair(plain: LockstepEngine, padded: LockstepEngine, requests, interventions: dict[int, tuple[str, str]]):
    for engine in (plain, padded):
        for request in requests:
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
    assert padded.idle
    return steps


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    model=st.sampled_from(sorted(MODELS)),
    n=st.integers(1, 7),
    slots=st.integers(1, 6),
    buckets=st.sampled_from([(1, 2, 4, 8), (3,), (8,), (2, 5)]),
    seed=st.integers(0, 50),
    interventions=st.dictionaries(st.integers(1, 12), st.tuples(st.sampled_from(["preempt", "abort"]),
                                                                st.sampled_from([f"r{i}" for i in range(7)])),
                                  max_size=3),
)
def test_padded_buckets_publish_what_the_plain_engine_publishes(model, n, slots, buckets, seed, interventions):
    plain = LockstepEngine(MODELS[model](), slots, decode_graphs="off")
    padded = LockstepEngine(MODELS[model](), slots, decode_graphs="eager", graph_buckets=buckets)
    assert plain.graphs is None
    steps = _run_pair(plain, padded, _requests(n, seed), interventions)
    if n == 1 and not interventions and steps >= 4:  # one request alone: its decode steps are bucketed
        assert padded.graphs.replays > 0


def test_modes_are_checked_by_name():
    with pytest.raises(KernelBackendError, match="decode_graphs='cuda' needs a CUDA device"):
        LockstepEngine(scripted_single(), 2, decode_graphs="cuda")
    with pytest.raises(KernelBackendError, match="unknown decode_graphs mode 'sometimes'"):
        LockstepEngine(scripted_single(), 2, decode_graphs="sometimes")
    with pytest.raises(KernelBackendError, match="buckets must be positive"):
        LockstepEngine(scripted_single(), 2, decode_graphs="eager", graph_buckets=(0, 4))
    assert LockstepEngine(scripted_single(), 2).graphs is None  # auto on a CPU: off


def test_a_steady_batch_loads_its_rows_once():
    engine = LockstepEngine(scripted_single(), 4, decode_graphs="eager", graph_buckets=(4,))
    requests = [NewRequest(f"r{i}", ScriptInputs((1, 2)), max_frames=12, seed=i) for i in range(3)]
    loads = []
    engine.generate(requests, on_step=lambda eng, out: loads.append(
        [s._loaded for s in eng.graphs.steps.values()]))
    distinct = {id(batch) for snapshot in loads for batch in snapshot if batch is not None}
    assert engine.graphs.replays >= 8 and len(distinct) == 1  # one steady StepBatch, loaded once
