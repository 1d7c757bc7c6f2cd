"""GPT-2 blocks with HF parameter names (Conv1D, LayerNorm, fused-qkv attention over a per-slot KV cache)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mtp_fsm import invariant


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms and softmax run in at least float32 (float64 stays float64 for exact tests)."""
    return torch.promote_types(dtype, torch.float32)


class Conv1D(nn.Module):
    """HF GPT-2 `Conv1D`: weight [in, out] (transposed w.r.t. nn.Linear), y = x @ W + b."""

    def __init__(self, nx: int, nf: int, batch_invariant: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        self.batch_invariant = batch_invariant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return invariant.matmul(x, self.weight) + self.bias
        return F.linear(x, self.weight.t(), self.bias)


class Linear(nn.Linear):
    """nn.Linear (same state_dict keys) with an optional batch-invariant evaluation."""

    def __init__(self, in_features: int, out_features: int, bias: bool, batch_invariant: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.batch_invariant = batch_invariant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.batch_invariant:
            return F.linear(x, self.weight, self.bias)
        return invariant.linear(x, self.weight, self.bias)


class LayerNorm(nn.Module):
    """nn.LayerNorm's parameters, computed per row in at least float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(compute_dtype(x.dtype))
        # Fixed-order means: the same bits on every CPU kernel set (mtp_fsm.invariant).
        h = invariant.rms_norm(h - invariant.mean(h, -1, keepdim=True), self.eps)
        return (h * self.weight.to(h.dtype) + self.bias.to(h.dtype)).to(x.dtype)


def activation(name: str, x: torch.Tensor, bi: bool = False) -> torch.Tensor:
    # HF "gelu_new" is the tanh approximation; "gelu" the exact erf form (the config refuses
    # it with batch_invariant: mtp_fsm.invariant has no erf).
    if bi:
        return invariant.gelu_tanh(x)
    return F.gelu(x, approximate="none" if name == "gelu" else "tanh")


class Attention(nn.Module):
    """GPT-2 self-attention: fused `c_attn` (q|k|v, with bias), `c_proj`, scale 1/sqrt(head_dim)."""

    def __init__(self, hidden: int, heads: int, bi: bool):
        super().__init__()
        self.heads, self.head_dim, self.bi = heads, hidden // heads, bi
        self.scaling = 1.0 / math.sqrt(self.head_dim)
        self.c_attn = Conv1D(hidden, 3 * hidden, bi)
        self.c_proj = Conv1D(hidden, hidden, bi)

    def forward_cached(self, x: torch.Tensor, write_slot: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                       cache_k: torch.Tensor, cache_v: torch.Tensor) -> torch.Tensor:
        """Flat tokens x [T, hidden]: write k/v at (write_slot, pos), attend to the slot's [0, pos].

        Padding tokens arrive with write_slot = the scratch row, so the write needs no
        filtering (no host sync) and touches no real slot. All writes happen before the
        gather, so tokens of one request in a chunk see each other.
        """
        q, k, v = self.c_attn(x).unflatten(-1, (3, self.heads, self.head_dim)).unbind(-3)  # [T, nh, D] each
        cache_k.index_put_((write_slot, pos), k.to(cache_k.dtype))
        cache_v.index_put_((write_slot, pos), v.to(cache_v.dtype))
        keep = mask[:, :, None, None]  # [T, C, 1, 1]
        zero = torch.zeros((), dtype=q.dtype, device=q.device)
        # Entries beyond the row's position may be stale (even NaN/inf): zero them, not just mask,
        # because 0 * NaN in the value sum would still be NaN.
        keys = torch.where(keep, cache_k[write_slot].to(q.dtype), zero).movedim(-3, -2)  # [T, nh, C, D]
        vals = torch.where(keep, cache_v[write_slot].to(q.dtype), zero).movedim(-3, -2)
        if self.bi:
            scores = invariant.tree_sum(q.unsqueeze(-2) * keys, -1)  # [T, nh, C]
        else:
            scores = (q.unsqueeze(-2) @ keys.transpose(-1, -2)).squeeze(-2)
        scores = (scores * self.scaling).masked_fill(~mask[:, None, :], float("-inf"))
        softmax = invariant.softmax if self.bi else torch.softmax
        probs = softmax(scores.to(compute_dtype(scores.dtype)), dim=-1).to(q.dtype)
        if self.bi:
            out = invariant.tree_sum(probs.unsqueeze(-2) * vals.transpose(-1, -2), -1)  # [T, nh, D]
        else:
            out = (probs.unsqueeze(-2) @ vals).squeeze(-2)
        return self.c_proj(out.flatten(-2))


class MLP(nn.Module):
    """GPT-2 MLP: c_proj(act(c_fc(x)))."""

    def __init__(self, hidden: int, inner: int, act: str, bi: bool):
        super().__init__()
        self.c_fc = Conv1D(hidden, inner, bi)
        self.c_proj = Conv1D(inner, hidden, bi)
        self.act, self.bi = act, bi

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(activation(self.act, self.c_fc(x), self.bi))


class Block(nn.Module):
    """Pre-LayerNorm GPT-2 block (`h.{i}`): x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, hidden: int, heads: int, inner: int, eps: float, act: str, bi: bool):
        super().__init__()
        self.ln_1 = LayerNorm(hidden, eps)
        self.attn = Attention(hidden, heads, bi)
        self.ln_2 = LayerNorm(hidden, eps)
        self.mlp = MLP(hidden, inner, act, bi)

    def forward(self, x: torch.Tensor, write_slot: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                cache_k: torch.Tensor, cache_v: torch.Tensor) -> torch.Tensor:
        x = x + self.attn.forward_cached(self.ln_1(x), write_slot, pos, mask, cache_k, cache_v)
        return x + self.mlp(self.ln_2(x))


class GPT2Backbone(nn.Module):
    """HF `GPT2Model` minus `wte` (T3 always feeds embeddings): `wpe`, `h.*`, `ln_f`."""

    def __init__(self, hidden: int, layers: int, heads: int, inner: int, n_positions: int, eps: float,
                 act: str, bi: bool):
        super().__init__()
        self.wpe = nn.Embedding(n_positions, hidden)
        self.h = nn.ModuleList(Block(hidden, heads, inner, eps, act, bi) for _ in range(layers))
        self.ln_f = LayerNorm(hidden, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor,
                cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """x [T, H] flat token embeddings -> ln_f hidden [T, H], writing each layer's KV cache.

        GPT-2 adds the learned position embedding of each token's absolute position
        (prompt positions from 0, then one per frame), exactly as upstream's cached
        `GPT2Model` does from its cache length.
        """
        rows, context = cache[0][0].shape[:2]
        # Padding tokens (slot -1) write and read the scratch row rows-1, never a real slot.
        write_slot = torch.where(token_slots >= 0, token_slots, torch.full_like(token_slots, rows - 1))
        # Padding tokens may carry any position; clamping keeps the gathers in bounds.
        pos = positions.clamp(0, context - 1)
        mask = torch.arange(context, device=x.device)[None, :] <= pos[:, None]  # [T, C]
        x = x + self.wpe(pos).to(x.dtype)
        for block, (cache_k, cache_v) in zip(self.h, cache):
            x = block(x, write_slot, pos, mask, cache_k, cache_v)
        return self.ln_f(x)
