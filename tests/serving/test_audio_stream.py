"""AudioStream: chunked == whole over chunk schedules, boundary arithmetic (the 555-sample class), batching,
no request mixing, aborts, decoder failures, bounded state, the worker thread."""

import threading

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mtp_fsm.engine import FinishedRequest, FrameBatch
from mtp_fsm.lifecycle import FinishReason
from mtp_fsm.serving.audio_stream import AudioStream
from mtp_fsm.serving.codec import DecoderTiming

from audio_util import RuleDecoder, joined, stream_codes, whole

F = 3


def codes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1000, (n, F), generator=torch.Generator().manual_seed(seed))


@settings(max_examples=60, deadline=None)
@given(
    spf=st.integers(1, 9), tail=st.integers(0, 12), receptive=st.integers(0, 4), lookahead=st.integers(0, 3),
    first_chunk=st.integers(1, 4), chunk=st.integers(1, 6), per_step=st.integers(1, 3),
    lengths=st.lists(st.integers(0, 23), min_size=1, max_size=4), seed=st.integers(0, 2**16),
)
def test_chunked_equals_whole_for_any_schedule(spf, tail, receptive, lookahead, first_chunk, chunk, per_step,
                                               lengths, seed):
    dec = RuleDecoder(spf=spf, tail=tail, receptive=receptive, lookahead=lookahead, max_batch=3)
    reqs = {f"r{i}": codes(n, seed + i) for i, n in enumerate(lengths)}
    out, stream = stream_codes(dec, reqs, first_chunk=first_chunk, chunk=chunk, frames_per_step=per_step)
    for rid, frames in reqs.items():
        got = joined(out[rid])
        assert len(got) == len(frames) * spf  # frames x samples_per_frame, trimmed tail restored at the end
        assert torch.equal(got, whole(dec, frames)), rid
    assert stream.retained() == {"streams": 0, "closed": len(reqs), "emitters": 0, "queued": 0, "stats": len(reqs)}


def test_qwen3_omni_geometry_loses_no_samples_at_boundaries():
    """1920 samples a frame, 555 trimmed off each window's end: each window keeps the samples after
    those already out (the last new x 1920 of it); slicing context x 1920 off the front would lose 555."""
    dec = RuleDecoder(spf=1920, tail=555, receptive=2)
    frames = codes(40, 1)
    out, _ = stream_codes(dec, {"a": frames}, first_chunk=1, chunk=5)
    chunks = out["a"]
    assert len(chunks[0].samples) == 1920 - 555  # the first frame's audio, minus what needs frame 1
    assert all(len(c.samples) == 5 * 1920 for c in chunks[1:-1])
    got = joined(chunks)
    assert len(got) == 40 * 1920 and torch.equal(got, whole(dec, frames))
    front_sliced = sum(len(c.samples) for c in chunks[1:-1]) - 555 * (len(chunks) - 2)
    assert front_sliced < 5 * 1920 * (len(chunks) - 2)  # the bug this rule avoids, in numbers


def test_too_little_left_context_is_an_error_naming_the_request():
    dec = RuleDecoder(spf=4, tail=6, receptive=1)
    dec.left_context_frames = 0  # claims no context: the second window starts after the first unsent sample
    out, stream = stream_codes(dec, {"short-ctx": codes(10, 2)}, first_chunk=2, chunk=2)
    assert "request 'short-ctx'" in stream.stats["short-ctx"].error and "left context" in stream.stats["short-ctx"].error
    assert not any(c.is_final for c in out.get("short-ctx", []))  # nothing handed out after the failure


def test_too_little_context_shows_as_wrong_samples():
    """The property above can fail: a decoder that under-declares its receptive field streams audio != whole."""
    dec = RuleDecoder(spf=4, receptive=3)
    dec.left_context_frames = 1
    frames = codes(20, 3)
    out, _ = stream_codes(dec, {"a": frames}, first_chunk=1, chunk=4)
    assert not torch.equal(joined(out["a"]), whole(dec, frames))


def test_requests_are_batched_by_window_length_and_never_mixed():
    dec = RuleDecoder(spf=3, receptive=2, max_batch=4)
    dec.gate.clear()  # the worker blocks in its first call while every other window queues behind it
    reqs = {f"r{i}": codes(17, 10 + i) for i in range(6)}
    out: dict[str, list] = {}
    stream = AudioStream(dec, lambda c: out.setdefault(c.request_id, []).append(c), frame_width=F,
                         first_chunk=2, chunk=5)
    for i in range(17):
        stream.on_frames(i, FrameBatch(tuple(reqs), torch.full((6,), i), torch.stack([f[i] for f in reqs.values()])))
    for rid in reqs:
        stream.on_finished(17, FinishedRequest(rid, FinishReason.EOS, 17))
    dec.gate.set()
    stream.close()
    for rid, frames in reqs.items():
        assert torch.equal(joined(out[rid]), whole(dec, frames)), rid
    assert max(b for b, _, _ in dec.calls) == 4  # equal windows of different requests shared a call, up to max_batch
    assert stream.windows == 6 * 5 and stream.decode_calls < stream.windows


def test_swapped_requests_would_be_caught():
    """Requests of the same length but different codes give different audio: the mixing check can fail."""
    dec = RuleDecoder(spf=3)
    a, b = codes(9, 20), codes(9, 21)
    assert not torch.equal(whole(dec, a), whole(dec, b))


