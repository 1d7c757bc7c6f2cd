"""Hypothesis properties of the engine: random schedules agree with the oracle (states and
frames), a request's frames do not depend on what it is batched with, and nothing depends
on max_slots or on which slot a request lands in (float64 scripted talker)."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from mtp_fsm.engine import LockstepEngine, Span, StepPlan
from mtp_fsm.lifecycle import State
from mtp_fsm.lifecycle.variants import CLASSES
from mtp_fsm.testing.alone import (
    scripted_conditioned, scripted_delay, scripted_mtp, scripted_mtp_stop, scripted_mtp_stop_deferred, scripted_single,
    scripted_stop_head, torch_threads,
)
from mtp_fsm.testing.references import reference_runs
from mtp_fsm.testing.oracle_driver import OracleDriver
from mtp_fsm.testing.stateful import scripted_requests

FACTORIES = {"mtp": scripted_mtp, "single_codebook": scripted_single, "mtp_stop": scripted_mtp_stop,
             "conditioned": scripted_conditioned, "mtp_stop_deferred": scripted_mtp_stop_deferred,
             "delay_pattern": scripted_delay, "stop_head": scripted_stop_head}
SPECS = {name: factory().spec for name, factory in FACTORIES.items()}
# The oracle driver models the current-step phase order; the deferred schedule is held to its
# current-step twin's frames instead (the other properties here, and tests/test_deferred.py).
ORACLE_VARIANTS = sorted(v for v in FACTORIES if v != "mtp_stop_deferred")
FAST = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# tests/test_kernel_sets.py reruns the invariance properties under other CPU kernel sets with fewer examples.
EXAMPLES_CAP = int(os.environ.get("MTP_FSM_MAX_EXAMPLES", "1000000"))


def examples(n: int) -> int:
    return min(n, EXAMPLES_CAP)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


def refs(variant: str):
    return reference_runs(FACTORIES[variant])


@settings(FAST, max_examples=100)
@given(variant=st.sampled_from(ORACLE_VARIANTS), max_slots=st.integers(1, 4), data=st.data())
def test_random_schedules_give_the_oracles_states_and_frames(variant, max_slots, data):
    """Admissions, chunk sizes, row order, padding, forced EOS / NaN, aborts, preemption and
    releases at random: after every step the engine's states, frames and ended requests
    equal what the oracle driven by the same plan says."""
    # debug=True: the engine's own per-step checks must never fire on a legal schedule.
    engine = LockstepEngine(FACTORIES[variant](), max_slots, kernels="torch", debug=True)
    driver = OracleDriver(engine.spec, max_slots, refs(variant), engine.lifecycle)
    defs = scripted_requests(engine.spec, max_frames=5)
    admitted = 0
    for _ in range(data.draw(st.integers(4, 24), label="steps")):
        reqs = driver.requests.values()
        terminal = sorted(r.request_id for r in reqs if r.slot is not None and r.state in CLASSES.terminal)
        releases = [rid for rid in terminal if data.draw(st.booleans(), label=f"release {rid}")]
        live = sorted(r.request_id for r in reqs if r.slot is not None and r.state in CLASSES.live)
        event = {rid: data.draw(st.sampled_from(["run"] * 6 + ["abort", "preempt"]), label=rid) for rid in live}
        preempted = sorted(r.request_id for r in reqs if r.state is State.PREEMPTED)
        free = driver.num_free + len(releases) + sum(e != "run" for e in event.values())
        resumes = [rid for rid in preempted if data.draw(st.booleans(), label=f"resume {rid}")][:free]
        new = []
        for _ in range(data.draw(st.integers(0, max(free - len(resumes), 0)), label="admit")):
            new.append(data.draw(defs, label="request").new_request(f"r{admitted}"))
            admitted += 1
        plan = StepPlan(new_requests=tuple(new), releases=tuple(releases), resumes=tuple(resumes),
                        aborts=tuple(r for r, e in event.items() if e == "abort"),
                        preempts=tuple(r for r, e in event.items() if e == "preempt"))
        rows: list[Span | None] = []
        for rid, left in data.draw(st.permutations(driver.schedulable(plan)), label="order"):
            if left is None:
                if data.draw(st.booleans(), label="overrun"):
                    rows.append(Span(rid, 1))
            else:
                rows.append(Span(rid, data.draw(st.integers(1, left), label="chunk") if left else 1))
        if data.draw(st.booleans(), label="pad"):
            rows.insert(data.draw(st.integers(0, len(rows)), label="pad at"), None)
        plan = StepPlan(rows=tuple(rows), **{k: getattr(plan, k) for k in
                                             ("new_requests", "releases", "resumes", "aborts", "preempts")})
        out = engine.step(plan)
        driver.check_output(out, driver.apply(plan), plan)
        driver.check_engine(engine)


def run_batched(variant, defs, max_slots, data, fillers=()):
    """Admit `fillers` then `defs` as slots allow, run everything to the end with random
    chunks, row order and padding, releasing what ends; frames per request id."""
    engine = LockstepEngine(FACTORIES[variant](), max_slots, kernels="torch")
    queue = [d.new_request(f"f{i}") for i, d in enumerate(fillers)] + [d.new_request(f"r{i}") for i, d in enumerate(defs)]
    frames: dict[str, list] = {}
    done: list[str] = []
    for _ in range(400):
        room = engine.num_free_slots + len(done)
        admit, queue = queue[:room], queue[room:]
        rows = []
        gone = set(done)
        for rid, record in engine.ledger.records.items():
            if rid in gone or record.state not in engine.lifecycle.classes.live:
                continue
            left = record.prompt_len - record.num_computed
            rows.append(Span(rid, data.draw(st.integers(1, left), label="chunk") if left > 0 else 1))
        for req in admit:
            n = reference_runs(FACTORIES[variant]).prompt_len(req.inputs)
            rows.append(Span(req.request_id, data.draw(st.integers(1, n), label="chunk")))
        rows = data.draw(st.permutations(rows), label="order")
        if data.draw(st.booleans(), label="pad"):
            rows.insert(data.draw(st.integers(0, len(rows)), label="pad at"), None)
        out = engine.step(StepPlan(new_requests=tuple(admit), releases=tuple(done), rows=tuple(rows)))
        for frame in out.frames:
            frames.setdefault(frame.request_id, []).append(tuple(frame.codes.tolist()))
            assert frame.index == len(frames[frame.request_id]) - 1
        done = [f.request_id for f in out.finished]
        if not queue and not done and not any(
            r.state in engine.lifecycle.classes.live for r in engine.ledger.records.values()
        ):
            return frames
    raise AssertionError("did not finish")


@settings(FAST, max_examples=examples(60))
@given(variant=st.sampled_from(sorted(FACTORIES)), max_slots=st.integers(1, 4), data=st.data())
def test_frames_are_the_same_alone_or_batched(variant, max_slots, data):
    """Each request's frames equal its alone run whatever it is batched with."""
    defs = data.draw(st.lists(scripted_requests(SPECS[variant]), min_size=1, max_size=4), label="requests")
    frames = run_batched(variant, defs, max_slots, data)
    for i, d in enumerate(defs):
        assert frames.get(f"r{i}", []) == list(refs(variant).get(d).frames), f"r{i} differs from its alone run"


@settings(FAST, max_examples=examples(40))
@given(variant=st.sampled_from(sorted(FACTORIES)), data=st.data())
def test_frames_do_not_depend_on_max_slots_or_slot_assignment(variant, data):
    """The same requests in engines of different sizes, behind different numbers of filler
    requests (so they land in different slots and batches), give identical frames."""
    spec = SPECS[variant]
    defs = data.draw(st.lists(scripted_requests(spec), min_size=1, max_size=3), label="requests")
    results = []
    for config in range(2):
        slots = data.draw(st.integers(1, 5), label=f"max_slots {config}")
        fillers = data.draw(st.lists(scripted_requests(spec), max_size=3), label=f"fillers {config}")
        frames = run_batched(variant, defs, slots, data, fillers)
        results.append({f"r{i}": frames.get(f"r{i}", []) for i in range(len(defs))})
    assert results[0] == results[1]
