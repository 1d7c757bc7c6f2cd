"""The lifecycle compiler: what it refuses (with a message naming the edge or stage), and the
torch executor of the compiled chains agreeing with `transitions` on every state and fact."""

from __future__ import annotations

import itertools

import attrs
import pytest
import torch

from mtp_fsm.kernels.reference import run_phase
from mtp_fsm.slots import ERR_ILLEGAL
from mtp_fsm.lifecycle import (
    ALWAYS, Guard, LifecycleCompileError, Oracle, Phase, RequestFSM, State, Stage, Transition, Trigger,
    compile_lifecycle, mtp_lifecycle, predicates_of, single_codebook_lifecycle,
)
from mtp_fsm.lifecycle.diagrams import mermaid_source

SPECS = {"mtp": mtp_lifecycle, "single_codebook": single_codebook_lifecycle}


def refused(spec, *fragments: str) -> str:
    with pytest.raises(LifecycleCompileError) as info:
        compile_lifecycle(spec)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_the_shipped_variants_compile():
    for make in SPECS.values():
        compile_lifecycle(make())


def test_an_in_step_edge_without_a_guard_is_refused():
    spec = mtp_lifecycle().with_edge(Trigger.EOS, State.SAMPLED, guard=None)
    refused(spec, "eos from sampled", "needs a guard")


def test_a_stage_that_could_fire_two_triggers_on_one_row_is_refused():
    # `sample` without `!cb0_fault` overlaps `fail [cb0_fault]` from decoding.
    spec = mtp_lifecycle().with_edge(Trigger.SAMPLE, State.DECODING, guard=ALWAYS)
    refused(spec, "stage 'intake' can fire both sample", "fail", "decoding", "not exclusive")


def test_an_unknown_predicate_is_refused():
    spec = mtp_lifecycle().with_edge(Trigger.EOS, State.SAMPLED, guard=Guard(when=("eos_smapled",)))
    refused(spec, "eos from sampled", "unknown predicate 'eos_smapled'", "prompt_done")


def test_a_predicate_read_outside_its_phase_is_refused():
    spec = mtp_lifecycle().with_edge(Trigger.MTP, State.SAMPLED, guard=Guard(unless=("cb0_fault",)))
    refused(spec, "mtp from sampled", "cb0_fault", "phase sample", "stage 'mtp' runs in phase mtp")


def test_a_total_stage_with_a_gap_is_refused():
    spec = mtp_lifecycle().with_edge(Trigger.FAIL, State.DECODING, guard=Guard(when=("cb0_fault", "eos_sampled")))
    refused(spec, "total stage 'intake' leaves a row in state decoding unmoved", "cb0_fault=True")


def test_a_row_that_could_end_the_step_mid_step_is_refused():
    spec = mtp_lifecycle()
    spec = attrs.evolve(
        spec, transitions=tuple(t for t in spec.transitions if t.trigger is not Trigger.MTP_FAIL),
        stages=tuple(attrs.evolve(s, triggers=tuple(t for t in s.triggers if t is not Trigger.MTP_FAIL))
                     for s in spec.stages),
    )
    refused(spec, "can end a step in in-step state", "sampled")


def test_structural_mistakes_are_refused():
    spec = mtp_lifecycle()
    twice = attrs.evolve(spec, transitions=(*spec.transitions, Transition(Trigger.ADMIT, (State.FREE,), State.PREEMPTED)))
    refused(twice, "'admit' from 'free' is declared twice")
    guarded_host = spec.with_edge(Trigger.ABORT, State.DECODING, guard=ALWAYS)
    refused(guarded_host, "abort from decoding", "host trigger", "no guard")
    two_stages = attrs.evolve(spec, stages=(*spec.stages, Stage("again", Phase.PUBLISH, (Trigger.PUBLISH,))))
    refused(two_stages, "'publish' is fired by stages 'publish' and 'again'")
    orphan = attrs.evolve(spec, stages=tuple(s for s in spec.stages if s.name != "eos"))
    refused(orphan, "eos from sampled", "no stage fires")
    host_in_stage = attrs.evolve(spec, stages=(*spec.stages, Stage("x", Phase.PUBLISH, (Trigger.RELEASE,))))
    refused(host_in_stage, "host trigger cannot be fired by a device stage")


