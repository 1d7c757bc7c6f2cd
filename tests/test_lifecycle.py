"""Unit tests of the lifecycle spec's edges, its compiled destination table and the oracle's host triggers."""

from __future__ import annotations

import itertools

import pytest
import torch

from mtp_fsm.errors import LifecycleError
from mtp_fsm.lifecycle import (
    CLASS_IN_STEP, Phase, CLASS_LIVE, CLASS_TERMINAL, HOST_TRIGGERS, ILLEGAL, VARIANTS, LifecycleSpec, Oracle, RequestFSM,
    State, Trigger, compile_lifecycle, lifecycle_for, mtp_lifecycle, single_codebook_lifecycle,
)
from mtp_fsm.lifecycle.compiled import RULE_DEST
from mtp_fsm.lifecycle.variants import CLASSES

LIVE_STATES, TERMINAL_STATES = CLASSES.live, CLASSES.terminal

SPECS = [f() for f in VARIANTS.values()]
ids = [s.name for s in SPECS]


def declared(spec: LifecycleSpec) -> dict[tuple[Trigger, State], State]:
    out = {}
    for t in spec.transitions:
        for s in t.sources:
            assert (t.trigger, s) not in out, f"{spec.name}: {t.trigger.label} from {s.label} declared twice"
            out[(t.trigger, s)] = t.dest
    return out


def test_state_and_trigger_codes_are_stable():
    assert [int(s) for s in State] == list(range(15))
    assert [int(t) for t in Trigger] == list(range(25))
    assert State.FREE == 0 and State.WAITING == 1 and State.FINISHED == 6 and State.PREEMPTED == 8
    assert State.STARVED == 9 and State.PENDING == 10 and Trigger.MTP_STOP == 14 and Trigger.STARVE == 15 and Trigger.FEED == 16
    assert State.SAMPLED.label == "sampled" and Trigger.FINISH_LENGTH.label == "finish_length"
    assert State.RAMP_UP == 11 and State.WIND_DOWN == 12 and Trigger.RAMP == 17 and Trigger.WOUND_DOWN == 19
    assert State.VERIFYING == 13 and State.DRAFTING == 14 and Trigger.ACCEPT == 21 and Trigger.DRAFT == 24


@pytest.mark.parametrize("spec", [f() for f in VARIANTS.values()], ids=list(VARIANTS))
def test_state_classes_compile_to_the_declared_sets(spec):
    compiled = compile_lifecycle(spec)
    # The deferred schedule's `pending` rests between steps and is scheduled like decoding;
    # its `sampled` moment does not exist (CB0 is sampled last in a step).
    pending = {State.PENDING} if spec.deferred else set()
    # The delay pattern's ramp-up and wind-down are decoding states (each publishes a frame a step).
    phases = {s for s in (State.RAMP_UP, State.WIND_DOWN) if s in spec.states}
    # Speculative: a row still verifying computes its next position; settled ones wait for drafts.
    verifying, drafting = ({State.VERIFYING}, {State.DRAFTING}) if spec.verify_loop else (set(), set())
    assert compiled.states_in(CLASS_LIVE) == {State.WAITING, State.PREFILLING, State.DECODING, *pending, *phases,
                                              *verifying}
    assert compiled.states_in(CLASS_TERMINAL) == {State.FINISHED, State.ABORTED}
    assert compiled.states_in(CLASS_IN_STEP) == ({State.FRAME_READY} if spec.deferred
                                                 else {State.SAMPLED, State.FRAME_READY, *drafting})
    assert HOST_TRIGGERS == {Trigger.ADMIT, Trigger.PREEMPT, Trigger.RESUME, Trigger.ABORT, Trigger.RELEASE}


@pytest.mark.parametrize("spec", SPECS, ids=ids)
def test_table_is_exactly_the_declared_transitions(spec):
    table = compile_lifecycle(spec)
    want = declared(spec)
    assert table.rules.dtype == torch.int32 and table.rules[RULE_DEST].shape == (len(Trigger), len(State))
    for trig, state in itertools.product(Trigger, State):
        expected = int(want.get((trig, state), ILLEGAL))
        assert table.dest(trig, state) == expected, (trig.label, state.label)
        assert table.legal(trig, state) == ((trig, state) in want)
    assert {(t, s): d for t, s, d in table.edges()} == want
    assert table.name == spec.name
    assert torch.equal(table.to("cpu").rules, table.rules)


@pytest.mark.parametrize("spec", SPECS, ids=ids)
def test_oracle_agrees_with_the_table_on_every_host_trigger(spec):
    """Host triggers carry no guard: the oracle fires exactly the table's edges and names
    the request, its state and the trigger for any other pair."""
    table, oracle = compile_lifecycle(spec), Oracle(spec)
    for trig, state in itertools.product(sorted(HOST_TRIGGERS), spec.states):
        fsm = RequestFSM("r", state)
        assert oracle.may(fsm, trig) == table.legal(trig, state)
        if table.legal(trig, state):
            assert oracle.fire(fsm, trig) == State(table.dest(trig, state))
            assert oracle.fired[(trig, state)] == 1
        else:
            with pytest.raises(LifecycleError) as info:
                oracle.fire(fsm, trig)
            msg = str(info.value)
            assert "'r'" in msg and state.label in msg and trig.label in msg
            assert fsm.code is state  # an illegal trigger changes nothing


