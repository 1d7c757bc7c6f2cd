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
from mtp_fsm import invariant

from .layers import DecoderLayer, Linear, RMSNorm, fast_norms, run_over_slots


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
        return self.norm(run_over_slots(self.layers, x, positions, token_slots, cache, cos_table, sin_table))


class ResizeMLP(nn.Module):
    """Upstream `Qwen3TTSTalkerResizeMLP`: text_hidden -> text_hidden -> talker hidden, with bias."""

    def __init__(self, d_in: int, d_mid: int, d_out: int, bi: bool):
        super().__init__()
        self.linear_fc1 = Linear(d_in, d_mid, True, bi)
        self.linear_fc2 = Linear(d_mid, d_out, True, bi)
        self.act = invariant.silu if bi else F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


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
        # Static depth-loop KV per batch size (frame_cache); not parameters, not in the state dict.
        self._frame_caches: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def frame_cache(self, batch: int, positions: int, dtype: torch.dtype,
                    device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (k, v) [batch, positions, KV, D] for one frame's depth loop, made once per
        (batch, positions, dtype, device) and reused by every frame: no allocation per step (a
        CUDA graph replays the same buffers). Every frame writes a position before reading it,
        so what the previous frame left there is never seen."""
        key = (batch, positions, dtype, device)
        cached = self._frame_caches.get(key)
        if cached is None:
            attn = self.layers[0].self_attn
            shape = (batch, positions, attn.kv_heads, attn.head_dim)
            cached = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                      for _ in self.layers]
            self._frame_caches[key] = cached
        return cached

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None, start: int = 0) -> torch.Tensor:
        """x [B, S, H_cp] at positions start..start+S-1 -> normed hidden [B, S, H_cp], causal.

        cos/sin are the S rows of those positions. Without `cache` the S tokens are the
        whole sequence (start must be 0); with it they extend the rows' cached prefix.
        """
        for i, layer in enumerate(self.layers):
            if cache is None:
                x = layer(x, lambda attn, h: attn.forward_causal(h, cos, sin))
            else:
                k, v = cache[i]
                x = layer(x, lambda attn, h, k=k, v=v: attn.forward_window(h, cos, sin, start, k, v))
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
        """Depth loop with a per-frame KV cache: returns codes of codebooks 1..Q-1, [B, Q-1].

        The sequence is [proj(hidden), proj(e(cb0)), proj(e(cb1)), ...] at positions 0, 1, 2, ...;
        codebook g is sampled from lm_head[g-1] at position g. Positions 0 and 1 are prefilled
        together, then each sampled code is fed as one new position (Q - 2 single steps).
        """
        groups, vocab = self.cfg.num_code_groups, self.cfg.vocab_size
        x = self.small_to_mtp_projection(torch.stack([talker_hidden, cb0_embed], dim=1))  # [B, 2, H_cp]
        # Positions 0..Q-1: the last code is sampled, never fed back.
        cache = self.model.frame_cache(x.shape[0], groups, x.dtype, x.device)
        h = self.model(x, cos[:2], sin[:2], cache, start=0)[:, 1]
        out = []
        for g in range(1, groups):
            token = sample(self.lm_head[g - 1](h), g).long()
            out.append(token)
            if g < groups - 1:
                # Out-of-range samples (a buggy sampler) must not index out of bounds.
                emb = self.model.codec_embedding[g - 1](token.clamp(0, vocab - 1))
                x = self.small_to_mtp_projection(emb)[:, None]
                h = self.model(x, cos[g + 1:g + 2], sin[g + 1:g + 2], cache, start=g + 1)[:, 0]
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
        if not bi:
            fast_norms(self)

    def project_text(self, ids: torch.Tensor) -> torch.Tensor:
        return self.text_projection(self.model.text_embedding(ids))


class Qwen3TTSRoot(nn.Module):
    """Root so state-dict keys carry upstream's `talker.` prefix (speaker encoder not included)."""

    def __init__(self, cfg: Qwen3TTSConfig):
        super().__init__()
        self.talker = Qwen3TTSTalkerForGeneration(cfg)
