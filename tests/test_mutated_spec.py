"""The spec is what every executor runs: mutate one guard and the batched engine (torch
executor of the compiled chains) and the per-request interpreter (`transitions` conditions)
change together, away from the frames of the declared spec."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st

from mtp_fsm.engine import LockstepEngine, SchedulingPolicy
from mtp_fsm.lifecycle import Guard, State, Trigger, mtp_lifecycle
from mtp_fsm.testing.alone import scripted_mtp, torch_threads
from mtp_fsm.testing.interpreter import interpret
from mtp_fsm.testing.stateful import scripted_requests


DECLARED = mtp_lifecycle()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), slots=st.integers(1, 3), chunk=st.integers(1, 5))
def test_engine_and_interpreter_follow_a_mutated_guard_together(data, slots, chunk):
    spec = scripted_mtp().spec
    defs = data.draw(st.lists(scripted_requests(spec, max_frames=5), min_size=1, max_size=4), label="requests")
    # `finish_length` unguarded: the first publication ends every request.
    early = DECLARED.with_edge(Trigger.FINISH_LENGTH, State.DECODING, guard=Guard())
    with torch_threads(1):
        engine = LockstepEngine(scripted_mtp(), slots, lifecycle=early, policy=SchedulingPolicy(1 << 20, chunk))
        results = engine.generate([d.new_request(f"r{i}") for i, d in enumerate(defs)])
        for i, d in enumerate(defs):
            got = [tuple(f.codes.tolist()) for f in results[f"r{i}"].frames]
            reason = results[f"r{i}"].finished.reason
            mutated_run = interpret(scripted_mtp(), early, d)
            declared_run = interpret(scripted_mtp(), DECLARED, d)
            assert (got, reason) == (list(mutated_run.frames), mutated_run.reason)
            assert len(mutated_run.frames) <= 1  # ALWAYS: the first publication ends the request
            if len(declared_run.frames) > 1:
                assert list(mutated_run.frames) != list(declared_run.frames)  # the mutation really changed frames
