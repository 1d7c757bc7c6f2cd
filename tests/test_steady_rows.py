"""The steady decode batch: a plan whose rows equal the ones the step inputs hold as loaded is
checked on arrays and runs as loaded (no Python loop over its rows, no upload). It must behave
exactly like a fresh plan: same frames, and the same refusals (naming the request) once
something changed."""

from __future__ import annotations

import pytest
import torch

from mtp_fsm.engine import LockstepEngine, NewRequest, Span, StepPlan
from mtp_fsm.errors import PlanError
from mtp_fsm.sampling import SamplingParams
from mtp_fsm.testing import ScriptInputs
from mtp_fsm.testing.alone import scripted_single, torch_threads
from mtp_fsm.testing.scripted import ScriptedTalker


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


def requests():
    return [NewRequest(f"r{i}", ScriptInputs((i + 1, 2, 3), eos_at=(None, 4, None)[i]), 9, i) for i in range(3)]


def prefill(engine):
    return engine.step(StepPlan(new_requests=requests(), rows=[Span(f"r{i}", 3) for i in range(3)]))


def frames_of(outputs):
    return [(f.request_id, f.index, tuple(f.codes.tolist())) for out in outputs for f in out.frames]


def test_a_reused_plan_publishes_what_fresh_plans_publish_and_takes_the_steady_path():
    reused, fresh = LockstepEngine(scripted_single(), 3), LockstepEngine(scripted_single(), 3)
    outs = {"reused": [prefill(reused)], "fresh": [prefill(fresh)]}
    plan = StepPlan(rows=[Span(f"r{i}", 1) for i in (0, 2)] + [None])  # r1 ends by EOS at frame 4
    built = []
    load = reused.ledger.inputs.load
    reused.ledger.inputs.load = lambda rows, *a: built.append(rows) or load(rows, *a)
    for _ in range(6):
        outs["reused"].append(reused.step(plan))
        outs["fresh"].append(fresh.step(StepPlan(rows=[Span("r0", 1), Span("r2", 1), None])))
    assert frames_of(outs["reused"]) == frames_of(outs["fresh"])
    assert len(built) == 1 and reused.ledger.inputs.loaded.steady  # validated and loaded once, then held


def test_the_steady_path_still_refuses_a_changed_request_by_name():
    engine = LockstepEngine(scripted_single(), 3)
    prefill(engine)
    plan = StepPlan(rows=[Span(f"r{i}", 1) for i in range(3)])
    engine.step(plan)
    engine.step(plan)  # steady now
    engine.step(StepPlan(aborts=["r1"], rows=[Span("r0", 1), Span("r2", 1)]))
    with pytest.raises(PlanError, match="'r1'.*not in the engine"):
        engine.step(plan)  # same rows object, but r1 is gone: refused, nothing changed
    out = engine.step(StepPlan(rows=[Span("r0", 1), Span("r2", 1)]))
    assert sorted(out.frames.request_ids) == ["r0", "r2"]


def test_the_steady_path_refuses_a_verify_row_for_a_request_that_ended():
    engine = LockstepEngine(ScriptedTalker(num_codebooks=1, dtype=torch.float64), 2, speculate=2)
    greedy = SamplingParams(top_k=1)
    engine.step(StepPlan(new_requests=[NewRequest("a", ScriptInputs((1, 2)), 3, 0, greedy),
                                       NewRequest("b", ScriptInputs((3,)), 40, 1, greedy)],
                         rows=[Span("a", 2), Span("b", 1)]))
    plan = StepPlan(rows=[Span("a", 3), Span("b", 3)])
    while engine.request_state("a").label != "finished":
        engine.step(plan)
    with pytest.raises(PlanError, match="'a'.*finished.*overrun row.*exactly 1 token, got 3"):
        engine.step(plan)
    engine.step(StepPlan(rows=[Span("a", 1), Span("b", 3)]))  # a legal overrun, and b decodes on