def _phase_facts(phase: Phase):
    names = predicates_of(phase)
    for values in itertools.product((False, True), repeat=len(names)):
        yield dict(zip(names, values))


@pytest.mark.parametrize("variant", sorted(SPECS))
def test_torch_executor_equals_transitions_on_every_state_and_fact(variant):
    """For each phase, every state and every assignment of the phase's predicates: the
    compiled chains run by the torch executor give the same destination, finish reason and
    publication as the oracle running the same stages through `transitions`."""
    spec = SPECS[variant]()
    lc = compile_lifecycle(spec).to("cpu")
    for phase in Phase:
        cases = list(itertools.product(spec.states, _phase_facts(phase)))
        state = torch.tensor([int(s) for s, _ in cases], dtype=torch.int32)
        facts = {p: torch.tensor([f[p] for _, f in cases]) for p in predicates_of(phase)}
        result = run_phase(lc, phase, state, torch.ones(len(cases), dtype=torch.bool), facts)
        oracle = Oracle(spec)
        for i, (source, fact) in enumerate(cases):
            fsm = RequestFSM("r", source)
            stuck = False
            try:
                edges = oracle.run_phase_edges(fsm, phase, lambda stage, fired: fact)
            except Exception:  # a total stage moved nothing: the executor flags it instead
                edges, stuck = [], True
            edges = [spec.transition(t, s) for t, s in edges]
            reason = next((int(e.reason) for e in reversed(edges) if e.reason), 0)
            where = f"{variant} {phase.label} from {source.label} with {fact}"
            assert int(result.illegal[i]) == (ERR_ILLEGAL if stuck else 0), where
            if stuck:
                continue  # the step is already an invariant error; what follows does not matter
            assert int(result.state[i]) == fsm.code, where
            assert int(result.reason[i]) == reason, where
            assert bool(result.published[i]) == any(e.publishes for e in edges), where


def test_rows_that_are_not_owned_never_move():
    lc = compile_lifecycle(mtp_lifecycle()).to("cpu")
    state = torch.tensor([int(State.DECODING)], dtype=torch.int32)
    facts = {p: torch.tensor([False]) for p in predicates_of(Phase.SAMPLE)}
    result = run_phase(lc, Phase.SAMPLE, state, torch.tensor([False]), facts)
    assert int(result.state[0]) == State.DECODING and int(result.illegal[0]) == 0


def test_diagrams_show_the_guards_on_the_edges():
    text = mermaid_source(mtp_lifecycle())
    for edge in ("sampled --> finished: eos [eos_sampled]", "decoding --> finished: finish_length [length_reached]",
                 "sampled --> frame_ready: mtp [!mtp_fault]", "prefilling --> prefilling: prefill [!prompt_done]"):
        assert edge in text, edge


def test_no_executor_names_a_trigger_or_a_state_where_it_runs_stages():
    """The stage bodies read the compiled tables; only host events (which the host
    decides) may name a trigger, and no stage names a state."""
    import inspect
    import re
    from pathlib import Path

    from mtp_fsm.bench import drivers
    from mtp_fsm.testing import interpreter, oracle_driver

    kernels = Path(__file__).resolve().parents[1] / "mtp_fsm" / "kernels"
    named = re.compile(r"\b(State|Trigger)\.[A-Z_]+|\b[ST]_[A-Z_]+\b")
    for path in sorted(kernels.glob("*.py")):
        hits = named.findall(path.read_text())
        assert not hits, f"{path.name} names {hits}"
    stage_bodies = [oracle_driver.OracleDriver._row, interpreter._interpret, drivers._PerRequestDriver.step]
    for body in stage_bodies:
        hits = [m.group(0) for m in named.finditer(inspect.getsource(body))]
        assert not hits, f"{body.__qualname__} names {hits}"
