"""JobRouter: frames and PCM reach only their own job, in order; the first-audio wait covers exactly the
step that sends a request's first chunk to the decoder, and ends when the event loop has that audio; the
event loop is woken once per step and per decode batch, never for an audio job's later frames."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.qwen3_tts.codec import tiny_demo_decoder
from mtp_fsm.api.jobs import AudioEvent, EndEvent, FramesEvent, JobRouter, SpeechJob, wake_jobs
from mtp_fsm.api.schema import SpeechRequest
from mtp_fsm.engine.plan import FinishedRequest, FrameBatch, NewRequest
from mtp_fsm.lifecycle import FinishReason


@pytest.fixture()
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def job(loop, rid: str, fmt: str) -> SpeechJob:
    return SpeechJob(SpeechRequest(input="hi", response_format=fmt), NewRequest(rid, None, max_frames=8), 0.0, loop)


def frames(rid_rows: list[tuple[str, int]]) -> FrameBatch:
    ids = tuple(rid for rid, _ in rid_rows)
    index = torch.tensor([i for _, i in rid_rows], dtype=torch.int64)
    codes = torch.stack([torch.full((16,), 7 * i + len(rid), dtype=torch.int64) for rid, i in rid_rows])
    return FrameBatch(ids, index, codes)


def drain(loop, j: SpeechJob) -> list:
    loop.run_until_complete(asyncio.sleep(0))  # run the call_soon_threadsafe callbacks
    out = []
    while not j.events.empty():
        out.append(j.events.get_nowait())
    return out


@pytest.mark.parametrize("first_chunk", [1, 3])
def test_the_first_audio_wait_covers_the_step_of_the_first_chunk_only(loop, first_chunk):
    router = JobRouter(tiny_demo_decoder(seed=0), 16, threaded=False, first_chunk=first_chunk)
    audio, codes = job(loop, "a", "pcm"), job(loop, "c", "codes")
    router.register(audio)
    router.register(codes)
    for index in range(first_chunk):
        router.on_frames(index, frames([("a", index), ("c", index)]))
        due = index + 1 == first_chunk
        assert router.wait_first_audio(0.01) is not due  # only the step that completes the first chunk waits
    got = drain(loop, audio)
    assert [type(e) for e in got] == [FramesEvent] * first_chunk + [AudioEvent]
    assert len(got[-1].samples) == first_chunk * 1920  # the first chunk's audio, decoded inline
    assert all(isinstance(e, FramesEvent) for e in drain(loop, codes))  # codes: frames, never audio
    audio.on_first_audio()  # what JobReader does when the event loop has it
    assert router.wait_first_audio(0.01)
    router.on_frames(first_chunk, frames([("a", first_chunk)]))
    assert router.wait_first_audio(0.01)  # later steps never wait


def test_ends_reach_their_job_and_an_abort_gets_no_more_audio(loop):
    router = JobRouter(tiny_demo_decoder(seed=0), 16, threaded=False)
    a, b = job(loop, "a", "pcm"), job(loop, "b", "pcm")
    router.register(a)
    router.register(b)
    router.on_frames(0, frames([("a", 0), ("b", 0)]))
    router.on_finished(1, FinishedRequest("a", FinishReason.ABORT, 1))
    router.on_frames(1, frames([("b", 1)]))
    router.on_finished(2, FinishedRequest("b", FinishReason.EOS, 2))
    got_a, got_b = drain(loop, a), drain(loop, b)
    assert isinstance(got_a[-1], EndEvent) and got_a[-1].finished.reason is FinishReason.ABORT
    assert sum(isinstance(e, AudioEvent) for e in got_a) == 1  # its first chunk only, nothing after the abort
    assert any(isinstance(e, AudioEvent) and e.is_final for e in got_b)  # b's stream ends with a final chunk
    samples = sum(len(e.samples) for e in got_b if isinstance(e, AudioEvent))
    assert samples == 2 * 1920
    assert len(router) == 0  # both forgotten


class _CountingLoop:
    """An event loop whose call_soon_threadsafe calls are counted (each is one wake-up of the real loop)."""

    def __init__(self, loop) -> None:
        self.loop, self.wakes = loop, 0

    def call_soon_threadsafe(self, *args):
        self.wakes += 1
        return self.loop.call_soon_threadsafe(*args)

    def create_future(self):
        return self.loop.create_future()


def test_one_wake_per_step_and_per_decode_batch_and_none_for_an_audio_jobs_later_frames(loop):
    counting = _CountingLoop(loop)
    router = JobRouter(tiny_demo_decoder(seed=0), 16, threaded=False)  # first chunk: 1 frame
    pcm = [job(counting, f"p{i}", "pcm") for i in range(3)]
    codes = job(counting, "c", "codes")
    for j in (*pcm, codes):
        router.register(j)
    router.on_frames(0, frames([(j.request_id, 0) for j in (*pcm, codes)]))
    assert counting.wakes == 2  # the step's (first frames: headers) and the decode batch's (3 first audio chunks)
    got = {j.request_id: drain(loop, j) for j in (*pcm, codes)}
    assert all([type(e) for e in got[j.request_id]] == [FramesEvent, AudioEvent] for j in pcm)
    router.on_frames(1, frames([(j.request_id, 1) for j in (*pcm, codes)]))
    assert counting.wakes == 3  # the codes job's frames; the audio jobs' wait in their mailboxes (no audio yet)
    assert all(drain(loop, j) == [] for j in pcm) and [type(e) for e in drain(loop, codes)] == [FramesEvent]
    router.on_finished(2, FinishedRequest("p0", FinishReason.EOS, 2))
    # The end delivers what waited, in order: the frame, then the final chunk's audio and the end.
    assert [type(e) for e in drain(loop, pcm[0])] == [FramesEvent, AudioEvent, EndEvent]
    assert all(drain(loop, j) == [] for j in pcm[1:])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.booleans(), max_size=20))
def test_a_wake_delivers_everything_pushed_before_it_in_order(wakes):
    loop = asyncio.new_event_loop()
    try:
        j = job(loop, "a", "pcm")
        for i, wake in enumerate(wakes):
            j.push(i, wake=wake)
        got = drain(loop, j)
        last_wake = max((i for i, w in enumerate(wakes) if w), default=-1)
        # In order, everything up to the last wake; a later quiet push may ride on a wake not yet run.
        assert got == list(range(len(got))) and len(got) >= last_wake + 1
        wake_jobs([j])
        assert got + drain(loop, j) == list(range(len(wakes)))  # ...and the rest on the next wake
    finally:
        loop.close()
