"""The per-frame local depth transformer: GPT2-style blocks (LayerNorm+bias, fused QKV, interleaved RoPE, SiLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.qwen3_tts.layers import Linear, compute_dtype, rope_angles
from mtp_fsm import invariant

from .config import LocalTransformerConfig

# One frame's local K/V: per layer, the (key, value) [B, heads, head_dim] of each position so far.
FrameCache = list[list[tuple[torch.Tensor, torch.Tensor]]]


class LayerNorm(nn.Module):
    """nn.LayerNorm's parameters (weight, bias) evaluated in at least float32, row by row."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ct = compute_dtype(x.dtype)
        h = x.to(ct)
        # Fixed-order means: the same bits on every CPU kernel set (mtp_fsm.invariant).
        h = invariant.rms_norm(h - invariant.mean(h, -1, keepdim=True), self.eps)
        return (h * self.weight.to(ct) + self.bias.to(ct)).to(x.dtype)


def interleaved_rope_tables(num_positions: int, head_dim: int, base: float, dtype: torch.dtype,
                            device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [num_positions, head_dim] for GPT-J style RoPE: frequency i drives the pair
    (2i, 2i+1), i.e. the tables are repeat_interleave(2) of the per-pair angles."""
    cos, sin = invariant.cos_sin(rope_angles(num_positions, head_dim, base, compute_dtype(dtype)))
    return (cos.repeat_interleave(2, dim=-1).to(dtype).to(device), sin.repeat_interleave(2, dim=-1).to(dtype).to(device))


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...): the interleaved rotation."""
    even, odd = x[..., ::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


class LocalAttention(nn.Module):
    """Fused-QKV multi-head self-attention (no GQA), biases on both projections."""

    def __init__(self, hidden: int, heads: int, bi: bool):
        super().__init__()
        self.hidden, self.heads, self.head_dim, self.bi = hidden, heads, hidden // heads, bi
        self.scaling = self.head_dim**-0.5
        self.c_attn = Linear(hidden, 3 * hidden, True, bi)
        self.c_proj = Linear(hidden, hidden, True, bi)

    def step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One new position per row: x [B, hidden] -> [B, hidden]; appends its k/v to cache."""
        rows = x.shape[0]
        q, k, v = (t.reshape(rows, self.heads, self.head_dim) for t in self.c_attn(x).split(self.hidden, dim=-1))
        q = q * cos + rotate_pairs(q) * sin
        k = k * cos + rotate_pairs(k) * sin
        cache.append((k, v))
        keys = torch.stack([kv[0] for kv in cache], dim=-1)  # [B, heads, head_dim, S]
        vals = torch.stack([kv[1] for kv in cache], dim=-1)
        scores = invariant.tree_sum((q.unsqueeze(-1) * keys).transpose(-1, -2), -1) * self.scaling  # [B, heads, S]
        softmax = invariant.softmax if self.bi else torch.softmax
        probs = softmax(scores.to(compute_dtype(scores.dtype)), dim=-1).to(q.dtype)
        out = invariant.tree_sum(probs.unsqueeze(-2) * vals, -1)  # [B, heads, head_dim]
        return self.c_proj(out.reshape(rows, self.hidden))


class LocalMLP(nn.Module):
    def __init__(self, hidden: int, inner: int, bi: bool):
        super().__init__()
        self.fc_in = Linear(hidden, inner, True, bi)
        self.fc_out = Linear(inner, hidden, True, bi)
        self.act = invariant.silu if bi else F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.act(self.fc_in(x)))


class LocalBlock(nn.Module):
    """Pre-norm GPT2 block: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, cfg: LocalTransformerConfig, bi: bool):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.attn = LocalAttention(cfg.hidden_size, cfg.num_attention_heads, bi)
        self.ln_2 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.mlp = LocalMLP(cfg.hidden_size, cfg.intermediate_size, bi)

    def step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        x = x + self.attn.step(self.ln_1(x), cos, sin, cache)
        return x + self.mlp(self.ln_2(x))


class LocalTransformer(nn.Module):
    """`local_transformer`: blocks `h` + final LayerNorm `ln_f`, run one position at a time.

    Submodule names (`h.{i}.ln_1`, `h.{i}.attn.c_attn`, `h.{i}.attn.c_proj`, `h.{i}.ln_2`,
    `h.{i}.mlp.fc_in`, `h.{i}.mlp.fc_out`, `ln_f`) match the checkpoint's `local_transformer.*`
    keys, checked against vllm-omni `moss_tts/modeling_moss_tts_local_depth.py`. Positions
    restart at 0 every frame; K/V live only for the frame being decoded (no cross-frame
    state). Attention uses elementwise products and last-dim sums only, so a row's bits
    never depend on the batch (at most n_vq positions: the cost does not matter).

    Position 0's input is the backbone hidden state; position g >= 1's input is
    audio_embeddings[g-1](code of codebook g-1). The output at position g feeds
    audio_lm_heads[g] (and, at position 0, the binary continue/stop head).
    """

    def __init__(self, cfg: LocalTransformerConfig, bi: bool):
        super().__init__()
        self.h = nn.ModuleList(LocalBlock(cfg, bi) for _ in range(cfg.num_hidden_layers))
        self.ln_f = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)

    def new_cache(self) -> FrameCache:
        return [[] for _ in self.h]

    def step(self, x: torch.Tensor, position: int, cache: FrameCache, cos: torch.Tensor,
             sin: torch.Tensor) -> torch.Tensor:
        """Input x [B, hidden] at frame-local `position` -> ln_f output [B, hidden]."""
        c, s = cos[position][None, None, :], sin[position][None, None, :]
        for block, layer_cache in zip(self.h, cache):
            x = block.step(x, c, s, layer_cache)
        return self.ln_f(x)
