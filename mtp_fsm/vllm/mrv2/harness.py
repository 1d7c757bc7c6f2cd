"""MRV2HookHarness: FsmModelState's hooks driven in vLLM 0.32 MRV2's order from SchedulerOutputs, on a CPU.

It follows `GPUModelRunner.execute_model` + `sample_tokens` (v1/worker/gpu/model_runner.py,
0.32.0) step for step with vLLM's own objects: the real VllmConfig, `init_model_state`
(which finds FsmModelState through the stand-in's `get_model_state_cls`), RequestState
(slot table: LIFO slots, staged writes), the base Sampler wrapped by `custom_sampler`,
InputBuffers, InputBatch, `sort_batch_req_ids` (the per-step row order),
`prepare_pos_seq_lens` and `post_update`. Without triton-cpu those two functions and the
staged-write flush launch torch stand-ins (cpu_kernels.py, via vLLM's `register_kernels`).

Left out, because the stand-in model has no attention and no KV: block tables, slot
mappings and `prepare_attn`; CUDA-graph dispatch and padding (`num_tokens_after_padding`
= `num_tokens`); the prefill input-id kernels (the stand-in ignores input ids);
speculative decoding, PP and logprobs (FsmModelState refuses them).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from . import cpu_kernels
from .model_state import FsmModelState
from .standin import FsmTalkerStandIn, register, write_mrv2_model_dir
from ..model_dir import TalkerDirConfig


def build_vllm_config(model_dir: str | Path, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                      dtype: str = "float32"):
    """vLLM's VllmConfig for the stand-in architecture (no weights, no tokenizer)."""
    from vllm.engine.arg_utils import EngineArgs

    register(in_process=True)
    args = EngineArgs(model=str(model_dir), skip_tokenizer_init=True, dtype=dtype, enforce_eager=True,
                      max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False,
                      load_format="dummy")
    return args.create_engine_config()


