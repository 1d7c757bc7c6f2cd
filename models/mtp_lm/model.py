"""MTP LM torch modules: a Qwen3 decoder stack over the slot KV cache plus one DeepSeek-V3 MTP layer, HF names.

State-dict keys (HF Qwen3 names; the MTP layer as DeepSeek-V3's checkpoint lays it out and
vLLM's `deepseek_mtp.py` loads it, N = num_hidden_layers):

    model.embed_tokens.weight                       [V, H]   shared by the MTP layer
    model.layers.{0..N-1}.{self_attn,mlp,input_layernorm,post_attention_layernorm}.*
    model.norm.weight
    lm_head.weight                                  [V, H]   also the MTP head (shared_head.head)
    model.layers.N.enorm.weight                     RMSNorm of the next token's embedding
    model.layers.N.hnorm.weight                     RMSNorm of the previous hidden state
    model.layers.N.eh_proj.weight                   [H, 2H]  over cat([enorm(emb), hnorm(h)])
    model.layers.N.{self_attn,mlp,input_layernorm,post_attention_layernorm}.*   its decoder layer
    model.layers.N.shared_head.norm.weight          the MTP's final norm

DeepSeek-V3's file also holds `model.layers.N.shared_head.head.weight` and
`model.layers.N.embed_tokens.weight`, copies of lm_head and embed_tokens; they are tied here
(one tensor each), and checkpoint.py writes and checks the copies.
"""

from __future__ import annotations

import torch
from torch import nn

from models.qwen3_tts.layers import DecoderLayer, Linear, RMSNorm, run_over_slots

from .config import MtpLMConfig

Cache = list[tuple[torch.Tensor, torch.Tensor]]


def _decoder_layer(cfg: MtpLMConfig) -> DecoderLayer:
    return DecoderLayer(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                        cfg.intermediate_size, cfg.rms_norm_eps, cfg.batch_invariant)


class SharedHead(nn.Module):
    """`shared_head`: its norm only; the head is lm_head (DeepSeek-V3 shares the output head)."""

    def __init__(self, cfg: MtpLMConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MtpLayer(DecoderLayer):
    """`model.layers.N`: the decoder layer's own names plus enorm / hnorm / eh_proj / shared_head."""

    def __init__(self, cfg: MtpLMConfig):
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         cfg.intermediate_size, cfg.rms_norm_eps, cfg.batch_invariant)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, False, cfg.batch_invariant)
        self.shared_head = SharedHead(cfg)


class Qwen3Model(nn.Module):
    """`model`: embed_tokens, N backbone layers then the MTP layer (one ModuleList, so the
    MTP's keys are `model.layers.N.*`), final norm."""

    def __init__(self, cfg: MtpLMConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([*(_decoder_layer(cfg) for _ in range(cfg.num_hidden_layers)), MtpLayer(cfg)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MtpLMRoot(nn.Module):
    """Root whose state-dict keys are the checkpoint's (`model.*`, `lm_head.*`)."""

    def __init__(self, cfg: MtpLMConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Qwen3Model(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, cfg.batch_invariant)

    @property
    def mtp_layer(self) -> MtpLayer:
        return self.model.layers[self.cfg.num_hidden_layers]

    def backbone(self, x: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor, cache: Cache,
                 cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> final-normed hidden [T, H] (what HF's Qwen3Model returns), writing cache[:N]."""
        n = self.cfg.num_hidden_layers
        return self.model.norm(run_over_slots(self.model.layers[:n], x, positions, token_slots, cache[:n], cos, sin))

    def mtp(self, prev_hidden: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor,
            token_slots: torch.Tensor, cache: Cache, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """vLLM DeepSeekMultiTokenPredictorLayer.forward over the MTP's slot KV (cache[N]):
        zero the embedding where position == 0, cat([enorm(emb), hnorm(h)]) -> eh_proj ->
        decoder layer -> shared_head.norm. Returns the normed hidden (vLLM returns it as the
        second output, the one recycled into the next draft step; its logits are
        head(shared_head.norm(pre-norm)), i.e. lm_head of what this returns)."""
        layer = self.mtp_layer
        # vLLM: "masking inputs at position 0, as not needed by MTP".
        emb = torch.where(positions[:, None] == 0, torch.zeros((), dtype=next_embeds.dtype,
                                                                device=next_embeds.device), next_embeds)
        x = layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(prev_hidden)], dim=-1))
        x = run_over_slots([layer], x, positions, token_slots, cache[self.cfg.num_hidden_layers:], cos, sin)
        return layer.shared_head.norm(x)
