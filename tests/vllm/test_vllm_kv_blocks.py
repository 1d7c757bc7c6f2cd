"""Under vLLM a paged talker's KV is counted in vLLM's blocks: same block size, and between steps it holds
no more blocks than vLLM's budget, even while vLLM preempts for lack of blocks."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from models.qwen3_tts import load_checkpoint, save_checkpoint, tiny_demo_talker  # noqa: E402
from mtp_fsm.vllm import TalkerLLM  # noqa: E402
from vllm_util import embedded_frames, frames_of, tts_requests  # noqa: E402


def test_talker_kv_stays_within_vllms_blocks_under_preemption(tmp_path):
    checkpoint = str(save_checkpoint(tiny_demo_talker(seed=7), tmp_path / "tiny"))
    requests = tts_requests(6, max_frames=30, prefix="blocks")
    with TalkerLLM("models.qwen3_tts:load_checkpoint", talker_kwargs={"directory": checkpoint}, max_num_seqs=4,
                   max_model_len=64, num_gpu_blocks_override=7, block_size=16, max_num_batched_tokens=6) as llm:
        got = {rid: frames_of(g) for rid, g in llm.generate(requests).items()}
        llm.llm.llm_engine.step()  # the empty step that hands the last finished ids to the worker
        (kv,) = llm.llm.collective_rpc("mtp_fsm_kv_blocks")
        preemptions = llm.summary().preemptions
    assert preemptions > 0
    assert kv["block_size"] == 16 and kv["vllm_num_blocks"] == 7
    # vLLM's block 0 is its null block: 6 hold tokens. Between steps the talker holds what its running
    # requests hold in vLLM's tables; within a step, a slot vLLM preempted keeps its blocks until the
    # step ends (the engine frees the slot; the worker returns its blocks after the step).
    assert 0 < kv["held_peak"] <= kv["vllm_num_blocks"] - 1
    assert kv["held_peak"] <= kv["peak"] <= 2 * (kv["vllm_num_blocks"] - 1)
    assert kv["in_use"] == 0  # every request ended: every block went back
    assert got == embedded_frames(requests, model=load_checkpoint(checkpoint))
