"""Regressions for defects found by driving the public API as a new user would (issue 25)."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

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


def test_min_frames_is_refused_where_the_mtp_stage_decides_the_stop():
    from models.moss_tts_local import text_inputs, tiny_demo_talker
    from mtp_fsm.vllm.request_codec import with_vllm_rules

    engine = LockstepEngine(tiny_demo_talker(seed=0), 2, kernels="torch")
    request = NewRequest("moss", text_inputs("Hello."), max_frames=30, min_frames=20)
    with pytest.raises(AdmissionError, match="'moss'.*min_frames"):
        engine.add_request(request)
    assert engine.check_new(attrs.evolve(request, min_frames=None)) == []

    class VllmParams:  # what vLLM's SamplingParams carries (min_tokens) when a client sets it
        min_tokens, repetition_penalty = 20, 1.0
    mapped = with_vllm_rules(attrs.evolve(request, min_frames=None), VllmParams())
    assert any("min_frames" in p for p in engine.check_new(mapped))
    scripted = LockstepEngine(ScriptedTalker(variant="mtp_stop"), 2, kernels="torch")
    assert any("min_frames" in p for p in scripted.check_new(_req("s", min_frames=1)))
    assert scripted.check_new(_req("s", min_frames=0)) == []


@settings(deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(1, 4), prompts=st.lists(st.integers(1, 10), min_size=1, max_size=4),
       draft_miss=st.sampled_from([0, 2, 3]), slots=st.integers(1, 3), budget=st.sampled_from([6, 12, 64]))
def test_speculative_host_records_agree_with_the_slot_table_after_every_step(k, prompts, draft_miss, slots, budget):
    """The host record's num_computed is the device's (before: it added the whole k+1 row width)."""
    model = ScriptedTalker(num_codebooks=1, draft_miss=draft_miss)
    engine = LockstepEngine(model, slots, kernels="torch", speculate=k,
                            policy=SchedulingPolicy(token_budget=max(budget, k + 1), prefill_chunk=5))
    for i, n in enumerate(prompts):
        engine.add_request(NewRequest(f"r{i}", ScriptInputs(prompt=tuple(range(1, n + 1))), max_frames=12, seed=i))
    while engine.step() is not None:
        for rid, record in engine.ledger.records.items():
            if record.slot is not None:
                device = int(engine.table.num_computed[record.slot])
                assert record.num_computed == device, f"{rid}: host {record.num_computed}, slot table {device}"


def test_admission_staging_keeps_device_tensors_on_the_device():
    """A model that prepares on the device (and frames captured from the slot table at preemption)
    are staged there, never copied to the host and back. The meta device stands in for CUDA: any
    copy out of a meta tensor raises, so a device -> host copy in staging fails this test."""
    from mtp_fsm.engine.records import RequestRecord, RequestTable
    from mtp_fsm.engine.host_events import stage_admits
    from mtp_fsm.lifecycle import Trigger
    from mtp_fsm.slots import SlotTable

    model = ScriptedTalker()
    meta = torch.device("meta")
    table = SlotTable.allocate(2, model.spec, meta, model.slot_columns())
    rows = RequestTable(3)
    records = []
    for i in range(2):
        prepared = model.prepare(ScriptInputs(prompt=(1, 2, 3 + i)))
        prepared = attrs.evolve(prepared, prompt_embeds=prepared.prompt_embeds.to(meta),
                                columns={k: v.to(meta) for k, v in prepared.columns.items()})
        record = RequestRecord(_req(f"r{i}"), rows, prepared)
        record.attach(i)
        record.serial = i + 1
        records.append(record)
    records[1].replay_codes = torch.zeros(2, model.spec.frame_width, dtype=torch.int64, device=meta)
    admits, replay = stage_admits(table, model.spec, records, int(Trigger.ADMIT))
    assert admits.values["prompt_embeds"].device == meta and replay.codes.device == meta
