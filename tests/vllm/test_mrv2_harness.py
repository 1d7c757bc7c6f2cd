"""The MRV2 path (FsmModelState) through the CPU hook harness: MRV2's hook order, vLLM's own classes,
scheduler outputs with chunked prefill, row reorder, preemption + resume, abort and slot reuse, against
the embedded engine's frames."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from models.qwen3_tts import text_inputs, tiny_demo_talker  # noqa: E402
from mtp_fsm.engine import LockstepEngine, NewRequest  # noqa: E402
from mtp_fsm.lifecycle import FinishReason  # noqa: E402
from mtp_fsm.sampling import SamplingParams  # noqa: E402
from mtp_fsm.vllm.model_dir import TalkerDirConfig, stop_token_id  # noqa: E402
from mtp_fsm.vllm.mrv2 import MRV2EventError  # noqa: E402
from mtp_fsm.vllm.mrv2.harness import MRV2HookHarness  # noqa: E402
from mtp_fsm.vllm.mrv2.schedule import ScriptedScheduler  # noqa: E402
from mtp_fsm.vllm.request_codec import EXTRA_ARGS_KEY, encode_request  # noqa: E402

TEXTS = ("Hello there.", "A longer sentence to speak, with a comma.", "Short.", "Numbers: one two three.")
P = 8  # the tiny talker's prompt rows for any text


@pytest.fixture(autouse=True)
def one_thread():
    # 2 cores shared with other work: one torch thread is faster and steadier here.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def talker():
    return tiny_demo_talker(seed=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, talker):
    return MRV2HookHarness.model_dir(tmp_path_factory.mktemp("mrv2"), TalkerDirConfig("qwen3_tts", seed=0), talker)


def make_requests(n: int, max_frames: int = 6) -> list[NewRequest]:
    return [NewRequest(f"req-{i}", text_inputs(TEXTS[i % len(TEXTS)]), max_frames=max_frames + 2 * (i % 3),
                       seed=1000 + i, min_frames=(None, 0, 3)[i % 3],
                       cb0_sampling=SamplingParams(temperature=0.9, top_k=50, repetition_penalty=(None, 1.3)[i % 2]))
            for i in range(n)]


def reference(talker, requests):
    """The embedded engine's frames and finish per request (same talker seed, its own policy)."""
    engine = LockstepEngine(talker, 4, kernels="torch")
    try:
        out = engine.generate(requests)
    finally:
        engine.close()
    return {rid: ([f.codes.tolist() for f in g.frames], g.finished.reason) for rid, g in out.items()}


def harness(model_dir, max_num_seqs: int, budget: int, **kwargs) -> MRV2HookHarness:
    return MRV2HookHarness(model_dir, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=256,
                           **kwargs)


def drive(h: MRV2HookHarness, sched: ScriptedScheduler, max_steps: int = 400):
    """Run the scheduler against the harness; frames and finishes pulled after every step."""
    frames, finished, sampled = {}, {}, []
    while not sched.done:
        assert sched.step_index < max_steps, "the schedule did not finish"
        out = sched.schedule()
        tokens = h.execute(out)
        sampled.append(tokens)
        sched.update(out, tokens)
        collect(h, frames, finished)
    return frames, finished, sampled


def collect(h, frames, finished):
    for taken in h.take_frames():
        assert taken.first_index == len(frames.get(taken.request_id, []))
        frames.setdefault(taken.request_id, []).extend(taken.codes.tolist())
        if taken.finished is not None:
            finished[taken.request_id] = taken.finished.reason


def check_against_reference(ref, frames, finished, aborted):
    for rid, (want, reason) in ref.items():
        got = frames.get(rid, [])
        if rid in aborted:
            assert got == want[: len(got)], f"{rid}: aborted frames are not a prefix of the reference"
            if rid in finished:
                assert finished[rid] in (FinishReason.ABORT, reason)
        else:
            assert got == want, f"{rid}: {len(got)} frames vs the reference's {len(want)}"
            assert finished[rid] == reason


