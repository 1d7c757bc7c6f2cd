"""Batched token sampling: temperature, top-k, top-p, greedy, Gumbel-max on counter noise.

Contract (the Triton kernel implements the same, bit for bit): scores = float32 logits /
temperature; top-k keeps scores >= the k-th largest; top-p then keeps the smallest prefix
of the remaining scores (sorted descending) whose mass before it is < top_p, the mass being
the exact fixed-point integer weights of `topp` (no float reduction, vocab <= 2**14); the
token is argmax(scores + gumbel) over kept ids, ties to the lowest id. Temperature 0 is
argmax of the raw logits.

A -inf logit is a mask: the id is never sampled, exactly like an id outside `allowed`
(top-k counts and top-p weighs only the unmasked ids, since masked ids sort last and weigh
0). Each row gets a fault code (`faults`): NaN or +inf anywhere in the float32 row is a
fault (those logits are read as 0 so the row still yields some id), and so is a row with
no unmasked id left (every allowed id -inf; the token is then id 0). History rules
(`penalties`: repetition penalty, minimum length) apply to the read, masked logits, before
the empty-row check.
"""

from __future__ import annotations

from typing import Callable

import torch

from .candidates import top_k_candidates
from .faults import FAULT_EMPTY, FAULT_NAN, FAULT_POSINF
from .noise import codebook_key, frame_key, gumbel_noise
from .params import NO_SAMPLED_ROWS
from .topp import FX_ONE, MAX_VOCAB_FIXED, fixed_weights

NEG_INF = float("-inf")
POS_INF = float("inf")


Rules = Callable[[torch.Tensor], torch.Tensor]  # float32 logits [B, V] -> adjusted [B, V]


