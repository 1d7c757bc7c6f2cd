"""Qwen3TTSTalker: the mtp_fsm TalkerModel adapter (weights, slot KV cache, text step, MTP hook)."""

from __future__ import annotations

import torch

from models.module_init import materialize, seeded_normal_init
from models.slot_cache import PagedKVCache
from mtp_fsm import invariant
from mtp_fsm.model_api import CodebookSampler, ColumnSpec, ModelSpec, PreparedPrompt, TalkerModel

from .config import Qwen3TTSConfig
from .layers import Linear, RMSNorm, rope_tables
from .prompt import ByteTextTokenizer, PromptEmbedders, TextTokenizer, TTSInputs, build_prompt
from .talker import Qwen3TTSRoot

# Tiny-model "text exhausted" wiring (see _wire_demo_eos): the reserved residual channel,
# its value while the text step is tts_pad, and the EOS head weight reading it.
_FLAG_DIM = 0
_FLAG_VALUE = 1.0
_EOS_GAIN = 2.0


class Qwen3TTSTalker(PagedKVCache, TalkerModel):
    """Qwen3-TTS talker + code predictor driven by the lockstep engine.

    Every method except `prepare` is batched and free of host syncs. Parameters, the KV
    cache and all returned embeddings use `dtype`; norms, RoPE and softmax run in at
    least float32. `device="meta"` builds shapes only (parameter counts of real sizes).
    """

    def __init__(self, config: Qwen3TTSConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", tokenizer: TextTokenizer | None = None,
                 init_weights: bool = True):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.module = materialize(lambda: Qwen3TTSRoot(config), dtype, self.device)
        if init_weights and self.device.type != "meta":
            self._init_weights(seed)
        if tokenizer is None and config.text_tokenizer == "bytes":
            tokenizer = ByteTextTokenizer()
        self.tokenizer = tokenizer
        cp = config.code_predictor
        self._cos, self._sin = rope_tables(config.max_context, config.head_dim, config.rope_theta,
                                           dtype, self.device)
        self._cp_cos, self._cp_sin = rope_tables(cp.num_code_groups, cp.head_dim, cp.rope_theta,
                                                 dtype, self.device)
        self._cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        # Made once: building it per step would be a host-to-device copy (not graph-capturable).
        self._pad_ids = torch.tensor([config.tts_pad_token_id], dtype=torch.long, device=self.device)
        self._spec = ModelSpec(
            name="qwen3_tts", hidden_size=config.hidden_size, num_codebooks=config.num_code_groups,
            backbone_vocab_size=config.vocab_size, codebook_size=config.codebook_size,
            eos_token_id=config.codec_eos_token_id, max_context=config.max_context, dtype=dtype,
            # The official generate's defaults: repetition_penalty=1.05, min_new_tokens=2.
            repetition_penalty=1.05, min_frames=2,
        )

    @property
    def spec(self) -> ModelSpec:  # type: ignore[override]
        return self._spec

    @property
    def talker(self):
        return self.module.talker

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    # ---------------------------------------------------------------- weights

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        """Deterministic from the seed alone (models.module_init)."""
        seeded_normal_init(self.module, seed, self.config.init_std,
                           weights=(Linear, torch.nn.Embedding), norms=(RMSNorm,))
        if self.config.demo_eos_wiring:
            self._wire_demo_eos()

    @torch.no_grad()
    def _wire_demo_eos(self) -> None:
        """Tiny init only: make EOS follow the end of the text, like the trained model.

        With plain random weights EOS is one of ~2049 near-equal logits, so a request
        would run for thousands of frames. Here residual channel 0 is reserved as a
        "text exhausted" flag: no embedding and no layer output writes it, only the text
        projection of tts_pad (its text embedding is scaled up so ordinary text tokens
        project to ~0 there). codec_head's EOS row reads only that channel. While text
        remains, EOS is an ordinary-looking logit; once the text step becomes tts_pad,
        EOS dominates (greedy and sampled), so a request yields about len(text) + 1 frames.
        """
        t, cfg, d = self.talker, self.config, _FLAG_DIM
        t.model.codec_embedding.weight[:, d] = 0
        for emb in t.code_predictor.model.codec_embedding:
            emb.weight[:, d] = 0
        for layer in t.model.layers:
            layer.self_attn.o_proj.weight[d] = 0
            layer.mlp.down_proj.weight[d] = 0
        pad_row = t.model.text_embedding.weight[cfg.tts_pad_token_id]
        pad_row.mul_(300.0)
        act = invariant.silu(t.text_projection.linear_fc1(pad_row))
        t.text_projection.linear_fc2.weight[d] = act * (_FLAG_VALUE / invariant.tree_sum(act * act))
        t.text_projection.linear_fc2.bias[d] = 0
        t.codec_head.weight[cfg.codec_eos_token_id] = 0
        t.codec_head.weight[cfg.codec_eos_token_id, d] = _EOS_GAIN

    # ---------------------------------------------------------------- admission

    @torch.no_grad()
    def prepare(self, inputs: TTSInputs) -> PreparedPrompt:
        """Prompt embeddings [P, H] and the trailing text column [N, H] of one request, in the
        layout its TTSInputs select (see prompt.build_prompt). Host side, once per request."""
        if not isinstance(inputs, TTSInputs):
            raise ValueError(f"Qwen3-TTS takes TTSInputs, got {type(inputs).__name__}")
        embed = PromptEmbedders(text=self.talker.project_text, codec=self.talker.model.codec_embedding,
                                frames=self.frame_embed, dtype=self.dtype, device=self.device)
        prompt, trailing = build_prompt(self.config, inputs, self.tokenizer, embed)
        if trailing.shape[0] > self.config.max_trailing_text:
            raise ValueError(f"text too long: {trailing.shape[0]} trailing tokens > max_trailing_text "
                             f"{self.config.max_trailing_text}")
        if prompt.shape[0] >= self.config.max_context:
            raise ValueError(f"prompt of {prompt.shape[0]} positions (instruct and voice-clone reference "
                             f"included) leaves no room in max_context {self.config.max_context}")
        length = torch.tensor(trailing.shape[0], dtype=torch.int64, device=self.device)
        columns = {"trailing_text": trailing, "trailing_len": length}
        return PreparedPrompt(prompt_embeds=prompt, columns=columns)

    def slot_columns(self) -> dict[str, ColumnSpec]:
        return {
            "trailing_text": ColumnSpec((self.config.max_trailing_text, self.config.hidden_size), self.dtype),
            "trailing_len": ColumnSpec((), torch.int64),
        }

    # ---------------------------------------------------------------- per-slot state

    def _kv_layout(self) -> tuple[int, int, int, int]:
        cfg = self.config
        return cfg.num_hidden_layers, cfg.max_context, cfg.num_key_value_heads, cfg.head_dim

    # ---------------------------------------------------------------- step hooks

    def bind_slots(self, max_slots: int, device: torch.device,
                   columns: dict[str, torch.Tensor] | None = None) -> None:
        super().bind_slots(max_slots, device, columns)
        # A per-step constant: projecting it every text step read the whole text projection
        # (~25 MB at 0.6B fp32) for one row. The weights are final once an engine binds.
        self._tts_pad = None
        self._tts_pad = self.tts_pad_embed()

    @torch.no_grad()
    def tts_pad_embed(self) -> torch.Tensor:
        """T(tts_pad) [H]: the text step once a request's text has run out (cached at bind)."""
        cached = getattr(self, "_tts_pad", None)
        return cached if cached is not None else self.talker.project_text(self._pad_ids)[0]

    @torch.no_grad()
    def text_step(self, columns: dict[str, torch.Tensor], slots: torch.Tensor,
                  frame_index: torch.Tensor) -> torch.Tensor:
        """trailing_text[slot, f] while f < trailing_len[slot], else T(tts_pad). Padding rows
        (the scratch row, whose length is 0, or -1) get T(tts_pad)."""
        trailing, lengths = columns["trailing_text"], columns["trailing_len"]
        safe_slot = slots.clamp(min=0).long()
        frame = frame_index.long().expand_as(safe_slot)
        rows = trailing[safe_slot, frame.clamp(0, trailing.shape[1] - 1)]
        use = (slots >= 0) & (frame >= 0) & (frame < lengths[safe_slot])
        return torch.where(use[:, None], rows.to(self.dtype), self.tts_pad_embed()[None, :])

    @torch.no_grad()
    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                token_slots: torch.Tensor) -> torch.Tensor:
        return self.talker.model(inputs_embeds.to(self.dtype), positions.long(), token_slots.long(),
                                 self._require_cache(), self._cos, self._sin)

    @torch.no_grad()
    def cb0_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Raw codec_head logits over all 3072 ids; like upstream's `suppress_tokens`, the
        sampler must allow only [0, codebook_size) and EOS."""
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
        """codec_embedding(c0) + sum_g cp.codec_embedding[g-1](c_g), added in the fixed order
        g = 1..Q-1 (gathers + elementwise adds: the bits never depend on the batch)."""
        codes = codes.long().clamp(0, self.config.codebook_size - 1)
        acc = self.talker.model.codec_embedding(codes[:, 0])
        for g in range(1, self.config.num_code_groups):
            acc = acc + self.talker.code_predictor.model.codec_embedding[g - 1](codes[:, g])
        return acc