def test_common_shape_of_both_variants():
    for spec in SPECS:
        d = declared(spec)
        assert d[(Trigger.ADMIT, State.FREE)] is State.WAITING
        assert d[(Trigger.PREFILL, State.WAITING)] is State.PREFILLING
        if spec.verify_loop:  # publication is per verify position; length ends a verifying or settled row
            assert d[(Trigger.BONUS, State.FRAME_READY)] is State.DRAFTING
            assert d[(Trigger.FINISH_LENGTH, State.DRAFTING)] is State.FINISHED
        else:
            assert d[(Trigger.PUBLISH, State.FRAME_READY)] is State.DECODING
            assert d[(Trigger.FINISH_LENGTH, State.DECODING)] is State.FINISHED
        assert d[(Trigger.OVERRUN, State.FINISHED)] is State.FINISHED
        assert d[(Trigger.OVERRUN, State.ABORTED)] is State.ABORTED
        assert d[(Trigger.RESUME, State.PREEMPTED)] is State.WAITING
        for s in LIVE_STATES:
            assert d[(Trigger.PREEMPT, s)] is State.PREEMPTED and d[(Trigger.ABORT, s)] is State.ABORTED
            assert d[(Trigger.SAMPLE, s)] in (State.SAMPLED, State.FRAME_READY, State.PENDING)
            assert d[(Trigger.FAIL, s)] is State.ABORTED
        for s in (State.FINISHED, State.ABORTED, State.PREEMPTED):
            assert d[(Trigger.RELEASE, s)] is State.FREE
        # Nothing leaves a terminal state except overrun (reflexive) and release.
        for (t, s), dest in d.items():
            if s in TERMINAL_STATES:
                assert t in (Trigger.OVERRUN, Trigger.RELEASE), (t, s)
        # Within-step states are never a host trigger's source.
        for (t, s), dest in d.items():
            assert not (s in (State.SAMPLED, State.FRAME_READY) and t in HOST_TRIGGERS), (t, s)


def test_variants_differ_only_where_the_mtp_stage_is():
    mtp, single = declared(mtp_lifecycle()), declared(single_codebook_lifecycle())
    assert mtp[(Trigger.SAMPLE, State.DECODING)] is State.SAMPLED
    assert mtp[(Trigger.MTP, State.SAMPLED)] is State.FRAME_READY
    assert mtp[(Trigger.EOS, State.SAMPLED)] is State.FINISHED
    assert single[(Trigger.SAMPLE, State.DECODING)] is State.FRAME_READY
    assert single[(Trigger.EOS, State.FRAME_READY)] is State.FINISHED
    assert Trigger.MTP not in single_codebook_lifecycle().triggers
    assert Trigger.MTP in mtp_lifecycle().triggers
    assert set(mtp) - set(single) == {
        (Trigger.MTP, State.SAMPLED), (Trigger.EOS, State.SAMPLED), (Trigger.MTP_FAIL, State.SAMPLED)}
    assert set(single) - set(mtp) == {(Trigger.EOS, State.FRAME_READY)}
    assert State.SAMPLED not in single_codebook_lifecycle().states


@pytest.mark.parametrize("spec", SPECS, ids=ids)
def test_error_edges_are_declared_only_where_they_can_happen(spec):
    """Host aborts (live, preempted), a non-finite CB0 row (live, `fail`) and, with an MTP
    stage, a non-finite MTP row (sampled, `mtp_fail`): every drawn edge can happen."""
    d = declared(spec)
    # A conditioned request waiting for a row (starved), a deferred one between steps (pending).
    resting = {s for s in (State.STARVED, State.PENDING) if s in spec.states}
    phases = {s for s in (State.RAMP_UP, State.WIND_DOWN) if s in spec.states}  # the delay pattern's decoding
    assert {s for (t, s) in d if t is Trigger.ABORT} == {*LIVE_STATES, *phases, State.PREEMPTED, *resting}
    # Speculative: a verify position past the first samples from `verifying` (never rests there).
    verifying = {State.VERIFYING} if spec.verify_loop else set()
    assert {s for (t, s) in d if t is Trigger.FAIL} == {*LIVE_STATES, *phases, *verifying}
    has_mtp = bool(spec.stages_of(Phase.MTP))
    mtp_source = {State.PENDING} if spec.deferred else {State.SAMPLED}
    if spec.verify_loop:  # the drafter runs once verification settled (or ran out of drafts)
        mtp_source = {State.VERIFYING, State.DRAFTING}
    assert {s for (t, s) in d if t is Trigger.MTP_FAIL} == (mtp_source if has_mtp else set())


# Hazard: a tracker in a state the variant lacks (e.g. `sampled` without MTP) must give
# the same clear LifecycleError as a missing edge, not the library's bare ValueError.
def test_oracle_rejects_states_outside_the_variant_with_a_lifecycle_error():
    oracle = Oracle(single_codebook_lifecycle())
    fsm = RequestFSM("s", State.SAMPLED)
    assert not oracle.may(fsm, Trigger.ABORT)
    with pytest.raises(LifecycleError, match="'s' in state 'sampled': trigger 'abort'"):
        oracle.fire(fsm, Trigger.ABORT)


def test_trigger_outside_the_variant_is_a_lifecycle_error():
    oracle = Oracle(single_codebook_lifecycle())
    fsm = RequestFSM("x", State.FRAME_READY)
    assert not oracle.may(fsm, Trigger.MTP)
    with pytest.raises(LifecycleError, match="'x'.*'mtp'"):
        oracle.fire(fsm, Trigger.MTP)


def test_lifecycle_for_and_variants():
    assert set(VARIANTS) == {"mtp", "single_codebook", "mtp_stop", "conditioned", "mtp_stop_deferred", "delay_pattern",
                             "stop_head", "speculative"}
    for name in VARIANTS:
        assert lifecycle_for(name).name == name
    with pytest.raises(ValueError, match="unknown lifecycle variant 'higgs'"):
        lifecycle_for("higgs")