def row_faults(logits: torch.Tensor, allowed: torch.Tensor | None,
               rules: Rules | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sanitised float32 logits [B, V], fault int32 [B]) under the masking rule: NaN and
    +inf are faults and read as 0, -inf and ids outside `allowed` are masked (-inf), then
    `rules` adjust the row, and a row with nothing unmasked left is FAULT_EMPTY. NaN takes
    precedence over +inf over empty."""
    logits = logits.float()
    peak = logits.amax(dim=-1)  # NaN anywhere in the row -> NaN, else +inf if any: one pass
    has_nan, has_posinf = torch.isnan(peak), peak == POS_INF
    logits = torch.nan_to_num(logits, nan=0.0, posinf=0.0, neginf=NEG_INF)  # a bad row still yields some token
    if allowed is not None:
        logits = logits.masked_fill(~allowed, NEG_INF)
    if rules is not None:
        logits = rules(logits)
    empty = logits.amax(dim=-1) == NEG_INF
    fault = torch.where(has_nan, FAULT_NAN, torch.where(has_posinf, FAULT_POSINF, empty.to(torch.int32) * FAULT_EMPTY))
    return logits, fault.to(torch.int32)


def filter_mask(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Boolean [B, V]: tokens kept by top-k then top-p (rows with k=0, p=1 keep all)."""
    vocab = scores.shape[-1]
    # Checked (a host read) only past the limit, so normal vocabularies never sync here.
    if vocab > MAX_VOCAB_FIXED and bool((top_p < 1.0).any()):
        raise ValueError(f"top-p < 1 supports a vocabulary of up to {MAX_VOCAB_FIXED} ids, got {vocab}")
    scores = scores.float()
    ordered, _ = torch.sort(scores, dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = ordered.gather(-1, (k - 1)[:, None])
    ordered = torch.where(ordered >= kth, ordered, NEG_INF)
    w = fixed_weights(ordered)
    total = w.sum(-1, keepdim=True)
    before = torch.cumsum(w, dim=-1) - w
    p_fx = torch.floor(top_p.float() * float(FX_ONE)).to(torch.int64)[:, None]
    keep_sorted = (before * FX_ONE < p_fx * total) | (top_p >= 1.0)[:, None]
    keep_sorted &= ordered > NEG_INF
    # The prefix is contiguous, so its last kept score is the row's threshold.
    count = keep_sorted.sum(-1).clamp(min=1)
    threshold = ordered.gather(-1, (count - 1)[:, None])
    return scores >= torch.maximum(threshold, kth)


def top_k_mask(scores: torch.Tensor, top_k: torch.Tensor, top_k_max: int) -> torch.Tensor:
    """filter_mask for batches where no row uses top-p: only the top_k_max largest scores
    are needed (topk instead of a full sort), and the kept set is the same."""
    vocab = scores.shape[-1]
    k_max = min(top_k_max, vocab)
    best = torch.topk(scores, k_max, dim=-1).values
    k = torch.where(top_k > 0, top_k.clamp(max=k_max), torch.full_like(top_k, k_max))
    kth = best.gather(-1, (k - 1)[:, None])
    return (scores >= kth) | (top_k <= 0)[:, None]


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    frame_index: torch.Tensor,
    codebook: int,
    *,
    allowed: torch.Tensor | None = None,
    apply_filters: bool = True,
    key: torch.Tensor | None = None,
    top_k_max: int | None = None,
    any_top_p: bool = True,
    noise: torch.Tensor | None = None,
    rules: Rules | None = None,
    top_k_min: int | None = None,
    late: Rules | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. Returns (tokens int64 [B], fault int32 [B]): 0 = ok, else
    FAULT_NAN / FAULT_POSINF / FAULT_EMPTY (`faults`; callers needing a bool use fault != 0).

    allowed: optional bool [V] mask of ids that may be sampled at all (e.g. codec ids + EOS);
    a -inf logit masks its id the same way.
    The rest are host-known shortcuts that never change a result: apply_filters=False when
    no row restricts top-k/top-p; key = frame_key(seed, frame_index) precomputed for the
    step; top_k_max (the largest top_k of the rows) with any_top_p=False lets top-k use
    topk instead of a sort; noise [B, V] precomputed for this codebook (gumbel_noise_codebooks).
    rules: history rules applied to the read, masked logits (`penalties`), before the faults'
    empty-row check. top_k_min: the smallest top_k among the rows that sample (temperature >
    0; 0 if one of them has no top-k, NO_SAMPLED_ROWS if every row is greedy): with top-k
    only, CPU tensors and k_max <= V / 4, noise is drawn for the top k_max candidates only
    (`candidates`), not all V ids. late: rules applied to the scores after temperature and
    filters (float32 [B, V] -> [B, V], -inf kept), before the noise; greedy rows get them too.
    """
    logits, fault = row_faults(logits, allowed, rules)
    greedy = temperature <= 0
    every_row_greedy = top_k_min is not None and top_k_min >= NO_SAMPLED_ROWS
    if every_row_greedy and late is None:
        return torch.argmax(logits, dim=-1), fault
    scores = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    vocab = logits.shape[-1]
    # The candidate path reads the top-k scores only; a late rule may reorder them (no fast path).
    if (apply_filters and not any_top_p and noise is None and top_k_max is not None and 0 < 4 * top_k_max <= vocab
            and top_k_min is not None and top_k_min > 0 and logits.device.type == "cpu" and late is None):
        key = frame_key(seed, frame_index) if key is None else key
        tokens = top_k_candidates(scores, top_k, top_k_max, codebook_key(key, codebook), greedy)
        if tokens is not None:
            return tokens, fault
    if apply_filters:
        if not any_top_p and top_k_max is not None and top_k_max > 0:
            keep = top_k_mask(scores, top_k, top_k_max)
        else:
            keep = filter_mask(scores, top_k, top_p)
        scores = scores.masked_fill(~keep, NEG_INF)
    # A greedy row's scores are its logits (divided by 1); filters never drop its argmax, so
    # without late rules the logits are read directly.
    if late is not None:
        scores = late(scores)
    base = logits if late is None else scores
    if every_row_greedy:
        return torch.argmax(base, dim=-1), fault
    if noise is None:
        key = frame_key(seed, frame_index) if key is None else key
        noise = gumbel_noise(codebook_key(key, codebook), logits.shape[-1])
    scores = torch.where(greedy[:, None], base, scores + noise)
    return torch.argmax(scores, dim=-1), fault
