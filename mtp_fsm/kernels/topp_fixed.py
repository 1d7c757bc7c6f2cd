"""Proposed exactly reproducible top-p rule (fixed-point mass), torch side.

The current contract (sampling/sampler.py) decides top-p with a float64 softmax and a
cumulative sum. exp, the sum and the scan order are not specified bit-for-bit: torch's
CPU softmax, torch's CUDA softmax and a Triton kernel each round differently, so a
token whose mass-before lies within ~1e-16 of top_p can be kept by one backend and
dropped by another. This module defines a rule with no floating-point reduction at all:

1. sort the (temperature-scaled) scores descending and apply top-k exactly as now;
2. d = (max_score - s) in float32 (one correctly rounded subtraction), q = floor(d * 4096)
   clamped to FX_LIMIT (NaN -> FX_LIMIT); the scaling by 2**12 is exact;
3. weight(q) = (HI[q >> 6] * LO[q & 63]) >> 24 with the int64 tables below
   (HI[j] = round(2**24 exp(-j/64)), HI[FX_LIMIT >> 6] = 0, LO[i] = round(2**24 exp(-i/4096)));
   -inf scores weigh 0. The weight is exp(-d) to ~2**-12 relative, in integers;
4. total and the mass before each sorted position are exact int64 sums (order-free);
5. keep the sorted position iff before * 2**24 < floor(top_p * 2**24) * total (or
   top_p >= 1), then exactly as now: count >= 1, threshold = value at count - 1, keep
   scores >= max(threshold, kth).

All quantities fit int64 for vocab <= 2**14. Both sides compute the same integers, so the
kept set is bit-identical on every backend, including at the boundary.
`filter_mask_fixed` has the same signature as `sampling.filter_mask`, so adopting the
rule is a one-line change in the sampler plus TOPP_FIXED = True in the Triton backend.
"""

from __future__ import annotations

import functools
import math

import torch

FX_STEP = 4096  # quantisation of d = max - s: 2**12 steps per nat
FX_LIMIT = 17 * FX_STEP  # exp(-17) * 2**24 < 1: weights past this are 0
FX_ONE = 1 << 24
MAX_VOCAB_FIXED = 1 << 14


@functools.lru_cache(maxsize=None)
def _tables_cpu() -> tuple[torch.Tensor, torch.Tensor]:
    hi = [round(FX_ONE * math.exp(-j / 64)) for j in range(FX_LIMIT >> 6)] + [0]
    lo = [round(FX_ONE * math.exp(-i / FX_STEP)) for i in range(64)]
    return torch.tensor(hi, dtype=torch.int64), torch.tensor(lo, dtype=torch.int64)


_device_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def fixed_tables(device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    device = torch.device(device)
    tables = _device_tables.get(device)
    if tables is None:
        tables = _device_tables[device] = tuple(t.to(device) for t in _tables_cpu())
    return tables


def fixed_weights(ordered: torch.Tensor) -> torch.Tensor:
    """int64 weights of a descending-sorted float32 row block [B, V] (-inf -> 0)."""
    hi, lo = fixed_tables(ordered.device)
    d = (ordered[:, :1] - ordered) * float(FX_STEP)
    q = torch.nan_to_num(d, nan=float(FX_LIMIT)).clamp(max=float(FX_LIMIT)).to(torch.int64)
    w = (hi[q >> 6] * lo[q & 63]) >> 24
    return torch.where(ordered > float("-inf"), w, 0)


def filter_mask_fixed(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Drop-in for `sampling.filter_mask` with the fixed-point top-p mass."""
    vocab = scores.shape[-1]
    if vocab > MAX_VOCAB_FIXED:
        raise ValueError(f"fixed-point top-p supports vocab <= {MAX_VOCAB_FIXED}, got {vocab}")
    scores = scores.float()
    ordered, _ = torch.sort(scores, dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = ordered.gather(-1, (k - 1)[:, None])
    ordered = torch.where(ordered >= kth, ordered, float("-inf"))
    w = fixed_weights(ordered)
    total = w.sum(-1, keepdim=True)
    before = torch.cumsum(w, dim=-1) - w
    p_fx = torch.floor(top_p.float() * float(FX_ONE)).to(torch.int64)[:, None]
    keep = (before * FX_ONE < p_fx * total) | (top_p >= 1.0)[:, None]
    keep &= ordered > float("-inf")
    count = keep.sum(-1).clamp(min=1)
    threshold = ordered.gather(-1, (count - 1)[:, None])
    return scores >= torch.maximum(threshold, kth)
