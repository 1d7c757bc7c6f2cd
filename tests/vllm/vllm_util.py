"""Shared helpers for the vLLM tests: scheduler outputs built from vLLM's own dataclasses, and the embedded reference run."""

from __future__ import annotations

from vllm import SamplingParams as VllmSamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

from models.qwen3_tts import TTSInputs, text_inputs, tiny_demo_talker
from mtp_fsm.engine import LockstepEngine, NewRequest
from mtp_fsm.sampling import SamplingParams
from mtp_fsm.serving import InMemorySink, ServingLoop
from mtp_fsm.vllm.request_codec import EXTRA_ARGS_KEY, encode_request

TEXTS = ("Hello there.", "A longer sentence to speak, with a comma.", "Short.", "Numbers: one two three four five.")


def tts_requests(n: int, *, max_frames: int = 40, prefix: str = "req") -> list[NewRequest]:
    """Requests of varied text, seed and sampling; with the tiny talker some end by EOS, some by length."""
    out = []
    for i in range(n):
        cb0 = SamplingParams(temperature=0.9, top_k=50, repetition_penalty=(None, 1.0, 1.3)[i % 3])
        out.append(NewRequest(f"{prefix}-{i}", text_inputs(TEXTS[i % len(TEXTS)]), max_frames=max_frames + 3 * (i % 4),
                              seed=1000 + i, cb0_sampling=cb0, min_frames=(None, 0, 5)[i % 3]))
    return out


def embedded_frames(requests, *, seed: int = 0, max_slots: int = 4, model=None):
    """The embedded serving loop's frames per request (the reference), with how each ended."""
    engine = LockstepEngine(model if model is not None else tiny_demo_talker(seed=seed), max_slots, kernels="torch")
    sink = InMemorySink()
    loop = ServingLoop(engine, sinks=(sink,))
    for request in requests:
        assert loop.submit(request)
    loop.run_until_idle()
    return {r.request_id: (sink.codes(r.request_id), sink.finished[r.request_id].reason) for r in requests}


def frames_of(generation) -> tuple[list[list[int]], object]:
    """A Generation (TalkerLLM / engine.generate) in embedded_frames' form."""
    return [f.codes.tolist() for f in generation.frames], generation.finished.reason


def new_data(request: NewRequest, prompt_len: int, *, rid: str | None = None, **params) -> NewRequestData:
    """vLLM's NewRequestData for a request submitted as TalkerLLM does."""
    sampling = VllmSamplingParams(max_tokens=request.max_frames, extra_args={EXTRA_ARGS_KEY: encode_request(request)},
                                  **params)
    return NewRequestData(req_id=rid or request.request_id, prompt_token_ids=[0] * prompt_len, mm_features=[],
                          sampling_params=sampling, pooling_params=None, block_ids=([],), num_computed_tokens=0,
                          lora_request=None)


def scheduler_output(tokens: dict[str, int], *, new=(), finished=(), preempted=(), resumed=()) -> SchedulerOutput:
    new_ids = {d.req_id for d in new}
    cached = [rid for rid in tokens if rid not in new_ids]
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=CachedRequestData(
            req_ids=cached, resumed_req_ids=set(resumed), new_token_ids=[], all_token_ids={},
            new_block_ids=[None] * len(cached), num_computed_tokens=[0] * len(cached),
            num_output_tokens=[0] * len(cached)),
        num_scheduled_tokens=dict(tokens), total_num_scheduled_tokens=sum(tokens.values()),
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, num_common_prefix_blocks=[],
        finished_req_ids=set(finished), free_encoder_mm_hashes=[], preempted_req_ids=set(preempted),
    )


__all__ = ["TTSInputs", "embedded_frames", "new_data", "scheduler_output", "tts_requests"]