def test_schedule_with_chunks_reorder_preemption_abort_and_slot_reuse(talker, model_dir):
    requests = make_requests(6)
    ref = reference(talker, requests)
    stop = stop_token_id(talker.spec)
    # 2 slots for 6 requests (slots reused), prompts in chunks of 3 (P = 8), a budget of 5 tokens:
    # req-0 preempted while decoding, req-1 preempted mid-prefill, req-2 aborted while it runs,
    # req-3 preempted and then aborted before it resumes.
    sched = ScriptedScheduler([(r, P) for r in requests], stop_token_id=stop, max_num_seqs=2, token_budget=5, chunk=3,
                              preempt_at={5: ["req-0"], 3: ["req-1"], 20: ["req-3"]},
                              abort_at={14: ["req-2"], 21: ["req-3"]}, rng=random.Random(7))
    h = harness(model_dir, 2, 5, max_park_steps=2)
    frames, finished, sampled = drive(h, sched)
    check_against_reference(ref, frames, finished, sched.aborted)
    assert sched.aborted == {"req-2", "req-3"}
    assert finished["req-2"] == FinishReason.ABORT and finished["req-3"] == FinishReason.ABORT
    assert h.model_state.bridge.num_parked == 0
    # The shapes were exercised: resumes as new requests with prompt + outputs, chunked prefill,
    # more requests than slots, and rows that changed places between steps.
    resumed = [d for o in sched.recorded for d in o.scheduled_new_reqs if len(d.prefill_token_ids) > P]
    assert {d.req_id for d in resumed} == {"req-0"}  # req-1 was preempted before its first token
    assert set().union(*(o.preempted_req_ids for o in sched.recorded)) == {"req-0", "req-1", "req-3"}
    assert any(0 < n < P for o in sched.recorded for n in o.num_scheduled_tokens.values())
    assert len([e for e in h.hook_log if e[0] == "add_request"]) > 2
    assert any(_swapped(a, b) for a, b in zip(h.batches, h.batches[1:]))
    # vLLM's tokens are the frames' CB0 (+ the stop id after an EOS).
    for rid, (want, reason) in ref.items():
        if rid in sched.aborted:
            continue
        tokens = [t for step in sampled for t in step.get(rid, [])]
        assert tokens == [f[0] for f in want] + ([stop] if reason is FinishReason.EOS else [])

    # The recorded scheduler outputs replayed through a fresh runner: the same tokens and frames.
    replay = harness(model_dir, 2, 5, max_park_steps=2)
    frames2, finished2 = {}, {}
    for out, tokens in zip(sched.recorded, sampled):
        assert replay.execute(out) == tokens
        collect(replay, frames2, finished2)
    assert frames2 == frames and finished2 == finished


def _swapped(before: list[str], after: list[str]) -> bool:
    common = [r for r in before if r in after]
    return common != [r for r in after if r in common]


def _new(request: NewRequest, prefill: list[int]):
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.v1.core.sched.output import NewRequestData

    params = VllmSamplingParams(max_tokens=request.max_frames, extra_args={EXTRA_ARGS_KEY: encode_request(request)})
    return NewRequestData(req_id=request.request_id, prompt_token_ids=[0] * P, mm_features=[], sampling_params=params,
                          pooling_params=None, block_ids=([],), num_computed_tokens=0, lora_request=None,
                          prefill_token_ids=prefill)


def _out(tokens: dict[str, int], new=(), cached=(), finished=(), preempted=()):
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    cached = list(cached)
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=CachedRequestData(req_ids=[c for c, _ in cached], resumed_req_ids=set(),
                                                new_token_ids=[], all_token_ids={}, new_block_ids=[None] * len(cached),
                                                num_computed_tokens=[n for _, n in cached],
                                                num_output_tokens=[0] * len(cached)),
        num_scheduled_tokens=dict(tokens), total_num_scheduled_tokens=sum(tokens.values()),
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, num_common_prefix_blocks=[],
        finished_req_ids=set(finished), free_encoder_mm_hashes=[], preempted_req_ids=set(preempted))


