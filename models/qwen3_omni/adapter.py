"""Qwen3OmniTalker: the mtp_fsm TalkerModel adapter (MoE talker, KV cache, conditioning-feed text step, MTP hook)."""

from __future__ import annotations

import torch

from models.module_init import materialize, seeded_normal_init
from models.slot_cache import PagedKVCache
from mtp_fsm import invariant
from mtp_fsm.model_api import (
    FEED_COUNT,
    FEED_DONE,
    FEED_ROWS,
    CodebookSampler,
    ColumnSpec,
    ModelSpec,
    PreparedPrompt,
    TalkerModel,
)
from models.qwen3_tts.layers import Linear, RMSNorm, rope_tables

from .config import Qwen3OmniConfig
from .layers import TopKRouter
from .prompt import OmniInputs, build_prompt, stand_in_prompt_rows, thinker_embed
from .talker import Qwen3OmniRoot

# Tiny-model "feed finished" wiring (see _wire_demo_eos): the reserved residual channel, the
# value the projected tts_pad / tts_eos rows put there, and the EOS head weight reading it.
_FLAG_DIM = 0
_PAD_FLAG = 1.0
_EOS_FLAG = 0.3
_EOS_GAIN = 2.0
_SHARPNESS, _THRESHOLD = 30.0, 0.5  # detector units: silu(s * (x.r / r.r - t)) fires only for x ~ r


