"""CB0 logit rules that depend on a request's history: repetition penalty and minimum length.

Contract (the Triton sampler implements the same, bit for bit): on float32 logits, an id
whose count is > 0 becomes `x * p` where x < 0 and `x / p` otherwise (HF's
RepetitionPenaltyLogitsProcessor over the generated CB0 ids; division correctly rounded);
then, while a row has published fewer than min_frames frames, its EOS logit is -inf (HF's
MinNewTokensLengthLogitsProcessor). Both act on the logits as the sampler read and masked
them (NaN / +inf already counted as faults and read as 0), before its empty-row check, so a
row whose only allowed id was a suppressed EOS is an empty-row fault. Elementwise per row:
batch-invariant by construction.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def apply_repetition_penalty(logits: torch.Tensor, counts: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """float32 logits [B, V] with every seen id (counts [B, V] > 0) penalised by its row's penalty [B]."""
    x = logits.float()
    p = penalty.float()[:, None]
    return torch.where(counts > 0, torch.where(x < 0, x * p, x / p), x)


def suppress_eos(logits: torch.Tensor, eos_token_id: int, num_frames: torch.Tensor,
                 min_frames: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (a new tensor) with EOS masked on rows with num_frames < min_frames."""
    out = logits.clone()
    early = num_frames < min_frames
    out[:, eos_token_id] = torch.where(early, NEG_INF, logits[:, eos_token_id])
    return out
