"""A Qwen3 LM with one DeepSeek-V3-style MTP layer (a speculative drafter) as an mtp_fsm single-codebook TalkerModel.

What a speculative engine calls, per request, on the slot KV cache (no rollback is needed:
attention reads only positions <= the query's, and every pass rewrites from the first
unverified position, so stale entries of rejected drafts are overwritten before being read):

    prefill   h = forward(embed(prompt), 0..P-1); t_P ~ lm_logits(h[-1])
              mtp_forward(h, [t_1..t_P], 0..P-1) -> m; d_1 ~ mtp_logits(m[-1])
    draft     (k > 1: the one MTP layer recycled, as vLLM does) for j = 2..k, q = position of d_{j-1}:
              m = mtp_forward(m_last, d_{j-1}, q - 1); d_j ~ mtp_logits(m)   (m_last: the previous m row)
    verify    h = forward(embed([t_n, d_1..d_k]), n..n+k) -> lm_logits(h): accept a prefix of
              a drafts plus the bonus token b sampled at row a
    catch up  mtp_forward(h[a-1..a], [d_a, b], n+a-1..n+a) -> m (the engine's DraftInputs: the
              last accepted row and the one before it); d'_1 ~ mtp_logits(m[a]); draft on
"""

import torch

from .adapter import MtpLMTalker
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint, shared_copies
from .config import ByteTokenizer, MtpLMConfig, MtpLMInputs, real_config, tiny_config, wide_config

__all__ = [
    "ByteTokenizer",
    "CheckpointError",
    "MtpLMConfig",
    "MtpLMInputs",
    "MtpLMTalker",
    "load_checkpoint",
    "real_config",
    "save_checkpoint",
    "shared_copies",
    "tiny_config",
    "wide_config",
]


def tiny_demo_talker(seed: int = 0, **kwargs) -> MtpLMTalker:
    """The tiny, seeded, randomly initialised MTP LM that the demo and the tests run."""
    return MtpLMTalker(tiny_config(), seed=seed, **kwargs)


def wide_demo_talker(seed: int = 0, **kwargs) -> MtpLMTalker:
    """The >= 100M-parameter MTP LM of realistic width (config.wide_config), seeded and wired
    like the tiny one, in bfloat16: the speculative bench's model where a forward of k + 1
    tokens costs about one token's."""
    return MtpLMTalker(wide_config(), seed=seed, dtype=kwargs.pop("dtype", torch.bfloat16), **kwargs)


def text_inputs(text: str) -> MtpLMInputs:
    """Request inputs for plain text (the serving CLI's plugin hook)."""
    return MtpLMInputs(text=text)


__all__ += ["tiny_demo_talker", "wide_demo_talker", "text_inputs"]
