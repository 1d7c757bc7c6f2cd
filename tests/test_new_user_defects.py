"""Regressions for defects found by driving the public API as a new user would (issue 25)."""

from __future__ import annotations

import pytest

from mtp_fsm.engine import LockstepEngine, NewRequest, SchedulingPolicy
from mtp_fsm.errors import AdmissionError, DuplicateRequestError, MtpFsmError
from mtp_fsm.lifecycle import FinishReason
from mtp_fsm.sampling import SamplingParams
from mtp_fsm.serving import ServingLoop
from mtp_fsm.testing.scripted import ScriptedTalker, ScriptInputs


def _req(rid: str, **kw) -> NewRequest:
    return NewRequest(rid, ScriptInputs(prompt=(1, 2, 3)), max_frames=kw.pop("max_frames", 3), **kw)


def test_generate_is_all_or_nothing():
    """A batch with a request that can never run queues none of them; a retry of the good ones works."""
    engine = LockstepEngine(ScriptedTalker(), 2, kernels="torch")
    good, bad = _req("good"), _req("bad", max_frames=0)
    with pytest.raises(AdmissionError, match="'bad'.*nothing queued"):
        engine.generate([good, bad])
    assert engine.requests() == {} and engine.idle
    results = engine.generate([good])
    assert results["good"].finished is not None and len(results["good"].frames) == 3
    with pytest.raises(DuplicateRequestError, match="'twice'"):
        engine.generate([_req("twice"), _req("twice")])
    assert engine.requests() == {}


def test_every_request_of_generate_gets_one_end_even_if_aborted_while_queued():
    engine = LockstepEngine(ScriptedTalker(), 1, kernels="torch")
    outcomes = []

    def abort_queued(eng, output):
        if not outcomes:
            outcomes.append(eng.abort("second"))
    results = engine.generate([_req("first"), _req("second")], on_step=abort_queued)
    assert outcomes == ["dropped"]
    assert results["second"].finished is not None
    assert results["second"].finished.reason is FinishReason.ABORT and results["second"].frames == []
    assert results["first"].finished.reason is FinishReason.LENGTH


@pytest.mark.parametrize("field,value", [("cb0_sampling", None), ("mtp_sampling", {"temperature": 0.5})])
def test_sampling_of_the_wrong_type_is_an_admission_error_naming_the_field(field, value):
    engine = LockstepEngine(ScriptedTalker(), 2, kernels="torch")
    with pytest.raises(AdmissionError, match=f"'r'.*{field}"):
        engine.add_request(_req("r", **{field: value}))
    assert engine.requests() == {}
    loop = ServingLoop(LockstepEngine(ScriptedTalker(), 2, kernels="torch"))
    assert loop.submit(_req("r", **{field: value})) is False
    assert loop.metrics.requests["r"].finish_reason is FinishReason.ERROR
    assert loop.metrics.summary().num_requests == 1


@pytest.mark.parametrize("make", [
    lambda: LockstepEngine(ScriptedTalker(), 0),
    lambda: LockstepEngine(ScriptedTalker(), 2.5),
    lambda: LockstepEngine(ScriptedTalker(), 2, device="no-such-device"),
    lambda: LockstepEngine("not a model", 2),
    lambda: SchedulingPolicy(token_budget=0),
    lambda: SchedulingPolicy(preempt_after_steps=-1),
    lambda: LockstepEngine(ScriptedTalker(), 2, kernels="torch").step("not a plan"),
])
def test_bad_arguments_raise_mtp_fsm_errors(make):
    with pytest.raises(MtpFsmError):
        make()


def test_valid_sampling_still_admits():
    engine = LockstepEngine(ScriptedTalker(), 2, kernels="torch")
    results = engine.generate([_req("r", cb0_sampling=SamplingParams(temperature=0.7, top_k=5))])
    assert len(results["r"].frames) == 3
