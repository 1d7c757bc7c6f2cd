"""Attention over the paged KV of a step: each query reads only its sequence's filled blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.paged_kv import StepKV


def attend_paged(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepKV,
                 pool_k: torch.Tensor, pool_v: torch.Tensor) -> torch.Tensor:
    """Write this step's k/v [T, KV, D] into the pools, then attend q [T, H, D] over each
    token's sequence up to its own position -> o_proj output [T, hidden].

    `attn` is a Qwen3-style Attention (heads, kv_heads, head_dim, scaling, bi, _attend, o_proj).
    All writes happen before the reads, so tokens of one request in a chunk see each other.
    """
    step.write(pool_k, k)
    step.write(pool_v, v)
    keys = step.gather(pool_k).to(q.dtype)  # [S, L, KV, D]
    vals = step.gather(pool_v).to(q.dtype)
    if attn.bi:
        return _attend_invariant(attn, q, keys, vals, step)
    return attn.o_proj(attend_sdpa(q, keys, vals, step, attn.scaling))


def _attend_invariant(attn, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, step: StepKV) -> torch.Tensor:
    """The batch-invariant reductions of `attn._attend`, per token over [0, read_len): the same
    bits as over the whole max_context row, because every key past a token's position is
    zeroed before use (exp(-inf) = 0 and 0 * 0 add nothing to the fixed-order tree sums)."""
    if not step.tokens_are_seqs:
        keys, vals = keys[step.token_seq], vals[step.token_seq]  # [T, L, KV, D]
    mask = step.key_positions(q.device)[None, :] <= step.token_pos[:, None]  # [T, L]
    return attn._attend(q, keys, vals, mask)


def attend_sdpa(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, step: StepKV,
                scaling: float) -> torch.Tensor:
    """q [T, H, D] over keys/vals [S, L, KV, D] -> [T, H * D] with scaled_dot_product_attention
    (GQA through enable_gqa; on a GPU it dispatches to the fused kernels).

    Queries are laid out on the step's [S, Tq] grid (a view for a decode step). Keys a query
    must not see are masked with -inf; they are never garbage from another request: a block
    is zeroed when a slot takes it, and past a sequence's newest position a slot holds only
    zeros or its own earlier writes.
    """
    heads, dim = q.shape[-2:]
    s, tq = step.num_seqs, step.queries_per_seq
    if step.tokens_are_seqs:
        grid = q[:, None]  # [S, 1, H, D]
    else:
        grid = q.new_zeros(s * tq, heads, dim)
        grid[step.token_seq * tq + step.token_rank] = q
        grid = grid.view(s, tq, heads, dim)
    mask = step.key_positions(q.device)[None, None, :] <= step.query_pos[:, :, None]  # [S, Tq, L]
    out = F.scaled_dot_product_attention(grid.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2),
                                         attn_mask=mask[:, None], scale=scaling,
                                         enable_gqa=keys.shape[-2] != heads)  # [S, H, Tq, D]
    out = out.transpose(1, 2).reshape(s * tq, heads * dim)
    return out if step.tokens_are_seqs else out[step.token_seq * tq + step.token_rank]
