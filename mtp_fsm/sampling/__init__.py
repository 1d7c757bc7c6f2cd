"""Sampling: counter-based noise and batched CB0 / MTP token sampling."""

from .faults import (
    FAULT_CODEBOOK_SHIFT, FAULT_EMPTY, FAULT_KIND_MASK, FAULT_NAN, FAULT_OK, FAULT_POSINF, describe_fault, fault_codebook,
    fault_kind, fault_word,
)
from .noise import codebook_key, frame_key, gumbel_noise, gumbel_noise_codebooks, mix32, row_key, token_hash
from .params import GREEDY, SamplingParams
from .sampler import filter_mask, row_faults, sample_tokens, top_k_mask

__all__ = ["gumbel_noise_codebooks", "codebook_key", "frame_key", "top_k_mask", "gumbel_noise", "mix32", "row_key", "token_hash", "GREEDY", "SamplingParams", "filter_mask", "sample_tokens", "row_faults", "FAULT_OK", "FAULT_NAN", "FAULT_POSINF", "FAULT_EMPTY", "FAULT_CODEBOOK_SHIFT", "FAULT_KIND_MASK", "describe_fault", "fault_word", "fault_kind", "fault_codebook"]
