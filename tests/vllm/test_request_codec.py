"""The request codec: any NewRequest survives extra_args' msgpack trip to the worker; the worker builds only its talker's inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.qwen3_tts import TTSInputs
from mtp_fsm.engine import NewRequest
from mtp_fsm.sampling import SamplingParams
from mtp_fsm.testing import ScriptInputs
from mtp_fsm.vllm.request_codec import RequestCodecError, decode_request, encode_request

msgpack = pytest.importorskip("msgspec").msgpack

sampling = st.builds(SamplingParams, temperature=st.floats(0, 2), top_k=st.integers(0, 100),
                     top_p=st.floats(0.01, 1.0), repetition_penalty=st.none() | st.floats(0.5, 2.0))
embedding = st.none() | st.integers(1, 6).flatmap(
    lambda n: st.lists(st.floats(-4, 4, width=32), min_size=n, max_size=n).map(torch.tensor))
inputs = st.builds(TTSInputs, text=st.text(min_size=1, max_size=20), non_streaming=st.booleans(),
                   language=st.none() | st.sampled_from(["english", "auto"]), speaker_embedding=embedding,
                   instruct_ids=st.none() | st.lists(st.integers(0, 300), max_size=5))


@settings(max_examples=60, deadline=None)
@given(inputs=inputs, cb0=sampling, mtp=sampling, seed=st.integers(0, 2**63 - 1),
       min_frames=st.none() | st.integers(0, 9), max_frames=st.integers(1, 500))
def test_any_request_survives_the_msgpack_trip(inputs, cb0, mtp, seed, min_frames, max_frames):
    request = NewRequest("caller-id", inputs, max_frames=max_frames, seed=seed, cb0_sampling=cb0, mtp_sampling=mtp,
                         min_frames=min_frames)
    payload = msgpack.decode(msgpack.encode(encode_request(request)))
    back = decode_request("vllm-internal-id", payload, max_frames=max_frames, inputs_type=TTSInputs)
    assert back.request_id == "vllm-internal-id" and payload["request_id"] == "caller-id"
    assert (back.seed, back.min_frames, back.max_frames, back.cb0_sampling, back.mtp_sampling) == (
        seed, min_frames, max_frames, cb0, mtp)
    assert back.inputs == inputs  # TTSInputs compares tensors by value
    if inputs.speaker_embedding is not None:
        assert back.inputs.speaker_embedding.dtype == inputs.speaker_embedding.dtype


def test_tuples_stay_tuples_for_inputs_that_need_them():
    request = NewRequest("r", ScriptInputs(prompt=(1, 2, 3)), max_frames=4)
    back = decode_request("r", msgpack.decode(msgpack.encode(encode_request(request))), max_frames=4,
                          inputs_type=ScriptInputs)
    assert back.inputs == request.inputs and isinstance(back.inputs.prompt, tuple)


def test_the_worker_refuses_another_inputs_class_a_foreign_layout_and_garbage_by_name():
    payload = encode_request(NewRequest("r", ScriptInputs(prompt=(1,)), max_frames=4))
    with pytest.raises(RequestCodecError, match="'w-1'.*this talker takes models.qwen3_tts"):
        decode_request("w-1", payload, max_frames=4, inputs_type=TTSInputs)
    with pytest.raises(RequestCodecError, match="layout version 99"):
        decode_request("w-2", {**payload, "version": 99}, max_frames=4, inputs_type=ScriptInputs)
    with pytest.raises(RequestCodecError, match="missing or not a dict"):
        decode_request("w-3", None, max_frames=4, inputs_type=ScriptInputs)
    with pytest.raises(RequestCodecError, match="cannot be decoded"):
        decode_request("w-4", {**payload, "inputs": {"no_such_field": 1}}, max_frames=4, inputs_type=ScriptInputs)
    with pytest.raises(RequestCodecError, match="sampling_width 2"):
        encode_request(NewRequest("w-5", ScriptInputs(prompt=(1,)), max_frames=4, sampling_width=2))