class Qwen3OmniTalker(PagedKVCache, TalkerModel):
    """Qwen3-Omni MoE talker + code predictor driven by the lockstep engine ("conditioned" variant).

    The text step reads the engine-owned feed columns (FEED_ROWS / FEED_COUNT / FEED_DONE):
    thinker rows arrive over time and are projected by text_projection here. The three
    thinker-side special rows (input embeddings of tts_bos, tts_eos, tts_pad) are held as
    `thinker_special_rows` [3, thinker_hidden]: from the stand-in thinker for the tiny
    config, from a checkpoint's `thinker.model.embed_tokens.weight`, or passed in.
    Every method except `prepare` is batched and free of host syncs. `device="meta"` builds
    shapes only (parameter counts of real sizes).
    """

    def __init__(self, config: Qwen3OmniConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", init_weights: bool = True,
                 thinker_special_rows: torch.Tensor | None = None):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.module = materialize(lambda: Qwen3OmniRoot(config), dtype, self.device)
        width = config.thinker_hidden_size
        self.thinker_special_rows = torch.zeros(3, width, dtype=dtype, device=self.device)
        if thinker_special_rows is not None:
            self.set_thinker_special_rows(thinker_special_rows)
        elif config.thinker_stand_in and self.device.type != "meta":
            self.set_thinker_special_rows(thinker_embed(
                [config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id], width))
        if init_weights and self.device.type != "meta":
            self._init_weights(seed)
        cp = config.code_predictor
        self._cos, self._sin = rope_tables(config.max_context, config.head_dim, config.rope_theta, dtype, self.device)
        self._cp_cos, self._cp_sin = rope_tables(cp.num_code_groups, cp.head_dim, cp.rope_theta, dtype, self.device)
        self._cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._spec = ModelSpec(
            name="qwen3_omni", hidden_size=config.hidden_size, num_codebooks=config.num_code_groups,
            backbone_vocab_size=config.vocab_size, codebook_size=config.codebook_size,
            eos_token_id=config.codec_eos_token_id, max_context=config.max_context, dtype=dtype,
            variant="conditioned", feed_capacity=config.feed_capacity, feed_width=width,
        )

    @property
    def spec(self) -> ModelSpec:  # type: ignore[override]
        return self._spec

    @property
    def talker(self):
        return self.module.talker

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    @torch.no_grad()
    def set_thinker_special_rows(self, rows: torch.Tensor) -> None:
        """Thinker input embeddings of (tts_bos, tts_eos, tts_pad): [3, thinker_hidden_size]."""
        if tuple(rows.shape) != (3, self.config.thinker_hidden_size):
            raise ValueError(f"thinker special rows must be [3, {self.config.thinker_hidden_size}], "
                             f"got {tuple(rows.shape)}")
        self.thinker_special_rows.copy_(rows.to(self.thinker_special_rows))
        self._specials = None
        if getattr(self, "_cache", None) is not None:
            self._specials = self.tts_specials()

    # ---------------------------------------------------------------- weights

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        """Deterministic from the seed alone (models.module_init)."""
        seeded_normal_init(self.module, seed, self.config.init_std,
                           weights=(Linear, torch.nn.Embedding, TopKRouter), norms=(RMSNorm,))
        if self.config.demo_eos_wiring:
            self._wire_demo_eos()

    @torch.no_grad()
    def _wire_demo_eos(self) -> None:
        """Tiny init only: make EOS follow the end of the feed, like the trained model.

        Residual channel 0 is reserved as a "feed finished" flag: no codec embedding, attention
        output, expert, shared expert or hidden_projection writes it. text_projection gets two
        detector units (its last two intermediate units) that fire only for rows close to the
        thinker's tts_pad / tts_eos rows and write _PAD_FLAG / _EOS_FLAG into channel 0; nothing
        else of text_projection reaches it. codec_head's EOS row reads only that channel. So
        while thinker rows are fed, EOS is an ordinary-looking logit; after tts_eos it is a coin flip,
        after tts_pad it dominates. (The prompt's tts_pad rows set it too, but no CB0 is sampled there.)
        """
        t, cfg, d = self.talker, self.config, _FLAG_DIM
        t.model.codec_embedding.weight[:, d] = 0
        for emb in t.code_predictor.model.codec_embedding:
            emb.weight[:, d] = 0
        for layer in t.model.layers:
            layer.self_attn.o_proj.weight[d] = 0
            for expert in layer.mlp.experts:
                expert.down_proj.weight[d] = 0
            layer.mlp.shared_expert.down_proj.weight[d] = 0
        t.hidden_projection.linear_fc2.weight[d] = 0
        t.hidden_projection.linear_fc2.bias[d] = 0
        fc1, fc2 = t.text_projection.linear_fc1, t.text_projection.linear_fc2
        fc2.weight[d] = 0
        fc2.bias[d] = 0
        special = self.thinker_special_rows.double()
        units = fc1.weight.shape[0]
        for unit, row, value in ((units - 1, special[2], _PAD_FLAG), (units - 2, special[1], _EOS_FLAG)):
            fc1.weight[unit] = (_SHARPNESS * row / invariant.tree_sum(row * row)).to(fc1.weight.dtype)
            fc1.bias[unit] = -_SHARPNESS * _THRESHOLD
            fire = invariant.silu(fc1(row.to(fc1.weight.dtype))[unit].double())
            fc2.weight[:, unit] = 0
            fc2.weight[d, unit] = (value / fire).to(fc2.weight.dtype)
        t.codec_head.weight[cfg.codec_eos_token_id] = 0
        t.codec_head.weight[cfg.codec_eos_token_id, d] = _EOS_GAIN

    # ---------------------------------------------------------------- admission

    def initial_feed(self, inputs: OmniInputs) -> tuple[torch.Tensor, bool]:
        """The conditioning rows known at admission (PreparedPrompt.feed): (rows [n, W], done).

        Text inputs (stand-in thinker): every byte after the first, and done. Row inputs:
        their feed_rows (or none) and feed_done.
        """
        width = self.config.thinker_hidden_size
        if inputs.text is not None:
            self._require_stand_in()
            return stand_in_prompt_rows(inputs.text, width)[1].to(self.dtype), True
        rows = inputs.feed_rows if inputs.feed_rows is not None else torch.zeros(0, width)
        return rows.to(self.dtype), bool(inputs.feed_done)

    def _require_stand_in(self) -> None:
        if not self.config.thinker_stand_in:
            raise ValueError("text inputs need the stand-in thinker (config.thinker_stand_in); "
                             "pass OmniInputs(prompt_rows=...) with the real thinker's rows")

    @torch.no_grad()
    def prepare(self, inputs: OmniInputs) -> PreparedPrompt:
        """Prompt embeddings [U + 9, H] (see prompt.py) and the conditioning rows known at
        admission (initial_feed); later rows arrive through engine.feed. Host side, once."""
        cfg = self.config
        if inputs.text is not None:
            self._require_stand_in()
            rows = stand_in_prompt_rows(inputs.text, cfg.thinker_hidden_size)[0]
        else:
            rows = inputs.prompt_rows
        speaker = cfg.speaker_id[cfg.default_speaker] if inputs.speaker_id is None else int(inputs.speaker_id)
        t = self.talker
        prompt = build_prompt(
            cfg, rows.to(device=self.device, dtype=self.dtype), speaker_id=speaker,
            user_hidden=inputs.user_hidden, user_mm_mask=inputs.user_mm_mask, specials=self.tts_specials(),
            text_projection=t.text_projection, hidden_projection=t.hidden_projection,
            codec_embed=t.model.codec_embedding,
        )
        if prompt.shape[0] >= cfg.max_context:
            raise ValueError(f"prompt of {prompt.shape[0]} positions leaves no room in max_context {cfg.max_context}")
        feed, done = self.initial_feed(inputs)
        return PreparedPrompt(prompt_embeds=prompt, columns={}, feed=feed, feed_done=done)

    def slot_columns(self) -> dict[str, ColumnSpec]:
        return {}  # the feed columns are engine-owned (mtp_fsm.model_api.feed_columns)

    # ---------------------------------------------------------------- per-slot state

    def _kv_layout(self) -> tuple[int, int, int, int]:
        cfg = self.config
        return cfg.num_hidden_layers, cfg.max_context, cfg.num_key_value_heads, cfg.head_dim

    # ---------------------------------------------------------------- step hooks

    def bind_slots(self, max_slots: int, device: torch.device,
                   columns: dict[str, torch.Tensor] | None = None) -> None:
        super().bind_slots(max_slots, device, columns)
        self._specials = None
        self._specials = self.tts_specials()

    @torch.no_grad()
    def tts_specials(self) -> torch.Tensor:
        """text_projection of the thinker's (tts_bos, tts_eos, tts_pad) rows: [3, H]. A per-step
        constant: projected once when an engine binds (the weights are final then) and again
        when the rows change (set_thinker_special_rows)."""
        cached = getattr(self, "_specials", None)
        return cached if cached is not None else self.talker.text_projection(self.thinker_special_rows)

    def tts_eos_embed(self) -> torch.Tensor:
        return self.tts_specials()[1]

    def tts_pad_embed(self) -> torch.Tensor:
        return self.tts_specials()[2]

    @torch.no_grad()
    def text_step(self, columns: dict[str, torch.Tensor], slots: torch.Tensor,
                  frame_index: torch.Tensor) -> torch.Tensor:
        """Per row: T(feed_rows[slot, f]) while f < feed_count; T(tts_eos) at f == feed_count once
        the feed is done; T(tts_pad) otherwise. Out-of-range slots (-1) read the scratch row."""
        rows, count, done = columns[FEED_ROWS], columns[FEED_COUNT], columns[FEED_DONE]
        scratch, capacity = rows.shape[0] - 1, rows.shape[1]
        slot = slots.long()
        slot = torch.where((slot >= 0) & (slot <= scratch), slot, torch.full_like(slot, scratch))
        frame = frame_index.long().expand_as(slot)
        fed_count = count[slot].clamp(0, capacity)
        fed = (frame >= 0) & (frame < fed_count)
        at_eos = (done[slot] != 0) & (frame == fed_count)
        projected = self.talker.text_projection(rows[slot, frame.clamp(0, capacity - 1)].to(self.dtype))
        specials = self.tts_specials()
        ending = torch.where(at_eos[:, None], specials[1], specials[2])
        return torch.where(fed[:, None], projected, ending)

    @torch.no_grad()
    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                token_slots: torch.Tensor) -> torch.Tensor:
        return self.talker.model(inputs_embeds.to(self.dtype), positions.long(), token_slots.long(),
                                 self._require_cache(), self._cos, self._sin)

    @torch.no_grad()
    def cb0_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Raw codec_head logits over all codec ids; like upstream's `suppress_tokens` (ids
        [vocab - 1024, vocab) except EOS), the engine allows only [0, codebook_size) and EOS."""
        return self.talker.codec_head(hidden)

    @torch.no_grad()
    def mtp(self, hidden: torch.Tensor, cb0: torch.Tensor, sample: CodebookSampler) -> torch.Tensor:
        cb0 = cb0.long()
        # Rows with CB0 = EOS or garbage are ignored by the engine but must stay in bounds.
        cb0_embed = self.talker.model.codec_embedding(cb0.clamp(0, self.config.codebook_size - 1))
        rest = self.talker.code_predictor.generate(hidden, cb0_embed, sample, self._cp_cos, self._cp_sin)
        return torch.cat([cb0[:, None], rest], dim=1)

    @torch.no_grad()
    def frame_embed(self, codes: torch.Tensor) -> torch.Tensor:
        """codec_embedding(c0) + sum_g code_predictor.codec_embedding[g-1](c_g), g = 1..Q-1 in order
        (upstream's `codec_hiddens.sum`); gathers + elementwise adds, so batch-independent bits."""
        codes = codes.long().clamp(0, self.config.codebook_size - 1)
        acc = self.talker.model.codec_embedding(codes[:, 0])
        for g in range(1, self.config.num_code_groups):
            acc = acc + self.talker.code_predictor.model.codec_embedding[g - 1](codes[:, g])
        return acc
