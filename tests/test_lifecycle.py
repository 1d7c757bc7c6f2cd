"""Unit tests of the lifecycle spec, its compiled transition table and the oracle."""

from __future__ import annotations

import itertools

import pytest
import torch

from mtp_fsm.errors import LifecycleError
from mtp_fsm.kernels.reference import fire as kernel_fire
from mtp_fsm.lifecycle import (
    HOST_TRIGGERS, ILLEGAL, LIVE_STATES, RESTING_STATES, TERMINAL_STATES, VARIANTS, LifecycleSpec, Oracle, RequestFSM,
    State, Transition, Trigger, compile_table, lifecycle_for, mtp_lifecycle, single_codebook_lifecycle,
)

SPECS = [mtp_lifecycle(), single_codebook_lifecycle()]
ids = [s.name for s in SPECS]


def declared(spec: LifecycleSpec) -> dict[tuple[Trigger, State], State]:
    out = {}
    for t in spec.transitions:
        for s in t.sources:
            assert (t.trigger, s) not in out, f"{spec.name}: {t.trigger.label} from {s.label} declared twice"
            out[(t.trigger, s)] = t.dest
    return out


def test_state_and_trigger_codes_are_stable():
    assert [int(s) for s in State] == list(range(9))
    assert [int(t) for t in Trigger] == list(range(12))
    assert State.FREE == 0 and State.WAITING == 1 and State.FINISHED == 6 and State.PREEMPTED == 8
    assert State.SAMPLED.label == "sampled" and Trigger.FINISH_LENGTH.label == "finish_length"


def test_state_groups():
    assert LIVE_STATES == {State.WAITING, State.PREFILLING, State.DECODING}
    assert TERMINAL_STATES == {State.FINISHED, State.ABORTED}
    assert State.SAMPLED not in RESTING_STATES and State.FRAME_READY not in RESTING_STATES
    assert HOST_TRIGGERS == {Trigger.ADMIT, Trigger.PREEMPT, Trigger.RESUME, Trigger.ABORT, Trigger.RELEASE}


@pytest.mark.parametrize("spec", SPECS, ids=ids)
def test_table_is_exactly_the_declared_transitions(spec):
    table = compile_table(spec)
    want = declared(spec)
    assert table.table.dtype == torch.int32 and table.table.shape == (len(Trigger), len(State))
    for trig, state in itertools.product(Trigger, State):
        expected = int(want.get((trig, state), ILLEGAL))
        assert table.dest(trig, state) == expected, (trig.label, state.label)
        assert table.legal(trig, state) == ((trig, state) in want)
    assert {(t, s): d for t, s, d in table.edges()} == want
    assert table.spec_name == spec.name
    assert torch.equal(table.to("cpu"), table.table)


@pytest.mark.parametrize("spec", SPECS, ids=ids)
def test_oracle_agrees_with_the_table_on_every_pair(spec):
    table, oracle = compile_table(spec), Oracle(spec)
    for trig, state in itertools.product(Trigger, spec.states):
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
    assert sum(oracle.fired.values()) == len(table.edges())


@pytest.mark.parametrize("spec", SPECS, ids=ids)
def test_kernel_fire_uses_the_table(spec):
    """The kernels' masked `fire` gives the table's destination, flags illegal rows and
    leaves unmasked and illegal rows unchanged."""
    table = compile_table(spec).table
    states = torch.tensor([int(s) for s in State] * 2, dtype=torch.int32)
    mask = torch.tensor([True] * len(State) + [False] * len(State))
    for trig in Trigger:
        new, illegal = kernel_fire(table, trig, states, mask)
        for i, s in enumerate(states.tolist()):
            dest = int(table[trig, s])
            if mask[i] and dest >= 0:
                assert int(new[i]) == dest and not illegal[i]
            else:
                assert int(new[i]) == s and bool(illegal[i]) == bool(mask[i])