@pytest.mark.parametrize("reason", [FinishReason.ABORT, FinishReason.ERROR])
def test_abort_drops_queued_audio_and_nothing_follows(reason):
    dec = RuleDecoder(spf=2, receptive=1)
    dec.gate.clear()  # the worker blocks in decode: windows pile up in the queue
    got = []
    stream = AudioStream(dec, got.append, frame_width=F, first_chunk=1, chunk=1)
    frames = codes(6, 30)
    stream.on_frames(0, FrameBatch(("gone",), torch.tensor([0]), frames[0:1]))
    assert dec.entered.wait(5.0)  # the worker holds frame 0's window; the rest queue behind it
    for i in range(1, 6):
        stream.on_frames(i, FrameBatch(("gone",), torch.tensor([i]), frames[i:i + 1]))
    stream.on_finished(6, FinishedRequest("gone", reason, 6))
    dec.gate.set()
    stream.close()
    assert got == []  # not even the window in decode when the abort came
    assert dec.calls == [(1, 1, False)]  # the queued windows were never decoded
    assert stream.retained()["emitters"] == 0 and stream.retained()["streams"] == 0


def test_abort_mid_stream_keeps_what_was_out_and_others_complete():
    dec = RuleDecoder(spf=2, receptive=1)
    reqs = {"stay": codes(12, 40), "go": codes(12, 41)}
    out, stream = stream_codes(dec, reqs, first_chunk=1, chunk=2, abort_after={"go": 5})
    assert torch.equal(joined(out["stay"]), whole(dec, reqs["stay"]))
    assert not any(c.is_final for c in out["go"])
    assert sum(len(c.samples) for c in out["go"]) <= 5 * 2
    assert stream.retained()["emitters"] == 0


def test_decoder_failure_ends_that_request_only():
    dec = RuleDecoder(spf=2, receptive=1, max_batch=1, fail_on=999)
    bad = codes(8, 50)
    bad[4, 0] = 999
    reqs = {"bad": bad, "good": codes(8, 51)}
    out, stream = stream_codes(dec, reqs, first_chunk=1, chunk=2, threaded=True)
    assert torch.equal(joined(out["good"]), whole(dec, reqs["good"]))
    assert "request 'bad'" in stream.stats["bad"].error and "poison" in stream.stats["bad"].error
    assert not any(c.is_final for c in out.get("bad", []))
    assert stream._dropped == set()  # the failed request's marker is gone once its final chunk passed


def test_request_with_no_frames_gets_an_empty_final_chunk():
    out, _ = stream_codes(RuleDecoder(), {"empty": codes(0, 0), "one": codes(1, 1)})
    assert [(len(c.samples), c.is_final) for c in out["empty"]] == [(0, True)]
    assert len(joined(out["one"])) == 4


def test_default_first_chunk_is_the_smallest_that_yields_audio():
    stream = AudioStream(RuleDecoder(lookahead=2), lambda c: None, frame_width=F, threaded=False)
    assert stream.chunker.first_chunk == 3 and stream.chunker.left_context == 2 + 2


def test_decoder_timing_is_validated_by_name():
    dec = RuleDecoder()
    dec.samples_per_frame = 0
    with pytest.raises(ValueError, match="samples_per_frame"):
        DecoderTiming.of(dec)
    with pytest.raises(TypeError, match="lacks"):
        DecoderTiming.of(object())


def test_worker_runs_beside_the_caller():
    """on_frames returns while the decoder is still busy: decoding does not block the step loop."""
    dec = RuleDecoder(spf=2)
    dec.gate.clear()
    stream = AudioStream(dec, lambda c: None, frame_width=F, first_chunk=1, chunk=1)
    done = threading.Event()

    def feed():
        for i in range(5):
            stream.on_frames(i, FrameBatch(("a",), torch.tensor([i]), codes(1, i)))
        done.set()

    threading.Thread(target=feed).start()
    assert done.wait(5.0)
    dec.gate.set()
    stream.close()


def test_worker_nice_lowers_only_the_decoder_thread():
    import os

    seen = []

    class Probe(RuleDecoder):
        def decode(self, frames, final):
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            return super().decode(frames, final)

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    stream = AudioStream(Probe(), lambda c: None, frame_width=F, first_chunk=1, chunk=1, worker_nice=3)
    stream.on_frames(0, FrameBatch(("a",), torch.tensor([0]), codes(1, 0)))
    stream.close()
    assert seen and all(n == min(19, before + 3) for n in seen)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # the caller's thread kept its own


def test_a_failing_consumer_ends_only_its_request():
    got = []

    def on_audio(chunk):
        if chunk.request_id == "picky" and chunk.index == 1:
            raise OSError("disk full")
        got.append(chunk)

    stream = AudioStream(RuleDecoder(spf=2), on_audio, frame_width=F, first_chunk=1, chunk=2, threaded=False)
    for i in range(6):
        stream.on_frames(i, FrameBatch(("picky", "fine"), torch.tensor([i, i]), torch.cat((codes(1, i), codes(1, 9 + i)))))
    for rid in ("picky", "fine"):
        stream.on_finished(6, FinishedRequest(rid, FinishReason.EOS, 6))
    assert "request 'picky'" in stream.stats["picky"].error and "disk full" in stream.stats["picky"].error
    assert [c.index for c in got if c.request_id == "picky"] == [0]
    assert got[-1].request_id == "fine" and got[-1].is_final and stream.stats["fine"].error is None
