"""The draft policy of speculative engines (engine/draft_policy.py): the adaptive choice of
drafts per step follows the expected accepted length against the step costs, backs off when
drafting does not pay and probes again at a doubling interval; its inputs are checked by
name; an engine's draft counts, and so its step count, are reproducible run to run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from mtp_fsm.engine import LockstepEngine, NewRequest
from mtp_fsm.engine.draft_policy import DraftController, DraftPolicy, best_drafts, expected_frames
from mtp_fsm.errors import ModelBindingError
from mtp_fsm.sampling import SamplingParams
from mtp_fsm.testing import ScriptInputs
from mtp_fsm.testing.alone import torch_threads
from mtp_fsm.testing.scripted import ScriptedTalker

costs_and_k = st.integers(1, 6).flatmap(lambda k: st.tuples(
    st.just(k), st.lists(st.floats(0.05, 20.0), min_size=k, max_size=k).map(lambda c: (1.0, *c))))


@settings(max_examples=200, deadline=None)
@given(costs_and_k, st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_more_acceptance_never_drafts_fewer(ck, a, b):
    """For d > d' the expected-frames ratio E(a, d) / E(a, d') grows with a, so the chosen
    count can only grow with the acceptance estimate (whatever the costs)."""
    k, costs = ck
    policy = DraftPolicy(step_costs=costs)
    lo, hi = sorted((a, b))
    assert best_drafts(policy, lo, k) <= best_drafts(policy, hi, k)


@settings(max_examples=200, deadline=None)
@given(costs_and_k, st.floats(0.0, 1.0))
def test_the_choice_pays_at_least_as_well_as_plain_decoding_and_is_zero_when_nothing_can(ck, a):
    k, costs = ck
    policy = DraftPolicy(step_costs=costs)
    d = best_drafts(policy, a, k)
    # Frames per unit of cost at the choice are never below plain decoding's (1 frame, cost 1).
    assert expected_frames(a, d) / costs[d] >= 1.0
    # A verify row publishes at most d + 1 frames: a step costing that much or more never pays.
    if all(costs[i] >= i + 1 for i in range(1, k + 1)):
        assert d == 0


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 5), st.integers(1, 8), st.integers(1, 4), st.integers(0, 3))
def test_rejected_drafts_back_off_to_none_and_probe_at_a_doubling_interval(k, probe, factor, extra):
    """Every draft rejected: the policy reaches 0 drafts and from then on proposes one
    draft (a probe) after probe_every idle steps, the wait doubling up to max_probe_every."""
    policy = DraftPolicy(prior=1.0, position_cost=0.5, probe_every=probe, max_probe_every=probe * factor)
    ctl = DraftController(policy, k)
    proposals = [ctl.propose]
    for _ in range(400 + extra):
        if ctl.verify:
            ctl.observe(ctl.verify, np.zeros(3, dtype=np.int64))
        ctl.advance()
        proposals.append(ctl.propose)
    assert proposals[0] == k and set(proposals) <= {0, 1, k}
    settled = proposals[proposals.index(0):]
    probes = [i for i, p in enumerate(settled) if p]
    gaps = np.diff([-1, *probes])
    assert len(probes) >= 2 and all(p == 1 for p in (settled[i] for i in probes))
    want = [min(probe * 2 ** i, probe * factor) for i in range(len(gaps))]
    assert list(gaps) == [w + 1 for w in want], (list(gaps), want)
    assert sum(settled) <= len(settled) // (probe + 1) + 1  # drafting on a bounded share of steps


def test_accepted_probes_bring_drafting_back():
    ctl = DraftController(DraftPolicy(prior=0.0, position_cost=0.1, probe_every=2), 4)
    assert ctl.propose == 0
    seen = []
    for _ in range(30):
        if ctl.verify:
            ctl.observe(ctl.verify, np.full(4, ctl.verify))  # every draft accepted
        ctl.advance()
        seen.append(ctl.propose)
    assert seen[-1] == 4 and 1 in seen


def test_the_fixed_policy_always_drafts_k():
    ctl = DraftController(DraftPolicy(adaptive=False), 3)
    for _ in range(20):
        ctl.observe(ctl.verify, np.zeros(2, dtype=np.int64))
        ctl.advance()
        assert (ctl.verify, ctl.propose) == (3, 3)


@pytest.mark.parametrize("policy, match", [
    (DraftPolicy(step_costs=(1.0, 1.2)), "step_costs must hold k \\+ 1 = 4"),
    (DraftPolicy(step_costs=(1.0, 1.2, float("nan"), 2.0)), "positive costs"),
    (DraftPolicy(smoothing=0.0), "smoothing"),
    (DraftPolicy(prior=1.5), "prior"),
    (DraftPolicy(probe_every=8, max_probe_every=4), "probe_every"),
])
def test_a_bad_policy_is_refused_by_name(policy, match):
    with pytest.raises(ModelBindingError, match=f"draft policy for speculate=3: .*{match}"):
        LockstepEngine(ScriptedTalker(num_codebooks=1, dtype=torch.float64), 1, speculate=3, draft_policy=policy)


def _run(draft_miss: int, policy: DraftPolicy):
    engine = LockstepEngine(ScriptedTalker(num_codebooks=1, dtype=torch.float64, draft_miss=draft_miss), 3,
                            kernels="torch", speculate=3, draft_policy=policy)
    widths = []
    for i in range(3):
        engine.add_request(NewRequest(f"r{i}", ScriptInputs((i + 1, 2, 3)), 40, i, SamplingParams(top_k=(1, 0)[i % 2])))
    while engine.step() is not None:
        widths.append(engine.decode_width)
    return engine, widths


def test_draft_counts_and_step_counts_are_reproducible_and_spoiled_drafts_stop_drafting():
    with torch_threads(1):
        policy = DraftPolicy(position_cost=0.3)
        first, widths = _run(1, policy)
        again, widths_again = _run(1, policy)
        fixed, _ = _run(1, DraftPolicy(adaptive=False))
    assert widths == widths_again and first.step_count == again.step_count
    assert first.speculation == again.speculation and first.speculation.accepted == 0
    # Spoiled drafts: the fixed policy verifies 3 a step for nothing, the adaptive one rarely drafts.
    assert fixed.speculation.drafts_per_row == 3.0
    assert first.speculation.drafts_per_row < 0.5 and widths.count(1) > len(widths) // 2
