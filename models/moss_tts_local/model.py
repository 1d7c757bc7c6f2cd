"""MOSS-TTS Local modules (Qwen3 backbone, audio tables/heads, binary head, local transformer), upstream names."""

from __future__ import annotations

import torch
from torch import nn

from mtp_fsm.model_api import CodebookSampler
from models.qwen3_tts.layers import DecoderLayer, Linear, RMSNorm, run_over_slots

from .config import MossTTSLocalConfig
from .local import FrameCache, LocalTransformer

CONTINUE, STOP = 0, 1  # columns of the binary head's logits (upstream: choice 0 = continue)


class MossBackbone(nn.Module):
    """`transformer`: the Qwen3 decoder stack, final norm and text embeddings."""

    def __init__(self, cfg: MossTTSLocalConfig):
        super().__init__()
        bi = cfg.batch_invariant
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         cfg.intermediate_size, cfg.rms_norm_eps, bi)
            for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor, cache,
                cos_table: torch.Tensor, sin_table: torch.Tensor) -> torch.Tensor:
        """x [T, H] flat tokens -> final-normed hidden [T, H], writing each layer's paged KV
        (models.slot_cache.PagedKV; padding tokens touch no slot)."""
        return self.norm(run_over_slots(self.layers, x, positions, token_slots, cache, cos_table, sin_table))


class MossTTSLocalRoot(nn.Module):
    """Root whose state-dict keys are the checkpoint's.

    Keys match MOSS-TTS-Local-Transformer-v1.5 as vllm-omni
    `MossTTSLocalTalkerForGeneration.load_weights` maps it: `transformer.*` (Qwen3 backbone:
    `embed_tokens`, `layers.{i}.self_attn.{q,k,v,o}_proj`, `q_norm`, `k_norm`, `mlp.*`, norms),
    `audio_embeddings.{q}`, `audio_lm_heads.{q}`, `local_text_lm_head` and `local_transformer.*`.
    The checkpoint's `text_lm_head.weight` is never used at inference (the binary head decides
    the text channel) and is not built here; the loader skips it.
    """

    def __init__(self, cfg: MossTTSLocalConfig):
        super().__init__()
        bi = cfg.batch_invariant
        self.cfg = cfg
        self.transformer = MossBackbone(cfg)
        # The pad id (== audio_vocab_size) is outside these tables: it is masked to zero.
        self.audio_embeddings = nn.ModuleList(
            nn.Embedding(cfg.audio_vocab_size, cfg.hidden_size) for _ in range(cfg.n_vq)
        )
        self.audio_lm_heads = nn.ModuleList(
            Linear(cfg.hidden_size, cfg.audio_vocab_size, False, bi) for _ in range(cfg.n_vq)
        )
        self.local_text_lm_head = Linear(cfg.hidden_size, 2, False, bi)  # [continue, stop]
        self.local_transformer = LocalTransformer(cfg.local, bi)

    def audio_embed(self, codes: torch.Tensor) -> torch.Tensor:
        """sum_q audio_embeddings[q](codes[:, q]) for codes [N, n_vq], pad ids contributing
        zero, added in the fixed order q = 0..n_vq-1 (gathers + adds: batch-independent bits).
        Other out-of-table ids are clamped into range, as upstream `_audio_embed` does."""
        cfg = self.cfg
        codes = codes.long()
        valid = codes != cfg.audio_pad_token_id
        safe = codes.clamp(0, cfg.audio_vocab_size - 1)
        acc = None
        for q, table in enumerate(self.audio_embeddings):
            part = torch.where(valid[:, q, None], table(safe[:, q]), torch.zeros((), dtype=table.weight.dtype,
                                                                                  device=codes.device))
            acc = part if acc is None else acc + part
        return acc

    def local_start(self, hidden: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, FrameCache]:
        """Local position 0 from the backbone hidden [B, H]: (ln_f output [B, H], frame cache)."""
        cache = self.local_transformer.new_cache()
        return self.local_transformer.step(hidden, 0, cache, cos, sin), cache

    def generate_rest(self, cache: FrameCache, cb0: torch.Tensor, sample: CodebookSampler,
                      cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Codebooks 1..n_vq-1 of the frame, [B, n_vq-1]: position g reads the embedding of
        codebook g-1's code and samples codebook g from audio_lm_heads[g], in order."""
        vocab = self.cfg.audio_vocab_size
        out = []
        token = cb0
        for g in range(1, self.cfg.n_vq):
            # Out-of-range ids (garbage rows, a buggy sampler) must not index out of bounds.
            emb = self.audio_embeddings[g - 1](token.clamp(0, vocab - 1))
            local = self.local_transformer.step(emb, g, cache, cos, sin)
            token = sample(self.audio_lm_heads[g](local), g).long()
            out.append(token)
        return torch.stack(out, dim=1)
