"""Qwen3 transformer blocks: RMSNorm, RoPE, GQA attention over a per-slot KV cache or causally, SwiGLU."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mtp_fsm import invariant

from models.cpu_linear import PackedWeight, packed_linear
from models.paged_attention import attend_paged
from models.paged_kv import StepKV


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms, softmax and RoPE run in at least float32 (float64 stays float64 for exact tests)."""
    return torch.promote_types(dtype, torch.float32)


class Linear(nn.Linear):
    """nn.Linear (same state_dict keys) with an optional batch-invariant evaluation."""

    def __init__(self, in_features: int, out_features: int, bias: bool, batch_invariant: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.batch_invariant = batch_invariant
        self._packed = PackedWeight()  # large weights on a CPU: oneDNN over a packed copy (models.cpu_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # BLAS picks kernels by shape and CPU, so a row's bits would depend on the batch.
        if not self.batch_invariant:
            out = packed_linear(x, self.weight, self.bias, self._packed)
            return F.linear(x, self.weight, self.bias) if out is None else out
        return invariant.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fixed_order = True  # fast_norms() clears it in models built without batch invariance

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(compute_dtype(x.dtype))
        if self.fixed_order:
            # A fixed-order mean: the same bits on every CPU kernel set (mtp_fsm.invariant).
            return self.weight * invariant.rms_norm(h, self.eps).to(x.dtype)
        # Upstream's formula in ATen's reduction: one op where the fixed-order tree takes ~25.
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def fast_norms(module: nn.Module) -> None:
    """RMSNorms of a model built without batch invariance reduce with ATen (a real-size step
    runs ~4 of them per layer, 15 x 5 layers in the code predictor alone)."""
    for m in module.modules():
        if isinstance(m, RMSNorm):
            m.fixed_order = False


def rope_tables(num_positions: int, head_dim: int, theta: float, dtype: torch.dtype,
                device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [num_positions, head_dim] for 1-D positions (rotate-half layout).

    The talker upstream uses interleaved MRoPE with three position streams (t, h, w);
    for audio-only talker sequences all three equal the token position, so every
    frequency sees the same angle and MRoPE reduces exactly to this 1-D table.
    """
    emb = rope_angles(num_positions, head_dim, theta, compute_dtype(dtype))
    cos, sin = invariant.cos_sin(torch.cat([emb, emb], dim=-1))
    return cos.to(dtype).to(device), sin.to(dtype).to(device)


def rope_angles(num_positions: int, head_dim: int, theta: float, ct: torch.dtype) -> torch.Tensor:
    """position * inv_freq [num_positions, head_dim / 2] in `ct`, upstream's op order; the
    powers come from Python's libm, not torch's per-kernel-set pow (mtp_fsm.invariant)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(ct) / head_dim
    inv_freq = 1.0 / invariant.pow_table(theta, exponents)
    return torch.arange(num_positions, dtype=ct)[:, None] * inv_freq[None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, head_dim]; cos/sin [..., head_dim] broadcast over heads."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


class Attention(nn.Module):
    """Qwen3 GQA attention: no biases, per-head RMSNorm on q and k before RoPE."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, bi: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.bi = heads, kv_heads, head_dim, bi
        self.scaling = head_dim**-0.5
        self.q_proj = Linear(hidden, heads * head_dim, False, bi)
        self.k_proj = Linear(hidden, kv_heads * head_dim, False, bi)
        self.v_proj = Linear(hidden, kv_heads * head_dim, False, bi)
        self.o_proj = Linear(heads * head_dim, hidden, False, bi)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        lead = x.shape[:-1]
        q = self.q_norm(self.q_proj(x).view(*lead, self.heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(*lead, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(*lead, self.kv_heads, self.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [..., H, D]; keys/vals [..., C, KV, D]; mask bool [..., C] -> [..., H*D].

        Masked keys and values are replaced by zeros before use, so whatever sits in a
        stale or never-written cache entry (even NaN/inf) cannot reach the output.
        """
        groups = self.heads // self.kv_heads
        q = q.unflatten(-2, (self.kv_heads, groups))  # [..., KV, G, D]
        keep = mask[..., None, None]
        keys = torch.where(keep, keys, torch.zeros((), dtype=keys.dtype, device=keys.device))
        vals = torch.where(keep, vals, torch.zeros((), dtype=vals.dtype, device=vals.device))
        keys = keys.movedim(-3, -2)  # [..., KV, C, D]
        vals = vals.movedim(-3, -2)
        if self.bi:
            # Fixed-order reductions (mtp_fsm.invariant): a row's bits do not depend on the batch.
            # Query group g of KV head h meets KV head h: [..., KV, G, 1, D] x [..., KV, 1, C, D].
            scores = invariant.tree_sum(q.unsqueeze(-2) * keys.unsqueeze(-3), -1)  # [..., KV, G, C]
        else:
            scores = q @ keys.transpose(-1, -2)
        scores = (scores * self.scaling).masked_fill(~mask[..., None, None, :], float("-inf"))
        softmax = invariant.softmax if self.bi else torch.softmax
        probs = softmax(scores.to(compute_dtype(scores.dtype)), dim=-1).to(q.dtype)
        if self.bi:
            out = invariant.tree_sum(probs.unsqueeze(-2) * vals.transpose(-1, -2).unsqueeze(-3), -1)  # [..., KV, G, D]
        else:
            out = probs @ vals
        return self.o_proj(out.flatten(-3))

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, write_slot: torch.Tensor,
                       pos: torch.Tensor, mask: torch.Tensor, cache_k: torch.Tensor,
                       cache_v: torch.Tensor) -> torch.Tensor:
        """Flat tokens x [T, hidden]: write k/v at (write_slot, pos), attend to the slot's [0, pos].

        Padding tokens arrive with write_slot = the scratch row (cache row max_slots), so
        the write needs no filtering (no host sync) and no real slot is touched. All writes
        happen before the gather, so tokens of one request in a chunk see each other.
        """
        q, k, v = self._qkv(x, cos, sin)
        cache_k.index_put_((write_slot, pos), k.to(cache_k.dtype))
        cache_v.index_put_((write_slot, pos), v.to(cache_v.dtype))
        keys = cache_k[write_slot].to(q.dtype)  # [T, C, KV, D]
        vals = cache_v[write_slot].to(q.dtype)
        return self._attend(q, keys, vals, mask)

    def forward_paged(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: StepKV,
                      pool_k: torch.Tensor, pool_v: torch.Tensor) -> torch.Tensor:
        """Flat tokens x [T, hidden] over a paged KV (models.paged_kv): write k/v where the step
        plan says, then attend to each token's own slot over [0, pos] (filled blocks only)."""
        q, k, v = self._qkv(x, cos, sin)
        return attend_paged(self, q, k, v, step, pool_k, pool_v)

    def forward_window(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int,
                       cache_k: torch.Tensor, cache_v: torch.Tensor) -> torch.Tensor:
        """x [B, S, hidden] at positions start..start+S-1 of per-row caches [B, C, KV, D]:
        write k/v there, then attend causally to positions [0, start + S) of the same row.

        Only the written prefix is read (a static slice: `start` is a Python int), so the
        rest of the cache may hold anything; keys never mix across rows.
        """
        q, k, v = self._qkv(x, cos, sin)
        end = start + x.shape[-2]
        cache_k[:, start:end] = k.to(cache_k.dtype)
        cache_v[:, start:end] = v.to(cache_v.dtype)
        if not self.bi:
            # Every position < end was written in this window or before it: nothing to zero, one fused call.
            keys, vals = cache_k[:, :end].to(q.dtype).transpose(1, 2), cache_v[:, :end].to(q.dtype).transpose(1, 2)
            causal = torch.arange(end, device=x.device)[None, :] <= torch.arange(start, end, device=x.device)[:, None]
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, vals, attn_mask=causal, scale=self.scaling,
                                                 enable_gqa=self.kv_heads != self.heads)  # [B, H, S, D]
            return self.o_proj(out.transpose(1, 2).flatten(-2))
        keys = cache_k[:, None, :end].to(q.dtype)  # [B, 1, end, KV, D], shared by the S queries
        vals = cache_v[:, None, :end].to(q.dtype)
        key_pos = torch.arange(end, device=x.device)
        mask = key_pos[None, :] <= key_pos[start:, None]  # [S query, end key]
        return self._attend(q, keys, vals, mask)

    def forward_causal(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Plain causal attention over a sequence batch x [B, S, hidden] (no cache)."""
        q, k, v = self._qkv(x, cos, sin)
        seq = x.shape[-2]
        idx = torch.arange(seq, device=x.device)
        mask = idx[None, :] <= idx[:, None]  # [S query, S key]
        return self._attend(q, k.unsqueeze(-4), v.unsqueeze(-4), mask)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, bi: bool):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, False, bi)
        self.up_proj = Linear(hidden, intermediate, False, bi)
        self.down_proj = Linear(intermediate, hidden, False, bi)
        self.act = invariant.silu if bi else F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block; `attend(self_attn, normed_x)` chooses the cached or causal attention."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                 eps: float, bi: bool):
        super().__init__()
        self.self_attn = Attention(hidden, heads, kv_heads, head_dim, eps, bi)
        self.mlp = MLP(hidden, intermediate, bi)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, attend: Callable[[Attention, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        x = x + attend(self.self_attn, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


def run_over_slots(layers, x: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor, cache,
                   cos_table: torch.Tensor, sin_table: torch.Tensor) -> torch.Tensor:
    """Flat tokens x [T, H] of many requests through decoder `layers`, each attending over
    its own slot's KV (a models.slot_cache.PagedKV over these layers) and writing its KV there -> [T, H].

    Padding tokens (slot -1) write a trash block and read zeros, never a real slot; positions
    are clamped into the context (padding may carry any)."""
    step = cache.plan(positions, token_slots)
    pos = step.token_pos
    cos, sin = cos_table[pos], sin_table[pos]
    for layer, (cache_k, cache_v) in zip(layers, cache.layers()):
        def attend(attn: Attention, h: torch.Tensor, k=cache_k, v=cache_v) -> torch.Tensor:
            return attn.forward_paged(h, cos, sin, step, k, v)
        x = layer(x, attend)
    return x