def test_preempt_in_an_empty_step_then_resume(talker, model_dir):
    """MRV2 skips sampling for a step with no tokens: the held preempt runs before the resume."""
    (request,) = make_requests(1, max_frames=5)
    want = reference(talker, [request])[request.request_id][0]
    h = harness(model_dir, 2, 16)
    rid = request.request_id
    cb0 = [h.execute(_out({rid: P}, new=[_new(request, [0] * P)]))[rid][0]]
    cb0 += h.execute(_out({rid: 1}, cached=[(rid, P)]))[rid]
    assert h.execute(_out({}, preempted=[rid])) == {}
    cb0 += h.execute(_out({rid: P + 2}, new=[_new(request, [0] * P + cb0)]))[rid]
    frames: dict = {}
    collect(h, frames, {})
    assert frames[rid] == want[:3] and cb0 == [f[0] for f in want[:3]]


def test_refused_and_mismatched_requests_are_named(talker, model_dir):
    good, bad = make_requests(2, max_frames=4)
    h = harness(model_dir, 2, 32)
    stop = stop_token_id(talker.spec)
    wrong = _new(bad, [0] * (P - 1))  # vLLM holds 7 prompt ids, the talker needs 8
    wrong.prompt_token_ids = [0] * (P - 1)
    tokens = h.execute(_out({good.request_id: P, bad.request_id: P - 1}, new=[_new(good, [0] * P), wrong]))
    assert tokens[bad.request_id] == [stop] and len(tokens[good.request_id]) == 1
    finished: dict = {}
    collect(h, {}, finished)
    assert finished[bad.request_id] == FinishReason.ERROR
    # A resume whose prefill is not prompt + published frames is an error naming the request.
    h.execute(_out({}, preempted=[good.request_id], finished=[bad.request_id]))
    with pytest.raises(MRV2EventError, match=good.request_id):
        h.execute(_out({good.request_id: P + 3}, new=[_new(good, [0] * (P + 3))]))


def test_parked_requests_beyond_the_limit_are_aborted_oldest_first(talker, model_dir):
    requests = make_requests(3, max_frames=8)
    h = harness(model_dir, 3, 32, max_parked=1)
    ids = [r.request_id for r in requests]
    h.execute(_out({rid: P for rid in ids}, new=[_new(r, [0] * P) for r in requests]))
    # vLLM aborts two running requests: MRV2 only says "remove" (parked, as if preempted).
    h.execute(_out({ids[2]: 1}, cached=[(ids[2], P)], finished=[ids[0], ids[1]]))
    frames, finished = {}, {}
    collect(h, frames, finished)
    assert ids[0] not in finished  # both parked; over the limit of 1, so the oldest goes next step
    h.execute(_out({ids[2]: 1}, cached=[(ids[2], P + 1)]))
    collect(h, frames, finished)
    assert finished == {ids[0]: FinishReason.ABORT}
    assert h.model_state.bridge.num_parked == 1


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), slots=st.integers(1, 3), budget=st.integers(2, 12), chunk=st.integers(1, 8))
def test_random_schedules_give_the_engines_frames(talker, model_dir, seed, slots, budget, chunk):
    budget = max(budget, slots)  # vLLM: max_num_batched_tokens >= max_num_seqs
    rng = random.Random(seed)
    requests = make_requests(4, max_frames=5)
    ids = [r.request_id for r in requests]
    preempt_at = {rng.randrange(1, 25): [rng.choice(ids)] for _ in range(3)}
    abort_at = {rng.randrange(1, 30): [rng.choice(ids)]}
    sched = ScriptedScheduler([(r, P) for r in requests], stop_token_id=stop_token_id(talker.spec), max_num_seqs=slots,
                              token_budget=budget, chunk=chunk, preempt_at=preempt_at, abort_at=abort_at, rng=rng)
    frames, finished, _ = drive(harness(model_dir, slots, budget), sched)
    check_against_reference(_reference_4(talker), frames, finished, sched.aborted)


_REF_CACHE: dict = {}


def _reference_4(talker):
    if "ref" not in _REF_CACHE:
        _REF_CACHE["ref"] = reference(talker, make_requests(4, max_frames=5))
    return _REF_CACHE["ref"]
