"""VoxCPM2 batched per-step math over per-slot KV caches: prompt, LM forward, stop head, CFM patch, next input."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.module_init import materialize, seeded_normal, seeded_normal_init
from models.qwen3_tts.layers import Linear, RMSNorm
from models.slot_cache import PagedKVCache
from mtp_fsm import invariant

from .config import AUDIO_START_TOKEN, BYTE_OFFSET, VoxCPM2Config
from .local import ScalarQuantizationLayer, UnifiedCFM, VoxCPMLocDiTV2, VoxCPMLocEnc
from .minicpm import MiniCPMModel, longrope_tables

STOP_TOKEN = 1  # the stop head's class 1; the engine's EOS id for "CB0"


class VoxCPM2Model(nn.Module):
    """The talker part of upstream `VoxCPM2Model` with its attribute names (the AudioVAE, a
    separate checkpoint file upstream, is not part of it)."""

    def __init__(self, cfg: VoxCPM2Config):
        super().__init__()
        bi, hidden = cfg.batch_invariant, cfg.hidden_size
        enc, dit = cfg.encoder_config.hidden_dim, cfg.dit_config.hidden_dim
        self.base_lm = MiniCPMModel(cfg.lm_config, bi)
        self.residual_lm = MiniCPMModel(cfg.residual_lm, bi)
        self.feat_encoder = VoxCPMLocEnc(cfg.encoder_lm, cfg.feat_dim, bi)
        self.feat_decoder = UnifiedCFM(VoxCPMLocDiTV2(cfg.dit_lm, cfg.feat_dim, bi), cfg.dit_config.dit_mean_mode)
        self.fsq_layer = ScalarQuantizationLayer(hidden, cfg.scalar_quantization_latent_dim,
                                                 cfg.scalar_quantization_scale, bi)
        self.enc_to_lm_proj = Linear(enc, hidden, True, bi)
        self.lm_to_dit_proj = Linear(hidden, dit, True, bi)
        self.res_to_dit_proj = Linear(hidden, dit, True, bi)
        self.fusion_concat_proj = Linear(2 * hidden, hidden, True, bi)
        self.stop_proj = Linear(hidden, hidden, True, bi)
        self.stop_head = Linear(hidden, 2, False, bi)


def byte_tokenize(text: str) -> list[int]:
    """The tiny model's text ids: one per UTF-8 byte, then upstream's audio-start token."""
    return [BYTE_OFFSET + b for b in text.encode("utf-8")] + [AUDIO_START_TOKEN]


class VoxCPM2Core(PagedKVCache):
    """The whole model as batched, host-sync-free per-step functions for an engine adapter.

    One decode step of a request, in upstream `_inference` order: `forward` of its next input
    gives `hidden` = [lm_hidden | residual_hidden]; `stop_logits(hidden)` and
    `patch(hidden, prefix, noise)` both read that same hidden; the patch is emitted (also on
    the step whose stop fires) and `next_embed(patch)` is the next input. The base and residual
    LM caches are one PagedKVCache: layers [0, L_base) base, [L_base, L_base + L_res) residual
    (the residual LM copies the base config, so KV heads and head_dim agree).
    """

    def __init__(self, config: VoxCPM2Config, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", init_weights: bool = True):
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.module = materialize(lambda: VoxCPM2Model(config), dtype, self.device)
        if init_weights and self.device.type != "meta":
            self._init_weights(seed)
        self._cache = None
        self._lm_rope = longrope_tables(config.lm_config, config.max_context, self.device)
        self._res_rope = longrope_tables(config.residual_lm, config.max_context, self.device)
        local = 2 * config.patch_size + 3  # the DiT sequence: 2 mu + t + prefix patch + patch
        self._enc_rope = longrope_tables(config.encoder_lm, config.patch_size + 1, self.device)
        self._dit_rope = longrope_tables(config.dit_lm, local, self.device)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        seeded_normal_init(self.module, seed, self.config.init_std, weights=(nn.Linear, nn.Embedding),
                           norms=(RMSNorm,))
        gen = torch.Generator().manual_seed(seed + 1)
        token = self.module.feat_encoder.special_token
        token.copy_(seeded_normal(token.shape, gen))

    def _kv_layout(self) -> tuple[int, int, int, int]:
        lm = self.config.lm_config
        layers = lm.num_hidden_layers + self.config.residual_lm_num_layers
        return layers, self.config.max_context, lm.num_key_value_heads, lm.head_dim

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    # ---- prompt ----

    def tokenize(self, text: str) -> list[int]:
        if self.config.text_tokenizer != "bytes":
            raise ValueError("the released model takes ids from its LlamaTokenizerFast (not built in)")
        return byte_tokenize(text)

    @torch.no_grad()
    def prompt_embeds(self, text_ids: torch.Tensor) -> torch.Tensor:
        """Text ids [P] -> base LM input rows [P, H] (is_audio False in `forward`)."""
        lm = self.config.lm_config
        scale = lm.scale_emb if lm.use_mup else 1.0  # upstream multiplies even by 1.0
        return self.module.base_lm.embed_tokens(text_ids.to(self.device).long()) * scale

    # ---- per-step math ----

    @torch.no_grad()
    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor,
                is_audio: torch.Tensor) -> torch.Tensor:
        """Flat tokens of many requests -> hidden [T, 2H] = [lm_hidden | residual_hidden].

        is_audio [T] bool marks audio rows (every decode step; prompt patches of a voice
        continuation): their base LM output goes through the FSQ bottleneck and their input
        embedding (= the patch embedding) joins the residual LM input; text rows pass the raw
        LM output and zeros. Padding tokens (slot -1) touch no slot's KV.
        """
        cache = self._require_cache()
        split = self.config.lm_config.num_hidden_layers
        step = cache.plan(positions, token_slots)  # one plan: both LMs write the same (slot, position)s
        pos = step.token_pos
        m, audio = self.module, is_audio.bool()[:, None]

        def table(rope):
            return (None, None) if rope[0] is None else (rope[0][pos], rope[1][pos])

        x = inputs_embeds.to(self.dtype)
        h = m.base_lm.forward_paged(x, *table(self._lm_rope), step, cache[:split].layers())
        h = torch.where(audio, m.fsq_layer(h), h)
        res_in = m.fusion_concat_proj(torch.cat((h, torch.where(audio, x, torch.zeros_like(x))), dim=-1))
        r = m.residual_lm.forward_paged(res_in, *table(self._res_rope), step, cache[split:].layers())
        return torch.cat((h, r), dim=-1)

    @torch.no_grad()
    def stop_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, 2H] -> [B, 2]: stop_head(silu(stop_proj(lm_hidden)))."""
        m = self.module
        act = invariant.silu if self.config.batch_invariant else F.silu
        return m.stop_head(act(m.stop_proj(hidden[:, :self.config.hidden_size])))

    def stop_mask(self, stop_logits: torch.Tensor, decode_step: torch.Tensor) -> torch.Tensor:
        """Upstream's stop rule, on device: argmax == 1 (ties pick 0) and decode_step > min_len,
        where decode_step is the 0-based index of the patch just produced."""
        return (stop_logits[:, 1] > stop_logits[:, 0]) & (decode_step > self.config.min_len)

    @torch.no_grad()
    def patch(self, hidden: torch.Tensor, prefix_patch: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """CFM solve with CFG: hidden [B, 2H], previous patch [B, P, D] (zeros before the first
        patch of a text-only prompt), initial noise [B, P, D] -> patch [B, P, D]."""
        cfg, m, hsz = self.config, self.module, self.config.hidden_size
        mu = torch.cat((m.lm_to_dit_proj(hidden[:, :hsz]), m.res_to_dit_proj(hidden[:, hsz:])), dim=-1)
        return m.feat_decoder(mu, prefix_patch.to(self.dtype), noise.to(self.dtype), cfg.inference_timesteps,
                              cfg.cfg_value, cfg.sway_sampling_coef, cfg.use_cfg_zero_star, *self._dit_rope)

    @torch.no_grad()
    def next_embed(self, patch: torch.Tensor) -> torch.Tensor:
        """patch [B, P, D] -> next base LM input [B, H] = enc_to_lm_proj(feat_encoder(patch))."""
        m = self.module
        return m.enc_to_lm_proj(m.feat_encoder(patch.to(self.dtype).unsqueeze(1), *self._enc_rope))[:, 0]
