"""Qwen3-TTS modules (talker backbone, text projection, code predictor) with upstream parameter names.

State-dict keys match the HF checkpoints of `Qwen3TTSForConditionalGeneration`
(`talker.model.*`, `talker.text_projection.*`, `talker.codec_head.*`,
`talker.code_predictor.{model,lm_head,small_to_mtp_projection}.*`), checked against
QwenLM/Qwen3-TTS `qwen_tts/core/models/modeling_qwen3_tts.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtp_fsm.model_api import CodebookSampler

from .config import CodePredictorConfig, Qwen3TTSConfig
from .layers import Attention, DecoderLayer, Linear, RMSNorm


class Qwen3TTSTalkerModel(nn.Module):
    """The talker backbone (`talker.model`): decoder stack + final norm + input embeddings."""

    def __init__(self, cfg: Qwen3TTSConfig):
        super().__init__()
        bi = cfg.batch_invariant
        self.layers = nn.ModuleList(
            DecoderLayer(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         cfg.intermediate_size, cfg.rms_norm_eps, bi)
            for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor,
                cache: list[tuple[torch.Tensor, torch.Tensor]], cos_table: torch.Tensor,
                sin_table: torch.Tensor) -> torch.Tensor:
        """x [T, H] flat tokens -> final-normed hidden [T, H], writing each layer's KV cache."""
        rows, context = cache[0][0].shape[:2]
        # Padding tokens (slot -1) write and read the scratch row rows-1, never a real slot.
        write_slot = torch.where(token_slots >= 0, token_slots, torch.full_like(token_slots, rows - 1))
        # Padding tokens may carry any position; clamping keeps the gathers in bounds.
        pos = positions.clamp(0, context - 1)
        cos, sin = cos_table[pos], sin_table[pos]
        mask = torch.arange(context, device=x.device)[None, :] <= pos[:, None]  # [T, C]
        for layer, (cache_k, cache_v) in zip(self.layers, cache):
            def attend(attn: Attention, h: torch.Tensor, k=cache_k, v=cache_v) -> torch.Tensor:
                return attn.forward_cached(h, cos, sin, write_slot, pos, mask, k, v)
            x = layer(x, attend)
        return self.norm(x)


class ResizeMLP(nn.Module):
    """Upstream `Qwen3TTSTalkerResizeMLP`: text_hidden -> text_hidden -> talker hidden, with bias."""

    def __init__(self, d_in: int, d_mid: int, d_out: int, bi: bool):
        super().__init__()
        self.linear_fc1 = Linear(d_in, d_mid, True, bi)
        self.linear_fc2 = Linear(d_mid, d_out, True, bi)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class CodePredictorModel(nn.Module):
    """`talker.code_predictor.model`: decoder stack + norm + embeddings of codebooks 1..Q-1.

    The residual-codebook embeddings live in the *talker* hidden size (upstream passes
    `embedding_dim=talker_config.hidden_size`); they are projected like every other input.
    """

    def __init__(self, cfg: CodePredictorConfig, talker_hidden: int, bi: bool):
        super().__init__()
        self.layers = nn.ModuleList(
            DecoderLayer(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         cfg.intermediate_size, cfg.rms_norm_eps, bi)
            for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cfg.vocab_size, talker_hidden) for _ in range(cfg.num_code_groups - 1)
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, S, H_cp] -> normed hidden [B, S, H_cp], causal, positions 0..S-1."""
        for layer in self.layers:
            x = layer(x, lambda attn, h: attn.forward_causal(h, cos, sin))
        return self.norm(x)


class CodePredictor(nn.Module):
    """`talker.code_predictor`: predicts codebooks 1..Q-1 of a frame from (talker hidden, CB0)."""

    def __init__(self, cfg: CodePredictorConfig, talker_hidden: int, bi: bool):
        super().__init__()
        self.cfg = cfg
        self.model = CodePredictorModel(cfg, talker_hidden, bi)
        self.lm_head = nn.ModuleList(
            Linear(cfg.hidden_size, cfg.vocab_size, False, bi) for _ in range(cfg.num_code_groups - 1)
        )
        # Upstream uses Identity (no weights) when the sizes match, as in the 0.6B.
        self.small_to_mtp_projection: nn.Module = (
            Linear(talker_hidden, cfg.hidden_size, True, bi) if talker_hidden != cfg.hidden_size
            else nn.Identity()
        )

    def generate(self, talker_hidden: torch.Tensor, cb0_embed: torch.Tensor, sample: CodebookSampler,
                 cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Re-prefill depth loop without KV: returns codes of codebooks 1..Q-1, [B, Q-1].

        Step g (1..Q-1) runs the stack over [proj(hidden), proj(e(cb0)), ..., proj(e(cb_{g-1}))]
        and samples codebook g from lm_head[g-1] at position g.
        """
        vocab = self.cfg.vocab_size
        seq = [self.small_to_mtp_projection(talker_hidden), self.small_to_mtp_projection(cb0_embed)]
        out = []
        for g in range(1, self.cfg.num_code_groups):
            h = self.model(torch.stack(seq, dim=1), cos[: g + 1], sin[: g + 1])
            token = sample(self.lm_head[g - 1](h[:, g]), g).long()
            out.append(token)
            if g < self.cfg.num_code_groups - 1:
                # Out-of-range samples (a buggy sampler) must not index out of bounds.
                emb = self.model.codec_embedding[g - 1](token.clamp(0, vocab - 1))
                seq.append(self.small_to_mtp_projection(emb))
        return torch.stack(out, dim=1)


class Qwen3TTSTalkerForGeneration(nn.Module):
    """`talker`: backbone, text projection, CB0 head (`codec_head`) and the code predictor."""

    def __init__(self, cfg: Qwen3TTSConfig):
        super().__init__()
        bi = cfg.batch_invariant
        self.model = Qwen3TTSTalkerModel(cfg)
        self.text_projection = ResizeMLP(cfg.text_hidden_size, cfg.text_hidden_size, cfg.hidden_size, bi)
        self.codec_head = Linear(cfg.hidden_size, cfg.vocab_size, False, bi)
        self.code_predictor = CodePredictor(cfg.code_predictor, cfg.hidden_size, bi)

    def project_text(self, ids: torch.Tensor) -> torch.Tensor:
        return self.text_projection(self.model.text_embedding(ids))


class Qwen3TTSRoot(nn.Module):
    """Root so state-dict keys carry upstream's `talker.` prefix (speaker encoder not included)."""

    def __init__(self, cfg: Qwen3TTSConfig):
        super().__init__()
        self.talker = Qwen3TTSTalkerForGeneration(cfg)
