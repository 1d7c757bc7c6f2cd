"""Top-k sampling that draws counter noise only for the candidates, not the whole vocabulary.

The noise of an id is a pure function of (row key, id), so the Gumbel-max winner over the
top-k kept set needs the noise of the kept ids only: the top k_max + 1 scores per row (k_max
= the batch's largest top_k) instead of all V. The result is the contract's (sampler.py) bit
for bit: the kept set is `scores >= kth` (ties at the k-th value included), ties of
score + noise go to the lowest id, a greedy row takes the lowest id of its largest logit, and
a row whose kept scores are all -inf yields id 0. The one extra candidate proves that no id
outside the candidates ties the k-th score; when one might, the caller falls back.
"""

from __future__ import annotations

import torch

from .noise import NOISE_BITS, gumbel_table, mix32

NEG_INF = float("-inf")


def _lowest_id_of(values: torch.Tensor, ids: torch.Tensor, best: torch.Tensor, vocab: int) -> torch.Tensor:
    """Per row, the lowest id whose value equals `best` [B, 1]; 0 where best is -inf."""
    token = torch.where(values == best, ids, vocab).min(dim=-1).values
    return torch.where(best[:, 0] == NEG_INF, 0, token)


def top_k_candidates(scores: torch.Tensor, top_k: torch.Tensor, k_max: int, row_keys: torch.Tensor,
                     greedy: torch.Tensor) -> torch.Tensor | None:
    """Tokens [B] of Gumbel-max over each sampled row's top-k kept set (every sampled row has
    top_k >= 1) and argmax for greedy rows, or None when some row's kept set might reach past
    the candidates (a tie at the k-th score with the extra candidate): use the whole vocabulary.

    scores: float32 [B, V], -inf = masked, temperature-scaled on sampled rows (greedy rows'
    scores are their logits); row_keys: codebook keys [B]; greedy: bool [B]."""
    vocab = scores.shape[-1]
    values, ids = torch.topk(scores, min(k_max + 1, vocab), dim=-1)
    k = torch.where(greedy, 1, top_k.clamp(min=1, max=k_max))
    kth = values.gather(-1, (k - 1)[:, None])
    if values.shape[1] > k_max:
        beyond = values[:, k_max:]
        # A greedy row ties its maximum, a sampled row its k-th score, with a non-candidate id.
        if bool(((beyond == kth) & (kth > NEG_INF)).any()):  # a host read: callers run this on the CPU only
            return None
        values, ids = values[:, :k_max], ids[:, :k_max]
    noise = gumbel_table(scores.device)[mix32(row_keys[:, None] ^ ids) >> (32 - NOISE_BITS)]
    final = torch.where(greedy[:, None], values, torch.where(values >= kth, values + noise, NEG_INF))
    return _lowest_id_of(final, ids, final.max(dim=-1, keepdim=True).values, vocab)
