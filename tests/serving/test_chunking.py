"""ChunkingSink: first chunk, fixed chunks with left context, final chunk, aborts, ordering."""

import attrs
import pytest
import torch
from hypothesis import given, settings, strategies as st

from mtp_fsm.engine import FinishedRequest, FrameBatch
from mtp_fsm.lifecycle import FinishReason
from mtp_fsm.serving import ChunkingSink, FrameOrderError

Q = 3


def codes_of(rid: str, index: int) -> list[int]:
    return [hash((rid, index, g)) % 1000 for g in range(Q)]


def batch(*frames: tuple[str, int]) -> FrameBatch:
    return FrameBatch(
        tuple(rid for rid, _ in frames),
        torch.tensor([i for _, i in frames], dtype=torch.int64),
        torch.tensor([codes_of(rid, i) for rid, i in frames], dtype=torch.int64).reshape(len(frames), Q),
    )


def collect(**kwargs):
    chunks = []
    return ChunkingSink(chunks.append, num_codebooks=Q, **kwargs), chunks


def feed(sink, rid, start, stop, step=0):
    for i in range(start, stop):
        sink.on_frames(step, batch((rid, i)))


def test_first_chunk_then_fixed_chunks_with_left_context_then_final():
    sink, chunks = collect(first_chunk=2, chunk=3, left_context=4)
    feed(sink, "a", 0, 10)
    assert [(c.chunk_index, c.start_frame, len(c.frames), len(c.context_frames)) for c in chunks] == [
        (0, 0, 2, 0), (1, 2, 3, 2), (2, 5, 3, 4),
    ]
    assert chunks[2].context_frames.tolist() == [codes_of("a", i) for i in range(1, 5)]
    assert chunks[1].frames.tolist() == [codes_of("a", i) for i in (2, 3, 4)]
    assert not any(c.is_final for c in chunks)
    sink.on_finished(5, FinishedRequest("a", FinishReason.EOS, 10))
    final = chunks[-1]
    assert final.is_final and (final.chunk_index, final.start_frame, len(final.frames)) == (3, 8, 2)
    assert final.context_frames.tolist() == [codes_of("a", i) for i in range(4, 8)]


def test_empty_final_chunk_when_nothing_is_pending():
    sink, chunks = collect(first_chunk=2, chunk=2, left_context=1)
    feed(sink, "a", 0, 4)
    sink.on_finished(1, FinishedRequest("a", FinishReason.LENGTH, 4))
    final = chunks[-1]
    assert final.is_final and final.frames.shape == (0, Q) and final.start_frame == 4
    assert final.context_frames.tolist() == [codes_of("a", 3)]
    # a request that ends before any frame still gets its (empty) final chunk
    sink.on_finished(2, FinishedRequest("b", FinishReason.EOS, 0))
    assert (chunks[-1].request_id, chunks[-1].chunk_index, chunks[-1].frames.shape) == ("b", 0, (0, Q))


def test_nothing_after_abort_or_error():
    sink, chunks = collect(first_chunk=2, chunk=5, left_context=2)
    feed(sink, "a", 0, 4)  # first chunk out, 2 frames pending
    feed(sink, "e", 0, 1)
    n = len(chunks)
    sink.on_finished(3, FinishedRequest("a", FinishReason.ABORT, 4))
    sink.on_finished(3, FinishedRequest("e", FinishReason.ERROR, 1, "model raised"))
    feed(sink, "a", 4, 9)  # in flight when the client aborted: dropped
    assert len(chunks) == n and all(c.request_id == "a" and not c.is_final for c in chunks)


def test_out_of_order_frames_raise_naming_request_and_indices():
    sink, _ = collect()
    feed(sink, "a", 0, 2)
    with pytest.raises(FrameOrderError, match=r"'a'.*frame 3 .*frame 2 was expected \(a gap\)"):
        sink.on_frames(7, batch(("a", 3)))
    with pytest.raises(FrameOrderError, match=r"'a'.*frame 1 .*frame 2 was expected \(a repeat\)"):
        sink.on_frames(7, batch(("a", 1)))
    with pytest.raises(FrameOrderError, match=r"'b'.*frame 1 .*frame 0 was expected"):
        sink.on_frames(7, batch(("b", 1)))
    sink.on_finished(8, FinishedRequest("a", FinishReason.EOS, 2))
    with pytest.raises(FrameOrderError, match=r"'a'.*after the request finished \(eos\)"):
        sink.on_frames(9, batch(("a", 2)))
    with pytest.raises(FrameOrderError, match="finished twice"):
        sink.on_finished(9, FinishedRequest("a", FinishReason.EOS, 2))


