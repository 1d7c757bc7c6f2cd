"""MiniCPM-4 stacks (upstream `MiniCPMModel`) over a per-slot KV cache or a whole short sequence."""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from models.qwen3_tts.layers import MLP, Attention, RMSNorm
from models.paged_kv import StepKV
from mtp_fsm import invariant

from .config import MiniCPM4Config


def longrope_tables(cfg: MiniCPM4Config, num_positions: int,
                    device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """Upstream `MiniCPMLongRoPE` cos/sin [num_positions, head_dim], float32, scaled by the LongRoPE
    attention factor; (None, None) when the model has no RoPE (the residual LM)."""
    dim = cfg.head_dim
    if cfg.no_rope:
        return None, None
    # Upstream's op order in float32; pow, cos and sin from mtp_fsm.invariant (the same bits on
    # every CPU kernel set, within an ulp of upstream's).
    inv_freq = 1.0 / invariant.pow_table(cfg.rope_theta, torch.arange(0, dim, 2).float() / dim)
    t = torch.arange(num_positions, dtype=torch.float32)
    ext = torch.tensor(cfg.rope_factors, dtype=torch.float32)
    freqs = torch.mul(torch.outer(t, 1.0 / ext), inv_freq)
    cos, sin = invariant.cos_sin(torch.cat((freqs, freqs), dim=-1))
    scale = cfg.rope_scaling_factor
    return (cos * scale).to(device), (sin * scale).to(device)


def _rope(x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
    """Rotate-half RoPE in float32 (upstream casts q and k up before rotating); x [..., heads, D]."""
    if cos is None:
        return x
    h = x.float()
    half = h.shape[-1] // 2
    rotated = torch.cat((-h[..., half:], h[..., :half]), dim=-1)
    return (h * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)).to(x.dtype)


class MiniCPMAttention(Attention):
    """GQA attention without biases or q/k norms. The cached, causal and masked attention
    (including the batch-invariant reductions) are the Qwen3 layer's; only the projections and
    the RoPE differ."""

    def __init__(self, cfg: MiniCPM4Config, bi: bool):
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         cfg.rms_norm_eps, bi)
        del self.q_norm, self.k_norm  # MiniCPM has none; keeps the state_dict upstream's

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None):
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, self.kv_heads, self.head_dim)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def forward_full(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                     causal: bool) -> torch.Tensor:
        """x [N, S, hidden], cos/sin [S, D]: attention within each row's S tokens."""
        q, k, v = self._qkv(x, cos, sin)
        idx = torch.arange(x.shape[-2], device=x.device)
        mask = idx[None, :] <= idx[:, None] if causal else torch.ones(len(idx), len(idx), dtype=torch.bool,
                                                                        device=x.device)
        return self._attend(q, k.unsqueeze(-4), v.unsqueeze(-4), mask)


class MiniCPMDecoderLayer(nn.Module):
    """Pre-norm block; with use_mup each branch is scaled by scale_depth / sqrt(num_layers)."""

    def __init__(self, cfg: MiniCPM4Config, bi: bool):
        super().__init__()
        self.self_attn = MiniCPMAttention(cfg, bi)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, bi)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.branch_scale = cfg.scale_depth / math.sqrt(cfg.num_hidden_layers) if cfg.use_mup else None

    def _add(self, x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        return x + branch if self.branch_scale is None else x + branch * self.branch_scale

    def forward(self, x: torch.Tensor, attend: Callable[[MiniCPMAttention, torch.Tensor], torch.Tensor]):
        x = self._add(x, attend(self.self_attn, self.input_layernorm(x)))
        return self._add(x, self.mlp(self.post_attention_layernorm(x)))


class MiniCPMModel(nn.Module):
    """`base_lm` / `residual_lm` / the local encoder's and DiT's `encoder` / `decoder`: layers and
    the final norm; `embed_tokens` only when vocab_size > 0 (upstream uses Identity otherwise)."""

    def __init__(self, cfg: MiniCPM4Config, bi: bool):
        super().__init__()
        if cfg.vocab_size > 0:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MiniCPMDecoderLayer(cfg, bi) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward_paged(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                      step: StepKV, cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Flat tokens x [T, H], cos/sin [T, D], over a paged KV (models.paged_kv): each layer
        writes its K/V where the step plan says, then attends to its slot's positions [0, pos]."""
        for layer, (cache_k, cache_v) in zip(self.layers, cache):
            def attend(attn: MiniCPMAttention, h: torch.Tensor, k=cache_k, v=cache_v) -> torch.Tensor:
                return attn.forward_paged(h, cos, sin, step, k, v)
            x = layer(x, attend)
        return self.norm(x)

    def forward_full(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                     causal: bool = False) -> torch.Tensor:
        """x [N, S, H] at positions 0..S-1 (cos/sin [S, D]), no cache."""
        for layer in self.layers:
            x = layer(x, lambda attn, h: attn.forward_full(h, cos, sin, causal))
        return self.norm(x)

