"""Higgs Audio v3 torch modules (Qwen3 body, text embedding, fused 8-codebook audio table) with upstream names.

State-dict keys are the HF checkpoint's own (`bosonai/higgs-audio-v3-tts-4b`), as vllm-omni's
`higgs_audio_v3_talker.py` maps them on load:

    tied.embedding.text_embedding.weight                  -> Qwen3 embed_tokens  [vocab, H]
    tied.embedding.modality_embeddings.0.embedding.weight -> fused audio table   [Q * V, H]
    body.layers.N.{self_attn,mlp,...}                     -> Qwen3 decoder layers (HF names)
    body.norm.weight                                      -> Qwen3 final norm

The audio head is tied to the audio table (upstream `tie_word_embeddings` of the audio
encoder config), so it is not a separate tensor. The checkpoint's other tensors, the text
head (`tied.head.text_head.*`), the tied audio head copy (`tied.head.modality_heads.0.*`)
and the bundled codec (`tied.embedding.modality_embeddings.0.model.*`), are not held.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.qwen3_tts.layers import DecoderLayer, RMSNorm, run_over_slots
from mtp_fsm import invariant

from .config import HiggsAudioV3Config


class AudioModality(nn.Module):
    """`tied.embedding.modality_embeddings.0`: the fused table, codebook q's ids at rows
    [q * V, (q + 1) * V)."""

    def __init__(self, num_codebooks: int, codebook_size: int, hidden: int):
        super().__init__()
        self.embedding = nn.Embedding(num_codebooks * codebook_size, hidden)


class TiedEmbedding(nn.Module):
    """`tied.embedding`: the text embedding and the audio modality's fused table."""

    def __init__(self, cfg: HiggsAudioV3Config):
        super().__init__()
        self.text_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.modality_embeddings = nn.ModuleList(
            [AudioModality(cfg.num_codebooks, cfg.codebook_size, cfg.hidden_size)])


class Tied(nn.Module):
    def __init__(self, cfg: HiggsAudioV3Config):
        super().__init__()
        self.embedding = TiedEmbedding(cfg)


class Body(nn.Module):
    """`body`: the Qwen3 decoder stack and final norm, run over the per-slot KV cache."""

    def __init__(self, cfg: HiggsAudioV3Config):
        super().__init__()
        self.layers = nn.ModuleList(
            DecoderLayer(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         cfg.intermediate_size, cfg.rms_norm_eps, cfg.batch_invariant)
            for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor,
                cache: list[tuple[torch.Tensor, torch.Tensor]], cos_table: torch.Tensor,
                sin_table: torch.Tensor) -> torch.Tensor:
        """x [T, H] flat tokens -> final-normed hidden [T, H], writing each layer's KV cache."""
        return self.norm(run_over_slots(self.layers, x, positions, token_slots, cache, cos_table, sin_table))


class HiggsAudioV3Root(nn.Module):
    """Root whose state-dict keys are the checkpoint's (`tied.*`, `body.*`); plus the two audio
    operations on the fused table: the summed frame embedding and the tied per-codebook head."""

    def __init__(self, cfg: HiggsAudioV3Config):
        super().__init__()
        self.cfg = cfg
        self.tied = Tied(cfg)
        self.body = Body(cfg)

    @property
    def text_embedding(self) -> nn.Embedding:
        return self.tied.embedding.text_embedding

    @property
    def audio_table(self) -> nn.Embedding:
        return self.tied.embedding.modality_embeddings[0].embedding

    def audio_embed(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, Q] (clamped into [0, V)) -> sum_q table[q * V + codes[:, q]] [B, H].

        Gathers and elementwise adds in the fixed order q = 0..Q-1 (upstream sums a gathered
        [B, Q, H] over Q, whose reduction order is the kernel's): a row's bits never depend
        on the batch.
        """
        size = self.cfg.codebook_size
        codes = codes.long().clamp(0, size - 1)
        table = self.audio_table.weight
        acc = F.embedding(codes[:, 0], table)
        for q in range(1, self.cfg.num_codebooks):
            acc = acc + F.embedding(codes[:, q] + q * size, table)
        return acc

    def audio_logits(self, hidden: torch.Tensor, num_codebooks: int | None = None) -> torch.Tensor:
        """The tied head over codebooks [0, num_codebooks) (default all): [B, n, V]."""
        n = self.cfg.num_codebooks if num_codebooks is None else num_codebooks
        size = self.cfg.codebook_size
        weight = self.audio_table.weight[: n * size]
        if self.cfg.batch_invariant:
            logits = invariant.linear(hidden, weight)  # mtp_fsm.invariant: a row's bits alone
        else:
            logits = F.linear(hidden, weight)
        return logits.view(hidden.shape[0], n, size)
