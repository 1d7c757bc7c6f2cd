"""FsmModelState: vLLM 0.32 MRV2's ModelState hooks driving a LockstepEngine (FsmSampler runs its step).

Design. The engine owns the talker, its per-slot KV and the whole device step (compose
inputs from cached frame embeddings + text steps, backbone, CB0 sampling, current-step
MTP, publication); vLLM owns admission, chunking, preemption and stopping. MRV2 offers
no hook between the forward and the sampler that sees hidden states, so the engine step
runs in one place, the sampler, and vLLM's model is a stand-in (standin.py):

- `add_request` / `remove_request` only record events (MRV2Bridge: new, resume,
  release, preempt/park, abort); MRV2 calls them before the batch exists;
- `prepare_inputs` / `prepare_dummy_inputs` return one persistent zero `inputs_embeds`
  buffer: the engine composes the talker's real inputs itself, from its slot table
  (frame embedding + text step per decode row, prompt rows for prefill, replayed frames
  for a resume), so composing them again on vLLM's side would be a second, unused copy;
  one buffer address keeps vLLM's FULL CUDA graphs valid;
- `custom_sampler` wraps vLLM's Sampler: FsmSampler.__call__ maps the batch rows
  (`input_batch.req_ids` order, `num_scheduled_tokens`) to one StepPlan, runs
  `engine.step`, and returns CB0 as each row's token (the stop id for eos, error or an
  overrun row; `num_sampled` 0 for prefill chunks short of the prompt's end, as MRV2's own
  sampler does). The engine's own D2H copy is the step's only sync;
- `postprocess_state` (after vLLM's post_update) commits the step's frames to the
  FrameStore, so the pull channel (`take_frames`) never runs ahead of vLLM's tokens;
- `capture_inner_cudagraphs`: nothing to capture on vLLM's side (the stand-in forward is a
  slice); the engine step runs eagerly inside the sampler, outside vLLM's graphs.

Slots: vLLM's `req_index` and the engine's slot are independent tables; requests are
matched by id (the engine allocates its own slot at admission, frees it at release).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.v1.worker.gpu.model_states.default import DefaultModelState
from vllm.v1.worker.gpu.sample.output import SamplerOutput

from ...engine import LockstepEngine
from ...errors import AdmissionError
from ..frame_store import TakenFrames
from ..request_codec import EXTRA_ARGS_KEY, decode_request, with_vllm_rules
from .bridge import MRV2Bridge, Row


class UnsupportedConfigError(ValueError):
    """A vLLM feature the talker adapter cannot serve (named, with why)."""


def _check_config(vllm_config) -> None:
    if vllm_config.speculative_config is not None:
        raise UnsupportedConfigError("speculative decoding: the talker samples exactly one CB0 token per step")
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1 or parallel.tensor_parallel_size > 1:
        raise UnsupportedConfigError("pipeline or tensor parallelism: the LockstepEngine runs the talker on one device")
    if vllm_config.model_config.enable_prompt_embeds:
        raise UnsupportedConfigError("prompt embeddings: the talker builds its own prompt from extra_args")


class FsmModelState(DefaultModelState):
    """MRV2 model state of the FsmTalkerStandIn: see the module docstring."""

    supports_prompt_embeds = False
    num_new_sampled_tokens_per_step = 1

    def __init__(self, vllm_config, model, encoder_cache, device: torch.device) -> None:
        _check_config(vllm_config)
        super().__init__(vllm_config, model, encoder_cache, device)
        config = model.talker_config
        talker = config.load_talker()
        spec = talker.model.spec
        if self.max_model_len > spec.max_context:
            raise UnsupportedConfigError(f"max_model_len {self.max_model_len} exceeds the talker's KV context "
                                         f"{spec.max_context} positions per slot")
        # Model Runner V2 owns CUDA-graph capture: the engine's own decode graphs stay off.
        self.engine = LockstepEngine(talker.model, self.max_num_reqs, device=device, kernels=config.kernels,
                                     decode_graphs="off")
        self.inputs_type = type(talker.text_inputs("a"))
        self.bridge = MRV2Bridge(self.engine, config.stop_token_id)
        # One address for every step and for graph capture (vLLM's forward only slices it).
        self.inputs_embeds = torch.zeros(self.max_num_tokens, self.inputs_embeds_size, dtype=self.dtype, device=device)

    # -- per-request events ------------------------------------------------------------------

    def add_request(self, req_index: int, new_req_data) -> None:
        rid, params = new_req_data.req_id, new_req_data.sampling_params
        extra = (params.extra_args or {}) if params is not None else {}
        payload = extra.get(EXTRA_ARGS_KEY)
        caller = payload.get("request_id") if isinstance(payload, dict) else None
        prefill = new_req_data.prefill_token_ids
        prefill_len = len(prefill) if prefill is not None else new_req_data.prompt_len

        def decode():
            if params is None:
                raise AdmissionError(rid, "has no sampling params (a pooling request?); the talker generates")
            if params.logprobs is not None or params.prompt_logprobs is not None:
                raise AdmissionError(rid, "asks for logprobs; the talker's CB0 sampler does not report them")
            request = decode_request(rid, payload, max_frames=int(params.max_tokens), inputs_type=self.inputs_type)
            return with_vllm_rules(request, params)

        self.bridge.add(rid, new_req_data.prompt_len, prefill_len, decode, caller)

    def remove_request(self, req_id: str) -> None:
        self.bridge.remove(req_id)

    # -- inputs (vLLM's forward is a stand-in) ---------------------------------------------------

    def prepare_inputs(self, input_batch, req_states) -> dict[str, Any]:
        return {"inputs_embeds": self.inputs_embeds[: input_batch.num_tokens_after_padding]}

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> dict[str, Any]:
        return {"inputs_embeds": self.inputs_embeds[:num_tokens]}

    def prepare_inputs_embeds(self, scheduled_encoder_inputs, input_batch, req_states) -> torch.Tensor:
        return self.inputs_embeds[: input_batch.num_tokens_after_padding]

    def dummy_inputs_embeds(self, num_tokens: int) -> torch.Tensor:
        return self.inputs_embeds[:num_tokens]

    # -- sampling and after ------------------------------------------------------------------

    def custom_sampler(self, sampler: Any) -> tuple[Any, Any]:
        return FsmSampler(sampler, self), None

    def postprocess_state(self, idx_mapping, num_sampled, num_computed_tokens=None) -> None:
        self.bridge.commit()

    def capture_inner_cudagraphs(self, input_buffers, block_tables, attn_groups, kv_cache_config) -> None:
        return None  # the engine step runs eagerly inside the sampler (see the module docstring)

    # -- the frame channel -------------------------------------------------------------------

    def take_frames(self) -> list[TakenFrames]:
        """Frames and finishes committed since the last take, per caller request id."""
        return self.bridge.frames.take()


class FsmSampler:
    """Replaces MRV2's Sampler call with one engine step; everything else (per-slot
    add_request, staged writes, penalty tables vLLM's post_update touches) is the wrapped
    sampler's, so the runner's other uses of `self.sampler` keep working."""

    def __init__(self, base: Any, state: FsmModelState) -> None:
        self.base, self.state = base, state

    def __getattr__(self, name: str) -> Any:
        base = self.__dict__.get("base")
        if base is None:
            raise AttributeError(name)
        return getattr(base, name)

    def __call__(self, logits: torch.Tensor, input_batch) -> SamplerOutput:
        n = input_batch.num_reqs
        counts = np.asarray(input_batch.num_scheduled_tokens[:n])
        # MRV2's rule (num_sampled 0 while seq_len < prefill_len), from its exact host mirrors
        # (no speculative tokens here, so the upper bounds are exact): no device sync.
        samples = input_batch.num_computed_tokens_np[:n] + counts >= input_batch.prefill_len_np[:n]
        rows = [Row(rid, int(c), bool(s)) for rid, c, s in zip(input_batch.req_ids[:n], counts, samples)]
        result = self.state.bridge.step(rows)
        device = logits.device
        sampled = torch.tensor(result.tokens, dtype=torch.int64).to(device, non_blocking=True).view(-1, 1)
        num_sampled = torch.from_numpy(samples.astype(np.int32)).to(device, non_blocking=True)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=None, num_nans=None,
                             num_sampled=num_sampled, num_rejected=torch.zeros_like(num_sampled))
