"""Triton sampling: counter-based hash noise, temperature / top-k / top-p / greedy, Gumbel-max.

A port of `mtp_fsm.sampling` (see the contract in sampling/sampler.py):

- the hash (`mix32`, `row_key`, `token_hash`) uses the same int64 ops with 32-bit masks
  and multipliers below 2**31, and the Gumbel value is read from the same lookup table
  tensor (`noise.gumbel_table(device)`), so the noise bits are identical;
- `logits / temperature` is the correctly rounded division (`div_rn`; Triton's `/` on
  float32 is approximate on the GPU);
- top-k keeps scores >= the k-th largest, found by bisection on the float bits (exact);
- top-p follows the reference's fixed-point rule (`sampling.topp`): the same int64 weights
  from the same tables, exact int64 sums, and the same integer comparison, with the
  threshold value found by the same bisection instead of a sort, so the kept set is
  identical to the reference's, boundaries included;
- argmax over kept ids with ties to the lowest id; greedy rows take argmax of the raw
  (masked) logits;
- a -inf logit masks its id like `allowed` does; NaN / +inf (read as 0) and a row with no
  unmasked id are the fault codes of `sampling.faults`, in the same precedence.

The whole row lives in one block (vocab up to MAX_VOCAB).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..sampling.faults import FAULT_EMPTY as _FAULT_EMPTY, FAULT_NAN as _FAULT_NAN, FAULT_POSINF as _FAULT_POSINF
from ..sampling.noise import MUL_A as _MUL_A, MUL_B as _MUL_B, NOISE_BITS as _NOISE_BITS
from ..sampling.topp import FX_LIMIT as _FX_LIMIT, FX_ONE as _FX_ONE, FX_STEP as _FX_STEP

MUL_A = tl.constexpr(_MUL_A)
MUL_B = tl.constexpr(_MUL_B)
NOISE_SHIFT = tl.constexpr(32 - _NOISE_BITS)
FX_STEP = tl.constexpr(_FX_STEP)
FX_LIMIT = tl.constexpr(_FX_LIMIT)
FX_ONE = tl.constexpr(_FX_ONE)
FAULT_NAN = tl.constexpr(_FAULT_NAN)
FAULT_POSINF = tl.constexpr(_FAULT_POSINF)
FAULT_EMPTY = tl.constexpr(_FAULT_EMPTY)
MAX_VOCAB = 16384


@triton.jit
def mix32(x):
    """32-bit avalanche mix on int64 values in [0, 2**32): same ops as sampling.noise.mix32."""
    m = tl.full([], 4294967295, tl.int64)
    x = x ^ (x >> 16)
    x = (x * MUL_A) & m
    x = x ^ (x >> 15)
    x = (x * MUL_B) & m
    return x ^ (x >> 16)


@triton.jit
def row_key(seed, frame_index, codebook):
    m = tl.full([], 4294967295, tl.int64)
    seed = seed.to(tl.int64)
    h = mix32(seed & m)
    h = mix32(h ^ ((seed >> 32) & m))
    h = mix32(h ^ (frame_index.to(tl.int64) & m))
    return mix32(h ^ (codebook.to(tl.int64) & m))


@triton.jit
def _order_key(x):
    """Order-preserving int64 key in [0, 2**32) of float32 values (no NaN)."""
    b = x.to(tl.int32, bitcast=True)
    return (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.int64) + 2147483648


@triton.jit
def _largest_key(keys, weights, need, valid):
    """Per row, the largest key t with sum(weights where key >= t) >= need (0 if none):
    a 32-step bisection on the key bits (exact, no sort)."""
    ans = tl.zeros_like(need).to(tl.int64)
    one = tl.full([], 1, tl.int64)
    for i in range(32):
        cand = ans | (one << (31 - i))
        got = tl.sum(tl.where(valid & (keys >= cand[:, None]), weights, 0), 1)
        ans = tl.where(got >= need, cand, ans)
    return ans


@triton.jit
def _value_at(keys, values, key):
    return tl.max(tl.where(keys == key[:, None], values, float("-inf")), 1)


@triton.jit
def _fixed_weights(ordered, fx_hi_ptr, fx_lo_ptr):
    """Integer weight of every score: exp(-(max - s)) in fixed point, from tables."""
    top = tl.max(ordered, 1)
    d = (top[:, None] - ordered) * (FX_STEP * 1.0)  # exact scaling by 2**12
    q = tl.minimum(d, FX_LIMIT * 1.0)
    q = tl.where(q == q, q, FX_LIMIT * 1.0).to(tl.int64)  # floor (q >= 0), NaN -> limit
    q = tl.minimum(q, FX_LIMIT)
    hi = tl.load(fx_hi_ptr + (q >> 6))
    lo = tl.load(fx_lo_ptr + (q & 63))
    return (hi * lo) >> 24


@triton.jit
def filter_keep(scores, inb, V, top_k, top_p, fx_hi_ptr, fx_lo_ptr):
    """Boolean [R, BLOCK_V]: ids kept by top-k then top-p, equal to the reference's
    sort-based rule without sorting (the interpreter's tl.sort is unusably slow):

    - kth = the k-th largest score: the largest key t with count(key >= t) >= k;
    - the reference keeps the sorted prefix whose integer mass-before * 2**24 < need =
      floor(top_p * 2**24) * total and thresholds at its last value v*; v* is the largest
      value whose inclusive mass (scores >= v, times 2**24) is >= need, capped at the top
      score (need == 0 keeps no position, count -> 1), or the smallest finite score when
      top_p >= 1;
    - keep scores >= max(v*, kth).
    (A 0-d bool is never combined with a block: the interpreter mis-broadcasts it.)"""
    # k = V (top_k 0) keeps everything: kth is the smallest score. The searches below run
    # only when some row of the tile needs them (a branch on device values, no sync).
    kth = tl.min(tl.where(inb, scores, float("inf")), 1)
    if tl.max(top_k, 0) > 0:
        keys = _order_key(scores)
        k = tl.where(top_k > 0, tl.minimum(top_k, V), V)
        kth = _value_at(keys, scores, _largest_key(keys, 1, k, inb))
    kept = tl.where(inb & (scores >= kth[:, None]), scores, float("-inf"))
    finite = kept > float("-inf")
    lowest = tl.min(tl.where(finite, kept, float("inf")), 1)
    lowest = tl.where(lowest == float("inf"), float("-inf"), lowest)
    vstar = lowest  # top_p >= 1: every finite kept score
    if tl.min(top_p, 0) < 1.0:
        keys = _order_key(kept)
        top = tl.max(kept, 1)
        w = tl.where(finite, _fixed_weights(kept, fx_hi_ptr, fx_lo_ptr), 0)
        total = tl.sum(w, 1)
        need = tl.floor(top_p * (FX_ONE * 1.0)).to(tl.int64) * total
        # Always reached (floor(top_p * 2**24) <= 2**24). need == 0 (top_p < 2**-24 or
        # total 0) holds above the top score too: the reference keeps count 1 -> the top.
        v_key = tl.minimum(_largest_key(keys, w * FX_ONE, need, inb), _order_key(top))
        found = _value_at(keys, kept, v_key)
        vstar = tl.where(top_p >= 1.0, lowest, found)
    return scores >= tl.maximum(vstar, kth)[:, None]


@triton.jit
def sample_rows(logit_ptr, logits_stride, rows, rmask, V, temperature, top_k, top_p, key, allowed_ptr, gumbel_ptr,
                fx_hi_ptr, fx_lo_ptr, counts_ptr, counts_stride, slot, penalty, suppress, eos_id,
                HAS_ALLOWED: tl.constexpr, APPLY_FILTERS: tl.constexpr, HAS_PENALTY: tl.constexpr,
                HAS_SUPPRESS: tl.constexpr, BLOCK_V: tl.constexpr, PENALTY_AFTER: tl.constexpr):
    """A tile of rows of `sampling.sample_tokens`: (tokens int64 [R], fault int32 [R]).

    The history rules of `sampling.penalties` (HAS_PENALTY: ids with counts[slot] > 0
    penalised by the row's `penalty`; HAS_SUPPRESS: id eos_id masked on `suppress` rows)
    act on the read, masked logits before the empty-row check, as in the reference; with
    PENALTY_AFTER the penalty acts on the scaled, filtered scores instead (greedy rows: their
    filtered logits), like the reference's `late` rule."""
    offs = tl.arange(0, BLOCK_V)
    inb = rmask[:, None] & (offs < V)[None, :]
    x = tl.load(logit_ptr + rows.to(tl.int64)[:, None] * logits_stride + offs[None, :], mask=inb, other=0.0)
    x = x.to(tl.float32)
    nan = x != x
    posinf = x == float("inf")
    has_nan = tl.sum((inb & nan).to(tl.int32), 1) > 0
    has_posinf = tl.sum((inb & posinf).to(tl.int32), 1) > 0
    x = tl.where(nan | posinf, 0.0, x)  # -inf stays: a masked id
    if HAS_ALLOWED:
        ok = tl.load(allowed_ptr + offs, mask=offs < V, other=0) != 0
        x = tl.where(ok[None, :], x, float("-inf"))
    if HAS_PENALTY:
        seen = tl.load(counts_ptr + slot.to(tl.int64)[:, None] * counts_stride + offs[None, :], mask=inb, other=0) > 0
        p = penalty.to(tl.float32)[:, None]
        if not PENALTY_AFTER:
            x = tl.where(seen, tl.where(x < 0, x * p, tl.math.div_rn(x, p)), x)
    if HAS_SUPPRESS:
        x = tl.where(suppress[:, None] & (offs == eos_id)[None, :], float("-inf"), x)
    x = tl.where(inb, x, float("-inf"))
    empty = rmask & (tl.sum((x > float("-inf")).to(tl.int32), 1) == 0)
    fault = tl.where(has_nan, FAULT_NAN, tl.where(has_posinf, FAULT_POSINF, tl.where(empty, FAULT_EMPTY, 0)))
    fault = fault.to(tl.int32)
    greedy = temperature <= 0
    scores = tl.math.div_rn(x, tl.where(greedy, 1.0, temperature).to(tl.float32)[:, None])
    if APPLY_FILTERS:
        keep = filter_keep(scores, inb, V, top_k, top_p, fx_hi_ptr, fx_lo_ptr)
        scores = tl.where(keep, scores, float("-inf"))
    base = x  # a greedy row's argmax: filters never drop it, so the logits serve
    if HAS_PENALTY:
        if PENALTY_AFTER:
            # -inf * p and -inf / p stay -inf: the kept set is the unpenalised one.
            scores = tl.where(seen, tl.where(scores < 0, scores * p, tl.math.div_rn(scores, p)), scores)
            base = scores  # greedy rows: their scores are the logits divided by 1
    h = mix32(key[:, None] ^ offs.to(tl.int64)[None, :])
    noise = tl.load(gumbel_ptr + (h >> NOISE_SHIFT), mask=inb, other=0.0)
    final = tl.where(greedy[:, None], base, scores + noise)
    final = tl.where(inb, final, float("-inf"))
    token = tl.argmax(final, 1, tie_break_left=True)
    return token.to(tl.int64), fault


@triton.jit
def sample_cb0_rows(logits_ptr, logits_stride, rows, rm, V, slot, frames, seed_ptr, temp_ptr, topk_ptr, topp_ptr,
                    pen_ptr, minf_ptr, allowed_ptr, gumbel_ptr, fx_hi_ptr, fx_lo_ptr, counts_ptr, counts_stride,
                    counts_row, eos_id, HAS_ALLOWED: tl.constexpr, APPLY_FILTERS: tl.constexpr,
                    HAS_PENALTY: tl.constexpr, HAS_SUPPRESS: tl.constexpr, BLOCK_V: tl.constexpr,
                    PENALTY_AFTER: tl.constexpr):
    """CB0 of frame `frames` for the request in `slot` (logits row `rows`): its sampling
    columns, counter key and min_frames EOS suppression, the penalty's history in counts row
    `counts_row` (`row_ops.draw_cb0_rows`, for plain rows and verify positions alike)."""
    seed = tl.load(seed_ptr + slot, mask=rm, other=0)
    key = row_key(seed, frames, seed * 0)
    suppress = frames < tl.load(minf_ptr + slot, mask=rm, other=0)
    return sample_rows(
        logits_ptr, logits_stride, rows, rm, V, tl.load(temp_ptr + slot, mask=rm, other=0.0),
        tl.load(topk_ptr + slot, mask=rm, other=0), tl.load(topp_ptr + slot, mask=rm, other=1.0), key,
        allowed_ptr, gumbel_ptr, fx_hi_ptr, fx_lo_ptr, counts_ptr, counts_stride, counts_row,
        tl.load(pen_ptr + slot, mask=rm, other=1.0), suppress, eos_id,
        HAS_ALLOWED, APPLY_FILTERS, HAS_PENALTY, HAS_SUPPRESS, BLOCK_V, PENALTY_AFTER)
