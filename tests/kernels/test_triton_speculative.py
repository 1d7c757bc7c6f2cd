"""The Triton backend runs speculative steps like the torch one (interpret mode on the CPU):
verify positions, the draft_accepted predicate, the drafter's stage, rollback."""

from __future__ import annotations

import pytest
import torch

from mtp_fsm.engine import LockstepEngine, NewRequest, SchedulingPolicy
from mtp_fsm.engine.draft_policy import DraftPolicy
from mtp_fsm.sampling import SamplingParams
from mtp_fsm.testing import ScriptInputs
from mtp_fsm.testing.alone import RequestDef, run_alone, scripted_single, torch_threads
from mtp_fsm.testing.scripted import ScriptedTalker

REQUESTS = [
    NewRequest("a", ScriptInputs((1, 2, 3, 4, 5)), 12, 1, SamplingParams(top_k=1)),
    NewRequest("b", ScriptInputs((7, 8), eos_at=4), 12, 2, SamplingParams(top_k=1)),
    NewRequest("c", ScriptInputs((9,), nan_at=3), 12, 3, SamplingParams(top_k=1)),
    NewRequest("d", ScriptInputs((4, 4, 4)), 30, 4, SamplingParams(temperature=0.7, top_k=4)),
]


def run(kernels: str, k: int, draft_miss: int = 3, draft_policy=None):
    model = ScriptedTalker(num_codebooks=1, dtype=torch.float64, draft_miss=draft_miss)
    engine = LockstepEngine(model, 2, kernels=kernels, speculate=k, draft_policy=draft_policy,
                            policy=SchedulingPolicy(token_budget=12, prefill_chunk=2, preempt_after_steps=1))
    log = []
    for r in REQUESTS:
        engine.add_request(r)
    step = 0
    while (out := engine.step()) is not None:
        log += [(step, f.request_id, f.index, tuple(f.codes.tolist())) for f in out.frames]
        log += [(step, f.request_id, f.reason, f.detail) for f in out.finished]
        step += 1
    return log, engine.speculation


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    if torch.cuda.is_available():
        pytest.skip("the scripted talkers run on the CPU; `make gpu-check` covers the GPU")
    with torch_threads(1):
        yield


@pytest.mark.parametrize("k,draft_miss,draft_policy", [
    (1, 0, None), (2, 2, None), (2, 2, DraftPolicy(adaptive=False)),
    # Spoiled drafts: k at first, then steps without drafts (one position) and one-draft probes.
    (3, 1, DraftPolicy(prior=1.0, position_cost=0.4, probe_every=2, max_probe_every=2)),
])
def test_triton_speculative_engine_equals_torch_engine_and_plain_decoding(k, draft_miss, draft_policy):
    """Step by step the same frames, endings and acceptance counts as the torch backend, and
    every request's frames are its plain-decoding ones (identity on this backend too), under
    the fixed and adaptive draft policies."""
    triton_log, triton_stats = run("triton", k, draft_miss, draft_policy)
    torch_log, torch_stats = run("torch", k, draft_miss, draft_policy)
    assert triton_log == torch_log
    assert triton_stats == torch_stats and torch_stats.accepted < torch_stats.proposed
    assert (torch_stats.accepted == 0) == (draft_miss == 1)
    if draft_miss == 1:
        assert torch_stats.drafts_per_row < k  # it backed off
    for r in REQUESTS:
        want = run_alone(scripted_single, RequestDef.of(r))
        frames = tuple(entry[3] for entry in triton_log if entry[1] == r.request_id and isinstance(entry[3], tuple))
        (reason,) = [entry[2] for entry in triton_log if entry[1] == r.request_id and isinstance(entry[3], str)]
        assert frames == want.frames and reason is want.reason, r.request_id
