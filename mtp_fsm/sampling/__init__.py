"""Sampling: counter-based noise and batched CB0 / MTP token sampling."""

from .noise import gumbel_noise, mix32, row_key, token_hash
from .params import GREEDY, SamplingParams
from .sampler import filter_mask, sample_tokens

__all__ = ["gumbel_noise", "mix32", "row_key", "token_hash", "GREEDY", "SamplingParams", "filter_mask", "sample_tokens"]
