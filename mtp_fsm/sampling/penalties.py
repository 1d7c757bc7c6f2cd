"""CB0 logit rules that depend on a request's history: repetition penalty and minimum length.

Contract (the Triton sampler implements the same, bit for bit): on float32 values, an id
whose count is > 0 becomes `x * p` where x < 0 and `x / p` otherwise (HF's
RepetitionPenaltyLogitsProcessor over the generated CB0 ids, each distinct id once; division
correctly rounded; -inf stays -inf, so a masked id stays masked); then, while a row has
published fewer than min_frames frames, its EOS logit is -inf (HF's
MinNewTokensLengthLogitsProcessor). Elementwise per row: batch-invariant by construction.

Where the penalty acts is the model's (ModelSpec.repetition_penalty_order), because upstream
talkers differ and the two orders sample different tokens:
- PENALTY_BEFORE_TEMPERATURE (HF `generate`, Qwen3-TTS): on the logits as the sampler read
  and masked them (NaN / +inf already counted as faults and read as 0), before temperature,
  top-k and top-p, so the penalty can move an id into or out of the kept set;
- PENALTY_AFTER_FILTERS (chatterbox-tts 0.1.7 `T3.inference_turbo`, whose processor list is
  temperature, top-k, top-p, then the penalty): on the temperature-scaled scores with the ids
  top-k / top-p removed already at -inf, so the kept set is the unpenalised one and the
  penalty only reweighs it (top_k=1 stays greedy whatever the penalty). A greedy row
  (temperature 0) takes the argmax of those scores at temperature 1 without noise.
EOS suppression always acts on the read, masked logits, before the empty-row check, so a row
whose only allowed id was a suppressed EOS is an empty-row fault under either order.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")

PENALTY_BEFORE_TEMPERATURE = "before_temperature"
PENALTY_AFTER_FILTERS = "after_filters"
PENALTY_ORDERS = (PENALTY_BEFORE_TEMPERATURE, PENALTY_AFTER_FILTERS)


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