class MRV2HookHarness:
    """One `execute(scheduler_output)` = MRV2's execute_model + sample_tokens for that output;
    returns the tokens vLLM would record per scheduled request ([] for a prefill chunk)."""

    def __init__(self, model_dir: str | Path, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, max_parked: int | None = None, max_park_steps: int | None = None) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.v1.worker.gpu.input_batch import InputBuffers
        from vllm.v1.worker.gpu.model_states import init_model_state
        from vllm.v1.worker.gpu.sample.sampler import Sampler
        from vllm.v1.worker.gpu.states import RequestState

        cpu_kernels.install()
        self.device = torch.device("cpu")
        self.vllm_config = cfg = build_vllm_config(model_dir, max_num_seqs=max_num_seqs,
                                                   max_num_batched_tokens=max_num_batched_tokens,
                                                   max_model_len=max_model_len)
        with set_current_vllm_config(cfg):
            self.model = FsmTalkerStandIn(vllm_config=cfg)
            self.model_state = init_model_state(cfg, self.model, None, self.device)  # via get_model_state_cls
        if not isinstance(self.model_state, FsmModelState):
            raise TypeError(f"init_model_state chose {type(self.model_state).__name__}, not FsmModelState")
        bridge = self.model_state.bridge
        bridge.max_parked = bridge.max_parked if max_parked is None else max_parked
        bridge.max_park_steps = max_park_steps
        self.max_num_reqs, self.max_num_tokens = max_num_seqs, max_num_batched_tokens
        vocab = cfg.model_config.get_vocab_size()
        self.req_states = RequestState(max_num_seqs, max_model_len, max_num_batched_tokens, 0, vocab, self.device)
        base = Sampler(cfg, max_num_seqs, vocab, self.device, self.req_states)
        self.sampler, rejection = self.model_state.custom_sampler(base)
        assert rejection is None
        self.input_buffers = InputBuffers(max_num_seqs, max_num_batched_tokens, self.device)
        self.hook_log: list[tuple[str, str]] = []  # (hook, request id or ""), in call order
        self.batches: list[list[str]] = []  # each step's batch rows (req_ids, MRV2's sorted order)

    @staticmethod
    def model_dir(directory: str | Path, config: TalkerDirConfig, talker_model) -> Path:
        return write_mrv2_model_dir(directory, config, talker_model)

    # -- execute_model ----------------------------------------------------------------------------

    def _remove(self, req_id: str) -> None:
        self.hook_log.append(("remove_request", req_id))
        self.model_state.remove_request(req_id)  # before the slot is freed, as MRV2 does
        self.req_states.remove_request(req_id)

    def execute(self, sched) -> dict[str, list[int]]:
        # finish_requests: finished and preempted ids, sorted.
        for req_id in sorted(set(sched.finished_req_ids) | set(sched.preempted_req_ids or ())):
            self._remove(req_id)
        # add_requests: the re-add guard, slot, model state, sampler; then the staged writes.
        for data in sched.scheduled_new_reqs:
            assert data.prefill_token_ids is not None, "MRV2 sends prefill_token_ids with every new request"
            self._remove(data.req_id)
            self.req_states.add_request(req_id=data.req_id, prompt_len=data.prompt_len,
                                        all_token_ids=data.prefill_token_ids,
                                        num_computed_tokens=data.num_computed_tokens,
                                        max_tokens=data.sampling_params.max_tokens)
            slot = self.req_states.req_id_to_index[data.req_id]
            self.hook_log.append(("add_request", data.req_id))
            self.model_state.add_request(slot, data)
            self.sampler.add_request(slot, data.sampling_params)
        if sched.scheduled_new_reqs:
            self.req_states.apply_staged_writes()
            self.model_state.apply_staged_writes()
        self.sampler.apply_staged_writes()
        # update_requests: the CPU mirror of num_computed_tokens.
        cached = sched.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
            self.req_states.num_computed_tokens_np[self.req_states.req_id_to_index[req_id]] = computed
        np.minimum(self.req_states.num_computed_tokens_np, self.req_states.prefill_len.np,
                   out=self.req_states.num_computed_prefill_tokens)
        if sched.total_num_scheduled_tokens == 0:
            return {}
        input_batch = self._prepare_inputs(sched)
        self.batches.append(list(input_batch.req_ids))
        self.hook_log.append(("preprocess_state", ""))
        self.model_state.preprocess_state(input_batch, (), None, self.req_states.num_computed_tokens.gpu)
        self.hook_log.append(("prepare_inputs", ""))
        model_inputs = {"input_ids": input_batch.input_ids, "positions": input_batch.positions, "inputs_embeds": None,
                        "intermediate_tensors": None,
                        **self.model_state.prepare_inputs(input_batch, self.req_states)}
        hidden_states = self.model(**model_inputs)
        return self._sample_tokens(hidden_states, input_batch)

    def _prepare_inputs(self, sched):
        from vllm.v1.worker.gpu.input_batch import InputBatch, prepare_pos_seq_lens
        from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

        rs, buffers = self.req_states, self.input_buffers
        req_ids = sort_batch_req_ids(sched.num_scheduled_tokens, sched.scheduled_spec_decode_tokens, 1)
        n = len(req_ids)
        counts = np.fromiter((sched.num_scheduled_tokens[r] for r in req_ids), dtype=np.int32, count=n)
        idx_np = np.fromiter((rs.req_id_to_index[r] for r in req_ids), dtype=np.intp, count=n)
        idx = torch.from_numpy(idx_np.astype(np.int64))
        num_tokens = int(counts.sum())
        qsl_np = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(counts, out=qsl_np[1:])
        buffers.query_start_loc[: n + 1] = torch.from_numpy(qsl_np)
        qsl = buffers.query_start_loc[: n + 1]
        prepare_pos_seq_lens(idx, qsl, rs.num_computed_tokens.gpu, buffers.positions, buffers.seq_lens)
        prefill_len_np = rs.prefill_len.np[idx_np]
        computed_prefill_np = rs.num_computed_prefill_tokens[idx_np]
        is_prefilling = computed_prefill_np < prefill_len_np
        computed_np = rs.num_computed_tokens_np[idx_np]
        cu_logits_np = np.arange(n + 1, dtype=np.int32)
        return InputBatch(
            req_ids=req_ids, num_reqs=n, num_reqs_after_padding=n, idx_mapping=idx, idx_mapping_np=idx_np,
            expanded_idx_mapping=idx, expanded_local_pos=torch.zeros(n, dtype=torch.int32),
            num_scheduled_tokens=counts, num_tokens=num_tokens, num_tokens_after_padding=num_tokens,
            num_draft_tokens=0, num_draft_tokens_per_req=None, query_start_loc=qsl, query_start_loc_np=qsl_np,
            seq_lens=buffers.seq_lens[:n], seq_lens_cpu_upper_bound=torch.from_numpy(computed_np + counts),
            dcp_local_seq_lens=None, num_computed_tokens_np=computed_np, prefill_len_np=prefill_len_np,
            num_computed_prefill_tokens_np=computed_prefill_np, is_prefilling_np=is_prefilling,
            has_prefill=bool(is_prefilling.any()), decode_graph_eligible=not bool(is_prefilling.any()),
            input_ids=buffers.input_ids[:num_tokens], positions=buffers.positions[:num_tokens],
            is_padding=buffers.is_padding[:num_tokens], logits_indices=(qsl[1:] - 1).long(),
            cu_num_logits=torch.from_numpy(cu_logits_np), cu_num_logits_np=cu_logits_np,
            has_structured_output_reqs=False, prompt_lens=None,
        )

    # -- sample_tokens ------------------------------------------------------------------------------

    def _sample_tokens(self, hidden_states: torch.Tensor, input_batch) -> dict[str, list[int]]:
        from vllm.v1.worker.gpu.input_batch import post_update

        rs = self.req_states
        logits = self.model.compute_logits(hidden_states[input_batch.logits_indices])
        self.hook_log.append(("sampler", ""))
        out = self.sampler(logits, input_batch)
        post_update(input_batch.idx_mapping, rs.num_computed_tokens.gpu, rs.last_sampled_tokens,
                    self.sampler.penalties_state.output_bin_counts, out.sampled_token_ids, out.num_sampled,
                    out.num_rejected, input_batch.query_start_loc, rs.all_token_ids.gpu, rs.total_len.gpu)
        self.hook_log.append(("postprocess_state", ""))
        self.model_state.postprocess_state(input_batch.idx_mapping, out.num_sampled, rs.num_computed_tokens.gpu)
        tokens = out.sampled_token_ids[:, 0].tolist()
        counts = out.num_sampled.tolist()
        return {rid: tokens[i: i + 1] if counts[i] else [] for i, rid in enumerate(input_batch.req_ids)}

    def take_frames(self):
        return self.model_state.take_frames()
