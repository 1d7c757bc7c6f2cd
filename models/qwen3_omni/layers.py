"""The talker's sparse MoE block (softmax top-k router, experts, sigmoid-gated shared expert) and decoder layer."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.qwen3_tts.layers import MLP, Attention, Linear, RMSNorm, compute_dtype
from mtp_fsm import invariant


class TopKRouter(nn.Module):
    """Upstream `Qwen3OmniMoeTalkerTextTopKRouter` (`mlp.gate.weight` [E, H]): softmax over all
    experts in float32 (or wider), keep the top k, renormalise them when norm_topk_prob."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool, bi: bool):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.bi = bi
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (router logits [T, E], top-k weights [T, k] in x.dtype, top-k expert ids [T, k])."""
        # The batch-invariant form reduces every row the same way (mtp_fsm.invariant).
        logits = invariant.linear(x, self.weight) if self.bi else F.linear(x, self.weight)
        softmax = invariant.softmax if self.bi else torch.softmax
        probs = softmax(logits.to(compute_dtype(logits.dtype)), dim=-1)
        top_w, top_idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / (invariant.tree_sum(top_w, -1, keepdim=True) if self.bi else top_w.sum(dim=-1, keepdim=True))
        return logits, top_w.to(x.dtype), top_idx


class SparseMoeBlock(nn.Module):
    """Upstream `Qwen3OmniMoeTalkerTextSparseMoeBlock`: sum_k w_k * expert_k(x) + sigmoid(g . x) * shared(x).

    Experts are kept one module each (`experts.{e}.{gate,up,down}_proj`, the released
    checkpoints' layout) and evaluated densely in expert order with a per-row mask: no
    data-dependent shapes (graph-capturable, no host sync), and a row's result depends
    only on that row. Unselected experts contribute an exact 0 (torch.where, not 0 * y).
    It costs all E experts per token (E / k times the routed work): right for the tiny
    model and for checking; real-size serving wants a grouped-GEMM kernel here.
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, moe_intermediate: int,
                 shared_intermediate: int, norm_topk_prob: bool, bi: bool):
        super().__init__()
        self.num_experts = num_experts
        self.gate = TopKRouter(hidden, num_experts, top_k, norm_topk_prob, bi)
        self.experts = nn.ModuleList(MLP(hidden, moe_intermediate, bi) for _ in range(num_experts))
        self.shared_expert = MLP(hidden, shared_intermediate, bi)
        self.shared_expert_gate = Linear(hidden, 1, False, bi)
        self.bi = bi

    def routing(self, x: torch.Tensor) -> torch.Tensor:
        """Dense routing weights [T, E]: the renormalised top-k probabilities, 0 elsewhere."""
        _, top_w, top_idx = self.gate(x)
        dense = torch.zeros(*x.shape[:-1], self.num_experts, dtype=top_w.dtype, device=x.device)
        return dense.scatter(-1, top_idx, top_w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        _, top_w, top_idx = self.gate(flat)
        out = torch.zeros_like(flat)
        zero = torch.zeros((), dtype=flat.dtype, device=flat.device)
        for e, expert in enumerate(self.experts):
            hit = top_idx == e  # [T, k]; at most one True per row
            weight = (top_w * hit).sum(-1, keepdim=True)
            out = out + torch.where(hit.any(-1, keepdim=True), expert(flat) * weight, zero)
        if self.bi:  # torch.sigmoid's SIMD body and scalar tail round differently (mtp_fsm.invariant)
            gate = invariant.sigmoid(self.shared_expert_gate(flat))
        else:
            gate = torch.sigmoid(self.shared_expert_gate(flat).expand_as(flat).contiguous())
        shared = gate * self.shared_expert(flat)
        return (out + shared).reshape(*lead, x.shape[-1])


class MoeDecoderLayer(nn.Module):
    """Upstream `Qwen3OmniMoeTalkerDecoderLayer`: pre-norm Qwen3 attention, then the sparse MoE block
    (every talker layer is sparse upstream). Called as `layer(x, attend)` like the Qwen3-TTS layer."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, num_experts: int,
                 top_k: int, moe_intermediate: int, shared_intermediate: int, norm_topk_prob: bool, bi: bool):
        super().__init__()
        self.self_attn = Attention(hidden, heads, kv_heads, head_dim, eps, bi)
        self.mlp = SparseMoeBlock(hidden, num_experts, top_k, moe_intermediate, shared_intermediate,
                                  norm_topk_prob, bi)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, attend: Callable[[Attention, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        x = x + attend(self.self_attn, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))
