"""Torch stand-ins for the three MRV2 Triton kernels the hook harness launches on a CPU without triton-cpu."""

from __future__ import annotations

import torch

_INSTALLED = False


def _apply_write(output_ptr, output_stride, write_indices_ptr, write_starts_ptr, write_contents_ptr,
                 write_cu_lens_ptr, write_group_ids_ptr, BLOCK_SIZE=None, MULTI_GROUP=False):  # noqa: N803 (kernel names)
    """buffer_utils._apply_write_kernel, single group: row[start : start + n] = contents."""
    if MULTI_GROUP:
        raise NotImplementedError("the harness stages no multi-group (block table) writes")
    flat = output_ptr.view(output_ptr.shape[0], -1) if output_ptr.dim() > 1 else output_ptr.view(-1, 1)
    start = 0
    for i, end in enumerate(write_cu_lens_ptr.tolist()):
        row, col = int(write_indices_ptr[i]), int(write_starts_ptr[i])
        flat[row, col: col + end - start] = write_contents_ptr[start:end].to(flat.dtype)
        start = end


def _prepare_pos_seq_lens(pos_ptr, seq_lens_ptr, idx_mapping_ptr, query_start_loc_ptr, num_computed_tokens_ptr,
                          max_num_reqs, BLOCK_SIZE=None):  # noqa: N803
    """input_batch._prepare_pos_seq_lens_kernel: positions and seq_lens per row; pads seq_lens with 0."""
    n = idx_mapping_ptr.shape[0]
    seq_lens_ptr[n:max_num_reqs] = 0
    for r in range(n):
        computed = int(num_computed_tokens_ptr[int(idx_mapping_ptr[r])])
        start, end = int(query_start_loc_ptr[r]), int(query_start_loc_ptr[r + 1])
        seq_lens_ptr[r] = computed + end - start
        pos_ptr[start:end] = torch.arange(computed, computed + end - start, dtype=pos_ptr.dtype)


def _post_update(idx_mapping_ptr, num_computed_tokens_ptr, last_sampled_tokens_ptr, output_bin_counts_ptr,
                 output_bin_counts_stride, sampled_tokens_ptr, sampled_tokens_stride, num_sampled_ptr,
                 num_rejected_ptr, query_start_loc_ptr, all_token_ids_ptr, all_token_ids_stride, total_len_ptr,
                 num_warps=None):
    """input_batch._post_update_kernel: append sampled tokens, advance num_computed_tokens."""
    for r in range(idx_mapping_ptr.shape[0]):
        slot = int(idx_mapping_ptr[r])
        if slot < 0:
            continue
        total, k = int(total_len_ptr[slot]), int(num_sampled_ptr[r])
        if k > 0:
            last_sampled_tokens_ptr.view(-1)[slot] = sampled_tokens_ptr[r, k - 1]
            total_len_ptr[slot] = total + k
        for i in range(k):
            token = int(sampled_tokens_ptr[r, i])
            all_token_ids_ptr[slot, total + i] = token
            if output_bin_counts_ptr is not None and token < output_bin_counts_ptr.shape[1]:
                output_bin_counts_ptr[slot, token] += 1
        query_len = 0 if query_start_loc_ptr is None else int(query_start_loc_ptr[r + 1] - query_start_loc_ptr[r])
        num_computed_tokens_ptr[slot] += query_len - int(num_rejected_ptr[r])


def install() -> None:
    """Register the stand-ins with vLLM's kernel dispatcher (idempotent). Only where Triton
    is disabled: on a GPU the real kernels run."""
    global _INSTALLED
    from vllm.triton_utils import HAS_TRITON

    if _INSTALLED or HAS_TRITON:
        return
    import vllm.v1.worker.cpu.shm  # noqa: F401  (CUDA stream/event and pinned-buffer placeholders for the CPU)
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({
        "vllm.v1.worker.gpu.buffer_utils._apply_write_kernel": _apply_write,
        "vllm.v1.worker.gpu.input_batch._prepare_pos_seq_lens_kernel": _prepare_pos_seq_lens,
        "vllm.v1.worker.gpu.input_batch._post_update_kernel": _post_update,
    })
    _INSTALLED = True
