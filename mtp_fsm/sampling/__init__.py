"""Sampling: counter-based noise and batched CB0 / MTP token sampling."""

from .noise import codebook_key, frame_key, gumbel_noise, gumbel_noise_codebooks, mix32, row_key, token_hash
from .params import GREEDY, SamplingParams
from .sampler import filter_mask, sample_tokens, top_k_mask

__all__ = ["gumbel_noise_codebooks", "codebook_key", "frame_key", "top_k_mask", "gumbel_noise", "mix32", "row_key", "token_hash", "GREEDY", "SamplingParams", "filter_mask", "sample_tokens"]