def test_common_shape_of_both_variants():
    for spec in SPECS:
        d = declared(spec)
        assert d[(Trigger.ADMIT, State.FREE)] is State.WAITING
        assert d[(Trigger.PREFILL, State.WAITING)] is State.PREFILLING
        assert d[(Trigger.PUBLISH, State.FRAME_READY)] is State.DECODING
        assert d[(Trigger.FINISH_LENGTH, State.DECODING)] is State.FINISHED
        assert d[(Trigger.OVERRUN, State.FINISHED)] is State.FINISHED
        assert d[(Trigger.OVERRUN, State.ABORTED)] is State.ABORTED
        assert d[(Trigger.RESUME, State.PREEMPTED)] is State.WAITING
        for s in LIVE_STATES:
            assert d[(Trigger.PREEMPT, s)] is State.PREEMPTED and d[(Trigger.ABORT, s)] is State.ABORTED
            assert d[(Trigger.SAMPLE, s)] in (State.SAMPLED, State.FRAME_READY)
        for s in (State.FINISHED, State.ABORTED, State.PREEMPTED):
            assert d[(Trigger.RELEASE, s)] is State.FREE
        # Nothing leaves a terminal state except overrun (reflexive) and release.
        for (t, s), dest in d.items():
            if s in TERMINAL_STATES:
                assert t in (Trigger.OVERRUN, Trigger.RELEASE), (t, s)
        # Within-step states are never a host trigger's source except abort.
        for (t, s), dest in d.items():
            if s in (State.SAMPLED, State.FRAME_READY) and t in HOST_TRIGGERS:
                assert t is Trigger.ABORT


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
        (Trigger.MTP, State.SAMPLED), (Trigger.EOS, State.SAMPLED), (Trigger.ABORT, State.SAMPLED)}
    assert set(single) - set(mtp) == {(Trigger.EOS, State.FRAME_READY)}
    assert State.SAMPLED not in single_codebook_lifecycle().states


@pytest.mark.parametrize("spec", SPECS, ids=ids)
def test_abort_is_declared_only_where_the_kernels_fire_it(spec):
    """Host aborts (live, preempted), a non-finite CB0 row (live) and, with an MTP stage, a
    non-finite MTP row (sampled): no other abort edge, so every drawn edge can happen."""
    sources = {s for (t, s) in declared(spec) if t is Trigger.ABORT}
    want = {*LIVE_STATES, State.PREEMPTED} | ({State.SAMPLED} if spec.name == "mtp" else set())
    assert sources == want


# Hazard: a tracker in a state the variant lacks (e.g. `sampled` without MTP) must give
# the same clear LifecycleError as a missing edge, not the library's bare ValueError.
def test_oracle_rejects_states_outside_the_variant_with_a_lifecycle_error():
    oracle = Oracle(single_codebook_lifecycle())
    fsm = RequestFSM("s", State.SAMPLED)
    assert not oracle.may(fsm, Trigger.ABORT)
    with pytest.raises(LifecycleError, match="'s' in state 'sampled': trigger 'abort'"):
        oracle.fire(fsm, Trigger.ABORT)


def test_a_request_walks_the_happy_path_through_the_oracle():
    oracle = Oracle(mtp_lifecycle())
    fsm = oracle.new("req-1")
    assert fsm.code is State.FREE and fsm.request_id == "req-1"
    path = [Trigger.ADMIT, Trigger.PREFILL, Trigger.SAMPLE, Trigger.MTP, Trigger.PUBLISH,
            Trigger.SAMPLE, Trigger.MTP, Trigger.PUBLISH, Trigger.FINISH_LENGTH, Trigger.OVERRUN, Trigger.RELEASE]
    assert oracle.fire_all(fsm, path) is State.FREE
    assert oracle.fired[(Trigger.SAMPLE, State.PREFILLING)] == 1 and oracle.fired[(Trigger.SAMPLE, State.DECODING)] == 1
    with pytest.raises(LifecycleError, match="'req-1' in state 'free': trigger 'publish'"):
        oracle.fire(fsm, Trigger.PUBLISH)


def test_trigger_outside_the_variant_is_a_lifecycle_error():
    oracle = Oracle(single_codebook_lifecycle())
    fsm = RequestFSM("x", State.FRAME_READY)
    assert not oracle.may(fsm, Trigger.MTP)
    with pytest.raises(LifecycleError, match="'x'.*'mtp'"):
        oracle.fire(fsm, Trigger.MTP)


def test_lifecycle_for_and_variants():
    assert set(VARIANTS) == {"mtp", "single_codebook"}
    assert lifecycle_for("mtp").name == "mtp"
    assert lifecycle_for("single_codebook").name == "single_codebook"
    with pytest.raises(ValueError, match="unknown lifecycle variant 'higgs'"):
        lifecycle_for("higgs")


def test_spec_states_and_triggers_are_those_used():
    spec = LifecycleSpec("tiny", "t", (Transition(Trigger.ADMIT, (State.FREE,), State.WAITING),))
    assert spec.states == (State.FREE, State.WAITING)
    assert spec.triggers == (Trigger.ADMIT,)
    assert compile_table(spec).edges() == [(Trigger.ADMIT, State.FREE, State.WAITING)]


def test_compile_rejects_a_table_that_is_not_a_function():
    spec = LifecycleSpec("ambiguous", "t", (
        Transition(Trigger.ADMIT, (State.FREE,), State.WAITING),
        Transition(Trigger.ADMIT, (State.FREE,), State.PREEMPTED),
    ))
    with pytest.raises(ValueError, match="not a plain edge"):
        compile_table(spec)
