"""ScheduleMapper against hand-built vLLM SchedulerOutputs (vLLM's own dataclasses): the shapes a
real scheduler rarely or never produces on this CPU build (overrun after EOS, 3 + 4 token chunks)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from models.qwen3_tts import TTSInputs, text_inputs, tiny_demo_talker  # noqa: E402
from mtp_fsm.engine import LockstepEngine, NewRequest  # noqa: E402
from mtp_fsm.lifecycle import FinishReason  # noqa: E402
from mtp_fsm.sampling import SamplingParams  # noqa: E402
from mtp_fsm.vllm.model_dir import stop_token_id  # noqa: E402
from mtp_fsm.vllm.schedule_mapping import ScheduleMapper  # noqa: E402
from vllm_util import new_data, scheduler_output  # noqa: E402

P = 8  # the tiny talker's prompt rows for any text


def make_mapper(max_slots: int = 4) -> ScheduleMapper:
    engine = LockstepEngine(tiny_demo_talker(seed=0), max_slots, kernels="torch")
    return ScheduleMapper(engine, stop_token_id(engine.spec), TTSInputs)


def alone(request: NewRequest) -> list[list[int]]:
    engine = LockstepEngine(tiny_demo_talker(seed=0), 1, kernels="torch")
    return [f.codes.tolist() for f in engine.generate([request])[request.request_id].frames]


def taken(mapper: ScheduleMapper) -> dict[str, list[list[int]]]:
    out: dict[str, list[list[int]]] = {}
    for t in mapper.frames.take():
        out.setdefault(t.request_id, []).extend(t.codes.tolist())
    return out


def test_prefill_chunks_of_3_and_4_in_one_step_then_decode_give_each_its_own_frames():
    a = NewRequest("a", text_inputs("first voice"), max_frames=6, seed=11)
    b = NewRequest("b", text_inputs("second, other voice"), max_frames=6, seed=22)
    mapper = make_mapper()
    got = mapper.step(scheduler_output({"a": 3, "b": 4}, new=[new_data(a, P), new_data(b, P)]))
    assert got.sampled == {"a": [], "b": []}  # neither prompt is done: vLLM gets no token
    got = mapper.step(scheduler_output({"a": 5, "b": 4}))
    assert set(got.sampled) == {"a", "b"} and all(len(v) == 1 for v in got.sampled.values())
    frames: dict[str, list[list[int]]] = taken(mapper)
    for _ in range(8):
        live = {rid: 1 for rid in ("a", "b") if mapper.engine.request_state(rid).label == "decoding"}
        if not live:
            break
        mapper.step(scheduler_output(live))
        for rid, codes in taken(mapper).items():
            frames.setdefault(rid, []).extend(codes)
    assert frames["a"] == alone(a) and frames["b"] == alone(b)
    assert frames["a"] != frames["b"]


def test_cb0_is_the_sampled_token_eos_returns_the_stop_id_and_a_step_after_eos_publishes_nothing():
    mapper = make_mapper()
    requests = [NewRequest(f"r{i}", text_inputs("x" * (i + 1)), max_frames=200, seed=i) for i in range(4)]
    step = mapper.step(scheduler_output({r.request_id: P for r in requests}, new=[new_data(r, P) for r in requests]))
    eos_seen = False
    for _ in range(250):
        for t in mapper.frames.take():
            for codes in t.codes:
                assert [int(codes[0])] in step.sampled.values()
            if t.finished is not None and t.finished.reason is FinishReason.EOS:
                assert step.sampled[t.request_id] == [mapper.stop_token_id]
                eos_seen = True
                # An async scheduler can run a request once more before it sees the stop.
                overrun = mapper.step(scheduler_output({t.request_id: 1}))
                assert overrun.sampled == {t.request_id: []} and len(overrun.output.frames) == 0
                assert mapper.engine.request_state(t.request_id).label == "finished"
        live = {r.request_id: 1 for r in requests if mapper.engine.request_state(r.request_id).label == "decoding"}
        if not live:
            break
        step = mapper.step(scheduler_output(live))
    assert eos_seen


def test_a_step_scheduled_after_a_length_finish_publishes_nothing_and_the_finish_releases_the_slot():
    mapper = make_mapper()
    request = NewRequest("r", text_inputs("end me"), max_frames=1, seed=3)
    step = mapper.step(scheduler_output({"r": P}, new=[new_data(request, P)]))
    assert mapper.engine.request_state("r").label == "finished" and len(step.sampled["r"]) == 1
    assert [t.finished.reason for t in mapper.frames.take()] == [FinishReason.LENGTH]
    # An async scheduler could run the request once more before it sees the finish: overrun.
    step = mapper.step(scheduler_output({"r": 1}))
    assert step.sampled == {"r": []} and len(step.output.frames) == 0
    assert mapper.frames.take() == []
    mapper.step(scheduler_output({}, finished={"r"}))
    assert mapper.engine.num_free_slots == 4


def test_a_vllm_finish_of_a_running_request_aborts_it_and_frees_its_slot_for_this_steps_admission():
    mapper = make_mapper(max_slots=2)
    a, b, c = (NewRequest(rid, text_inputs(rid * 3), max_frames=50, seed=i) for i, rid in enumerate("abc"))
    mapper.step(scheduler_output({"a": P, "b": P}, new=[new_data(a, P), new_data(b, P)]))
    mapper.step(scheduler_output({"a": 1, "b": 1}))
    assert mapper.engine.num_free_slots == 0
    got = mapper.step(scheduler_output({"b": 1, "c": 4}, new=[new_data(c, P)], finished={"a"}))
    assert [(f.request_id, f.reason) for f in got.output.finished] == [("a", FinishReason.ABORT)]
    finishes = {t.request_id: t.finished for t in mapper.frames.take() if t.finished is not None}
    assert finishes["a"].reason is FinishReason.ABORT and finishes["a"].num_frames == 2
    assert mapper.engine.request_state("c").label == "prefilling"
    with pytest.raises(Exception, match="not known"):
        mapper.engine.request_state("a")


def test_preempt_and_resume_in_v1_shape_reproduce_the_frames():
    mapper = make_mapper()
    request = NewRequest("r", text_inputs("resume me please"), max_frames=12, seed=5)
    mapper.step(scheduler_output({"r": P}, new=[new_data(request, P)]))
    for _ in range(3):
        mapper.step(scheduler_output({"r": 1}))
    mapper.step(scheduler_output({}, preempted={"r"}))
    assert mapper.engine.request_state("r").label == "preempted"
    frames = taken(mapper)["r"]
    mapper.step(scheduler_output({"r": P + 2}, resumed={"r"}))  # vLLM re-prefills prompt + 4 outputs in chunks
    mapper.step(scheduler_output({"r": 2}))
    while mapper.engine.request_state("r").label == "decoding":
        mapper.step(scheduler_output({"r": 1}))
    frames += taken(mapper)["r"]
    assert frames == alone(request)


def test_requests_the_worker_cannot_run_are_rejected_alone_with_the_reason():
    mapper = make_mapper()
    good = NewRequest("good", text_inputs("fine"), max_frames=3, seed=1)
    short = NewRequest("short", text_inputs("fine"), max_frames=3, seed=1)
    bad = NewRequest("bad", text_inputs("fine"), max_frames=3, seed=1, cb0_sampling=SamplingParams(top_p=0.0))
    step = mapper.step(scheduler_output({"good": P, "short": P - 1, "bad": P},
                                        new=[new_data(good, P), new_data(short, P - 1), new_data(bad, P)]))
    assert step.sampled["short"] == step.sampled["bad"] == [mapper.stop_token_id] and len(step.sampled["good"]) == 1
    finishes = {t.request_id: t.finished for t in mapper.frames.take() if t.finished is not None}
    assert finishes["short"].reason is FinishReason.ERROR
    assert "prompt of 7 tokens" in finishes["short"].detail and "8 rows" in finishes["short"].detail
    assert "'bad'" in finishes["bad"].detail and "top_p" in finishes["bad"].detail
    assert mapper.engine.request_state("good").label == "decoding"
    mapper.step(scheduler_output({"good": 1}, finished={"short", "bad"}))  # vLLM ends them; nothing else changes


def test_vllm_penalty_and_min_tokens_become_the_engines_when_the_request_leaves_them_unset():
    mapper = make_mapper()
    unset = NewRequest("u", text_inputs("a"), max_frames=3, seed=1)
    own = NewRequest("o", text_inputs("a"), max_frames=3, seed=1, min_frames=1,
                     cb0_sampling=SamplingParams(repetition_penalty=1.0))
    mapper.step(scheduler_output({"u": 2, "o": 2}, new=[new_data(unset, P, repetition_penalty=1.4, min_tokens=3),
                                                       new_data(own, P, repetition_penalty=1.4, min_tokens=3)]))
    records = {rid: mapper.engine.ledger.record(rid, "test") for rid in ("u", "o")}
    assert records["u"].request.cb0_sampling.repetition_penalty == 1.4 and records["u"].request.min_frames == 3
    assert records["o"].request.cb0_sampling.repetition_penalty == 1.0 and records["o"].request.min_frames == 1
