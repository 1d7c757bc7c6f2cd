"""Regressions: one request's trouble never stops the vLLM frame channel for the others."""

from __future__ import annotations

import pytest

from models.chatterbox import text_inputs
from mtp_fsm.engine import NewRequest
from mtp_fsm.engine.plan import Generation
from mtp_fsm.lifecycle import FinishReason
from mtp_fsm.vllm import TalkerLLM


@pytest.fixture(scope="module")
def chatterbox_llm():
    with TalkerLLM("chatterbox", max_num_seqs=2, max_model_len=48) as llm:
        yield llm


def test_a_request_past_max_model_len_ends_with_length_and_the_others_are_unaffected(chatterbox_llm):
    llm = chatterbox_llm
    long = NewRequest("long", text_inputs("Twenty three bytes here."), max_frames=30, seed=1, min_frames=30)
    prompt = llm.prompt_length(long)
    assert prompt + 30 > 48, "the check needs a request vLLM caps at max_model_len"
    short = NewRequest("short", text_inputs("Hi."), max_frames=4, seed=2)
    results = llm.generate([long, short])
    assert results["long"].finished.reason is FinishReason.LENGTH
    assert len(results["long"].frames) == 48 - prompt
    assert [f.index for f in results["long"].frames] == list(range(48 - prompt))
    assert results["short"].finished is not None and 0 < len(results["short"].frames) <= 4
    again = llm.generate([NewRequest("after", text_inputs("Hi."), max_frames=4, seed=2)])
    assert [f.codes.tolist() for f in again["after"].frames] == [f.codes.tolist() for f in results["short"].frames]


def test_a_request_the_worker_refuses_ends_alone_with_reason_error(chatterbox_llm):
    llm = chatterbox_llm
    bad = NewRequest("bad", text_inputs("Hi."), max_frames=4, seed=3)
    prompt, params = llm.vllm_request(bad)
    params.extra_args = {}  # no mtp_fsm entry: the worker cannot decode it
    llm.llm.llm_engine.add_request("bad", prompt, params)
    llm._running["bad"] = Generation("bad")  # as submit() records it
    good = NewRequest("good", text_inputs("Hi."), max_frames=4, seed=2)
    llm.submit(good)
    ended = {}
    for _ in range(50):
        for generation in llm.step():
            ended[generation.request_id] = generation
        if not llm.has_unfinished:
            break
    assert not llm.has_unfinished, "generate() would never return"
    assert ended["bad"].finished.reason is FinishReason.ERROR and ended["bad"].frames == []
    assert ended["good"].finished is not None and ended["good"].frames
