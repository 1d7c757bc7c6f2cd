"""Speculative decoding under vLLM's scheduler (TalkerLLM(..., speculate=k)): vLLM plans each
decoding request's 1 + k verify tokens from the drafts the worker hands back, and the frames
are those of plain decoding in the embedded engine, whatever vLLM's preemptions and chunking,
for requests that end by EOS, by max_frames and by the end of the context."""

from __future__ import annotations

import pytest
import torch

from models.mtp_lm import MtpLMInputs, tiny_demo_talker
from mtp_fsm.engine import LockstepEngine, NewRequest
from mtp_fsm.lifecycle import FinishReason
from mtp_fsm.sampling import SamplingParams
from mtp_fsm.vllm import TalkerLLM
from mtp_fsm.vllm.llm import with_speculation
from mtp_fsm.vllm.speculation import speculative_config

TEXTS = ("Hello there.", "A longer sentence to speak, with a comma.", "abc", "Numbers: one two three.")


def requests(n: int, prefix: str) -> list[NewRequest]:
    out = []
    for i in range(n):
        cb0 = (SamplingParams(top_k=1), SamplingParams(temperature=0.9, top_k=50),
               SamplingParams(temperature=0.8, top_k=20, repetition_penalty=1.2))[i % 3]
        # i % 4 == 3: EOS held off past the context, so the context ends it (160 positions).
        out.append(NewRequest(f"{prefix}-{i}", MtpLMInputs(text=TEXTS[i % len(TEXTS)]),
                              max_frames=(60, 24, 90, 200)[i % 4], seed=7 + i, cb0_sampling=cb0,
                              min_frames=200 if i % 4 == 3 else None))
    return out


def plain(reqs):
    engine = LockstepEngine(tiny_demo_talker(), 4, kernels="torch")
    try:
        return {rid: ([int(f.codes[0]) for f in g.frames], g.finished.reason) for rid, g in engine.generate(reqs).items()}
    finally:
        engine.close()


def run_vllm(reqs, k: int, **kwargs):
    with TalkerLLM("mtp_lm", max_num_seqs=4, speculate=k, **kwargs) as llm:
        got = {rid: ([int(f.codes[0]) for f in g.frames], g.finished.reason) for rid, g in llm.generate(reqs).items()}
        return got, llm.speculation(), llm.summary().preemptions


@pytest.fixture(autouse=True)
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_vllm_plans_the_verify_rows_and_the_frames_are_plain_decodings():
    reqs = requests(8, "spec")
    want = plain(reqs)
    got, stats, _ = run_vllm(reqs, 3)
    assert got == want
    reasons = {reason for _, reason in want.values()}
    assert {FinishReason.EOS, FinishReason.LENGTH} <= reasons
    for rid in ("spec-3", "spec-7"):  # EOS held off: the context ends them, short of max_frames 200
        frames, reason = want[rid]
        assert reason is FinishReason.LENGTH and len(frames) < 200
    # Past the wired EOS position (min_frames holds EOS off) the drafts miss more: 0.36 measured.
    assert stats.num_drafts == 3 and 0.2 < stats.acceptance_rate <= 1.0 and stats.frames_per_row > 1.5


def test_frames_are_plain_decodings_when_vllms_kv_budget_forces_preemption():
    reqs = requests(6, "tight")
    got, stats, preemptions = run_vllm(reqs, 2, num_gpu_blocks_override=12, block_size=16)
    assert preemptions > 0  # vLLM, not the engine, decided them
    assert got == plain(reqs) and stats.accepted > 0


def test_the_budgets_never_cut_a_verify_row_short():
    kwargs = with_speculation({"max_num_batched_tokens": 8}, 3, max_num_seqs=4, max_model_len=164)
    assert kwargs["speculative_config"] == speculative_config(3) and kwargs["max_num_batched_tokens"] == 4 * 164
    with pytest.raises(ValueError, match="would cut a verify row of 4 tokens short"):
        with_speculation({"long_prefill_token_threshold": 3}, 3, max_num_seqs=4, max_model_len=164)
