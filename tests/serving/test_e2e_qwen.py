"""End to end with the tiny Qwen3-TTS: serve, chunk, preempt; frames survive preemption."""

from mtp_fsm.engine import LockstepEngine, NewRequest, SchedulingPolicy
from mtp_fsm.lifecycle import FinishReason
from mtp_fsm.serving import ChunkingSink, InMemorySink, ServingLoop
from mtp_fsm.serving.model_loader import load_talker

TEXTS = ("Hi there.", "Good morning!", "See you soon.")


def _serve(max_slots, preempt_after_steps=None):
    talker = load_talker(seed=0)  # the default import string: the tiny Qwen3-TTS
    engine = LockstepEngine(talker.model, max_slots, policy=SchedulingPolicy(64, 8, preempt_after_steps))
    sink, chunks = InMemorySink(), []
    chunker = ChunkingSink(chunks.append, first_chunk=2, chunk=3, left_context=2,
                           num_codebooks=engine.spec.num_codebooks)
    serving = ServingLoop(engine, sinks=(sink, chunker))
    for i, text in enumerate(TEXTS):
        assert serving.submit(NewRequest(f"q{i}", talker.text_inputs(text), max_frames=6, seed=i))
    serving.run_until_idle(max_steps=200)
    assert serving.idle
    return serving, sink, chunks


def test_tiny_qwen3_tts_serves_chunks_and_preempts_without_changing_frames():
    reference, ref_sink, ref_chunks = _serve(max_slots=3)
    serving, sink, chunks = _serve(max_slots=1, preempt_after_steps=1)
    assert serving.engine.scheduler.num_preemptions > 0
    assert set(sink.finished) == {"q0", "q1", "q2"}
    for rid, finished in ref_sink.finished.items():
        assert finished.reason in (FinishReason.EOS, FinishReason.LENGTH)
        assert sink.finished[rid].reason == finished.reason
        assert sink.frames[rid] == ref_sink.frames[rid]
        assert all(len(codes) == 16 for _, codes in sink.frames[rid])
        mine = [c for c in chunks if c.request_id == rid]
        assert mine[-1].is_final and sum(len(c.frames) for c in mine) == len(sink.frames[rid])
    assert serving.metrics.summary().first_chunk_ms_p50 is not None
