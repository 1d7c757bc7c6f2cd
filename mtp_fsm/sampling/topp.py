"""The top-p mass in fixed point: exact integers, so the kept set is identical on every backend.

A floating-point softmax and cumulative sum are not reproducible bit-for-bit: exp, the sum
and the scan order round differently on torch CPU, torch CUDA and a Triton kernel, so a
token whose mass-before lies within rounding of top_p could be kept by one backend and
dropped by another. The rule here has no floating-point reduction at all:

1. d = (max_score - s) in float32 (one correctly rounded subtraction, over the top-k
   filtered row), q = floor(d * FX_STEP) clamped to FX_LIMIT (NaN -> FX_LIMIT); the
   scaling by 2**12 is exact;
2. weight(q) = (HI[q >> 6] * LO[q & 63]) >> 24 with the int64 tables of `fixed_tables`
   (HI[j] = round(2**24 exp(-j/64)), HI[FX_LIMIT >> 6] = 0, LO[i] = round(2**24 exp(-i/4096)));
   -inf scores weigh 0. The weight is exp(-d) to ~2**-12 relative;
3. total and the mass before each sorted position are exact int64 sums (order-free);
4. a sorted position is kept iff before * FX_ONE < floor(top_p * FX_ONE) * total (or top_p >= 1).

Every quantity fits int64 for vocab <= MAX_VOCAB_FIXED.
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
    """The (HI, LO) int64 weight tables on `device` (uploaded once, then cached)."""
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