def test_chunks_are_owned_copies():
    sink, chunks = collect(first_chunk=1, chunk=1, left_context=1)
    b = batch(("a", 0))
    sink.on_frames(0, b)
    b.codes.fill_(-1)
    assert chunks[0].frames.tolist() == [codes_of("a", 0)]


def test_observers_see_every_chunk():
    sink, chunks = collect(first_chunk=1, chunk=2)
    seen = []
    sink.add_observer(seen.append)
    feed(sink, "a", 0, 3)
    assert seen == chunks and len(seen) == 2


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=3),
    first_chunk=st.integers(1, 5), chunk=st.integers(1, 8), left_context=st.integers(0, 10),
    split_seed=st.randoms(use_true_random=False),
)
def test_chunks_cover_every_frame_exactly_once_in_order(counts, first_chunk, chunk, left_context, split_seed):
    sink, chunks = collect(first_chunk=first_chunk, chunk=chunk, left_context=left_context)
    rids = [f"r{i}" for i in range(len(counts))]
    sent = {rid: 0 for rid in rids}
    step = 0
    # Interleave requests in random batch sizes, as steps of a serving loop would.
    while any(sent[r] < n for r, n in zip(rids, counts)):
        frames = []
        for rid, n in zip(rids, counts):
            k = min(n - sent[rid], split_seed.randint(0, 1))
            frames += [(rid, sent[rid] + j) for j in range(k)]
            sent[rid] += k
        if frames:
            sink.on_frames(step, batch(*frames))
        step += 1
    for rid, n in zip(rids, counts):
        sink.on_finished(step, FinishedRequest(rid, FinishReason.LENGTH, n))
    for rid, n in zip(rids, counts):
        mine = [c for c in chunks if c.request_id == rid]
        assert [c.chunk_index for c in mine] == list(range(len(mine)))
        assert [c.is_final for c in mine] == [False] * (len(mine) - 1) + [True]
        flat = [row for c in mine for row in c.frames.tolist()]
        assert flat == [codes_of(rid, i) for i in range(n)]
        for c in mine:
            assert c.context_frames.tolist() == flat[max(0, c.start_frame - left_context): c.start_frame]
            size = first_chunk if c.chunk_index == 0 else chunk
            assert len(c.frames) == size or (c.is_final and len(c.frames) < size)


def test_payload_chunks_decode_to_the_published_patches():
    """A VoxCPM2-style model's chunks carry word rows; `payloads` gives back the very patches
    (bit for bit, NaN and -0.0 included), context and chunk, in the payload's dtype."""
    from mtp_fsm.model_api import ModelSpec, PayloadSpec

    spec = ModelSpec(name="patchy", hidden_size=4, num_codebooks=1, backbone_vocab_size=2, codebook_size=1,
                     eos_token_id=1, max_context=16, variant="stop_head", payload=PayloadSpec((2, 3)))
    patches = torch.randn(5, 2, 3)
    patches[1, 0, 0], patches[2, 1, 2] = float("nan"), -0.0
    words = torch.cat([torch.zeros(5, 1, dtype=torch.int64), spec.payload.encode(patches)], dim=1)
    chunks = []
    sink = ChunkingSink(chunks.append, first_chunk=2, chunk=3, left_context=2)
    sink.on_frames(0, FrameBatch(("r",) * 5, torch.arange(5), words))
    sink.on_finished(1, FinishedRequest("r", FinishReason.EOS, 5))
    context, frames = chunks[1].payloads(spec)
    assert frames.dtype == torch.float32 and frames.shape == (3, 2, 3) and context.shape == (2, 2, 3)
    bits = lambda t: t.view(torch.int32)  # noqa: E731
    assert torch.equal(bits(frames), bits(patches[2:])) and torch.equal(bits(context), bits(patches[:2]))
    with pytest.raises(ValueError, match="no frame payload"):
        chunks[0].payloads(attrs.evolve(spec, payload=None))
