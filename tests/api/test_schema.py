"""Rules that hold for every input: request validation (400 naming a field of the body), limits (413),
the stream gate (429), the VLLM_PLUGINS allow-list, the per-request FrameStore take, field mapping."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mtp_fsm.api.errors import ApiError
from mtp_fsm.api.inputs import build_request
from mtp_fsm.api.limits import Limits, StreamGate
from mtp_fsm.api.schema import FIELDS, RESPONSE_FORMATS, SpeechRequest, parse_speech_request
from mtp_fsm.api.server import GENERAL_PLUGIN, PLUGIN_NAME, vllm_plugins_env
from mtp_fsm.engine.plan import FinishedRequest, FrameBatch
from mtp_fsm.lifecycle import FinishReason
from mtp_fsm.serving.model_loader import scripted_talker
from mtp_fsm.vllm.frame_store import FrameStore

SETTINGS = settings(max_examples=300, deadline=None, derandomize=True)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
keys = st.sampled_from(FIELDS) | st.text(min_size=1, max_size=8)


@SETTINGS
@given(st.dictionaries(keys, json_values, max_size=6))
def test_any_object_is_accepted_or_refused_with_400_naming_one_of_its_fields(data):
    try:
        request = parse_speech_request(json.dumps(data))
    except ApiError as error:
        assert error.status == 400
        assert error.param in data or (error.param == "input" and data.get("input") is None)
        assert error.message.startswith(f"{error.param}:")
        assert error.body()["error"]["param"] == error.param
        return
    # Accepted: every given field kept as given, and the cross-field rules hold.
    for name, value in data.items():
        if value is not None:
            assert getattr(request, name) == value
    assert request.input.strip() and request.response_format in RESPONSE_FORMATS
    assert not (request.stream_format == "sse" and not request.stream)
    assert not (request.stream and request.stream_format == "audio" and request.response_format == "wav")


@SETTINGS
@given(json_values.filter(lambda v: not isinstance(v, dict)))
def test_a_body_that_is_not_an_object_is_refused_as_the_body(value):
    with pytest.raises(ApiError) as info:
        parse_speech_request(json.dumps(value))
    assert info.value.status == 400 and info.value.param == "body"


@SETTINGS
@given(st.binary(max_size=40))
def test_bytes_that_are_not_json_are_refused_as_the_body(raw):
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        with pytest.raises(ApiError) as info:
            parse_speech_request(raw)
        assert info.value.param == "body"
    else:
        if not isinstance(data, dict):
            with pytest.raises(ApiError):
                parse_speech_request(raw)


valid_requests = st.builds(
    lambda text, fmt, stream, sse, seed, frames, voice: {
        "input": text, "response_format": fmt, "stream": stream or sse or None,
        "stream_format": "sse" if sse else "audio", "seed": seed, "max_new_tokens": frames, "voice": voice,
    },
    st.text(min_size=1, max_size=30).filter(str.strip), st.sampled_from(("pcm", "codes")), st.booleans(),
    st.booleans(), st.none() | st.integers(-(2**63), 2**63 - 1), st.none() | st.integers(1, 10_000),
    st.none() | st.sampled_from(("vivian", "eric")),
)


@SETTINGS
@given(valid_requests)
def test_valid_requests_round_trip(data):
    request = parse_speech_request(json.dumps(data))
    assert request == SpeechRequest(**{k: v for k, v in data.items() if v is not None})


@SETTINGS
@given(st.integers(1, 50), st.integers(1, 100), st.text(min_size=1, max_size=80).filter(str.strip),
       st.none() | st.integers(1, 200))
def test_limits_refuse_with_413_exactly_past_them(max_chars, max_frames, text, asked):
    limits = Limits(max_input_chars=max_chars, max_new_tokens=max_frames)
    request = SpeechRequest(input=text, max_new_tokens=asked)
    over = len(text) > max_chars or (asked is not None and asked > max_frames)
    if over:
        with pytest.raises(ApiError) as info:
            limits.check(request)
        assert info.value.status == 413 and info.value.param in ("input", "max_new_tokens")
    else:
        limits.check(request)
        assert 1 <= limits.frames_for(request) <= max_frames
    assert Limits.from_env(limits.to_env()) == limits


@SETTINGS
@given(st.integers(1, 5), st.lists(st.booleans(), max_size=40))
def test_the_stream_gate_admits_up_to_its_limit_and_refuses_with_429(limit, moves):
    gate, held = StreamGate(limit), 0
    for acquire in moves:
        if acquire:
            if held == limit:
                with pytest.raises(ApiError) as info:
                    gate.acquire()
                assert info.value.status == 429
            else:
                gate.acquire()
                held += 1
        elif held:
            gate.release()
            held -= 1
        assert gate.active == held <= limit


@SETTINGS
@given(st.none() | st.lists(st.sampled_from(("a", "b", GENERAL_PLUGIN, PLUGIN_NAME, "c")), max_size=5).map(",".join))
def test_vllm_plugins_keeps_the_users_list_and_names_both_of_ours(current):
    names = vllm_plugins_env(current).split(",")
    assert GENERAL_PLUGIN in names and PLUGIN_NAME in names  # the endpoint alone would drop the architecture
    given_names = [n for n in (current or "").split(",") if n]
    assert names == given_names + [n for n in (GENERAL_PLUGIN, PLUGIN_NAME) if n not in given_names]


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 5), st.booleans()), max_size=60), st.integers(1, 3))
def test_each_owner_takes_exactly_its_own_requests_frames_in_order(events, owners):
    """FrameStore.take(ids), the worker's side of the per-request channel: frames of requests 0..5 arrive
    interleaved; owner k asks for the ids i with i % owners == k, between any two arrivals."""
    store, width = FrameStore(2), 2
    ids = [f"r{i}" for i in range(6)]
    for rid in ids:
        store.open(rid)
    published = {rid: [] for rid in ids}
    got = {rid: [] for rid in ids}
    ended: dict[str, FinishedRequest] = {}
    for step, (i, take) in enumerate(events):
        rid = ids[i]
        if rid in ended or not store.is_open(rid):
            continue
        codes = torch.tensor([[step, i]], dtype=torch.int64)
        store.add_frames(FrameBatch((rid,), torch.tensor([len(published[rid])]), codes), {rid: rid})
        published[rid].append([step, i])
        if take:
            owner = step % owners
            mine = [r for k, r in enumerate(ids) if k % owners == owner]
            for record in store.take(mine):
                assert record.request_id in mine
                assert record.first_index == len(got[record.request_id])
                got[record.request_id] += np.asarray(record.codes).reshape(-1, width).tolist()
    for rid in ids:
        store.finish(rid, FinishedRequest(rid, FinishReason.LENGTH, len(published[rid])))
    for owner in range(owners):
        mine = [r for k, r in enumerate(ids) if k % owners == owner]
        for record in store.take(mine):
            got[record.request_id] += np.asarray(record.codes).reshape(-1, width).tolist()
            ended[record.request_id] = record.finished
    assert got == published and set(ended) == set(ids)
    assert store.take() == []  # nothing left behind


def test_a_talker_without_a_speaker_field_refuses_voice_by_name():
    talker = scripted_talker()
    with pytest.raises(ApiError) as info:
        build_request(talker, SpeechRequest(input="hi", voice="vivian"), "r", max_frames=4, seed=0)
    assert info.value.param == "voice" and "takes no voice" in info.value.message
    request = build_request(talker, SpeechRequest(input="hi"), "r", max_frames=4, seed=3)
    assert (request.request_id, request.max_frames, request.seed) == ("r", 4, 3)


@pytest.mark.parametrize("name", ["data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size"])
def test_the_vllm_plugin_refuses_parallel_layouts_at_startup(name):
    from mtp_fsm.api.vllm_backend import refuse_layout

    sizes = {"data_parallel_size": 1, "tensor_parallel_size": 1, "pipeline_parallel_size": 1}
    refuse_layout(SimpleNamespace(parallel_config=SimpleNamespace(**sizes)))
    with pytest.raises(RuntimeError, match=f"{name}=2 is not supported"):
        refuse_layout(SimpleNamespace(parallel_config=SimpleNamespace(**{**sizes, name: 2})))
