"""ChatterboxTalker: Chatterbox Turbo T3 as an mtp_fsm TalkerModel (single codebook, no MTP, slot KV cache)."""

from __future__ import annotations

import torch

from models.module_init import materialize, seeded_normal_init
from models.slot_cache import SlotKVCache
from mtp_fsm.model_api import ModelSpec, PreparedPrompt, TalkerModel
from mtp_fsm.sampling.penalties import PENALTY_AFTER_FILTERS

from .config import ChatterboxConfig
from .gpt2 import Conv1D, LayerNorm, Linear
from .prompt import ByteTextTokenizer, ChatterboxInputs, TextTokenizer, build_prompt
from .t3 import T3Turbo


class ChatterboxTalker(SlotKVCache, TalkerModel):
    """T3 Turbo driven by the lockstep engine under the `single_codebook` lifecycle.

    One speech token per frame: CB0 is the whole frame, the stop token is the engine's
    EOS, and start-of-speech is masked (-inf) in the head. CB0 sampling follows upstream's
    `inference_turbo`: repetition penalty 1.2 by default, after temperature / top-k / top-p
    (ModelSpec.repetition_penalty_order). Every method except `prepare`
    is batched and free of host syncs. `device="meta"` builds shapes only.
    """

    def __init__(self, config: ChatterboxConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", tokenizer: TextTokenizer | None = None,
                 init_weights: bool = True):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.module = materialize(lambda: T3Turbo(config), dtype, self.device)
        if init_weights and self.device.type != "meta":
            self._init_weights(seed)
        if tokenizer is None and config.text_tokenizer == "bytes":
            tokenizer = ByteTextTokenizer()
        self.tokenizer = tokenizer
        self._cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        # Made once: building it per step would be a host-to-device copy (not graph-capturable).
        self._start_id = torch.tensor([config.start_speech_token], dtype=torch.long, device=self.device)
        self._spec = ModelSpec(
            name="chatterbox_turbo", hidden_size=config.hidden_size, num_codebooks=1,
            backbone_vocab_size=config.speech_tokens_dict_size, codebook_size=config.codebook_size,
            eos_token_id=config.stop_speech_token, max_context=config.max_context, dtype=dtype,
            # chatterbox-tts 0.1.7 (tts_turbo.generate, T3.inference_turbo): penalty 1.2, applied
            # after temperature, top-k and top-p, on the scores they kept.
            repetition_penalty=1.2, repetition_penalty_order=PENALTY_AFTER_FILTERS,
        )

    @property
    def spec(self) -> ModelSpec:  # type: ignore[override]
        return self._spec

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    # ---------------------------------------------------------------- weights

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        """GPT-2 style init, deterministic from the seed alone (models.module_init)."""
        seeded_normal_init(self.module, seed, self.config.init_std,
                           weights=(Conv1D, Linear, torch.nn.Embedding), norms=(LayerNorm,))

    # ---------------------------------------------------------------- admission

    @torch.no_grad()
    def prepare(self, inputs: ChatterboxInputs) -> PreparedPrompt:
        """Prompt embeddings [P, H] = [speaker | conditioning tokens | text | start-of-speech].
        No slot columns: Chatterbox has no per-frame text conditioning. Host side, once."""
        if inputs.text_ids is not None:
            ids = list(inputs.text_ids)
        elif self.tokenizer is not None:
            ids = self.tokenizer.encode(inputs.text or "")
        else:
            raise ValueError("this config has no built-in tokenizer: pass ChatterboxInputs(text_ids=...) "
                             "(GPT-2 tokenizer ids) or construct the model with tokenizer=")
        prompt = build_prompt(self.config, self.module, inputs, ids, dtype=self.dtype, device=self.device)
        if prompt.shape[0] >= self.config.max_context:
            raise ValueError(f"prompt of {prompt.shape[0]} positions leaves no room in max_context "
                             f"{self.config.max_context}")
        return PreparedPrompt(prompt_embeds=prompt)

    # ---------------------------------------------------------------- per-slot state

    def _kv_layout(self) -> tuple[int, int, int, int]:
        cfg = self.config
        return cfg.num_hidden_layers, cfg.max_context, cfg.num_attention_heads, cfg.head_dim

    # ---------------------------------------------------------------- step hooks

    def text_step(self, columns: dict[str, torch.Tensor], slots: torch.Tensor,
                  frame_index: torch.Tensor) -> torch.Tensor:
        """Zeros [B, H]: T3 conditions on the text only through the prompt."""
        return torch.zeros(slots.shape[0], self.config.hidden_size, dtype=self.dtype, device=slots.device)

    @torch.no_grad()
    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                token_slots: torch.Tensor) -> torch.Tensor:
        return self.module.tfmr(inputs_embeds.to(self.dtype), positions.long(), token_slots.long(),
                                self._require_cache())

    @torch.no_grad()
    def cb0_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """speech_head logits over the whole speech table, start-of-speech set to -inf.

        Upstream never masks it (the trained model just does not emit it); here a sampled
        start token would be fed back as a frame, so it is ruled out whatever the sampler's
        allowed set. Stop stays: it is the engine's EOS.
        """
        return self.module.speech_head(hidden).index_fill(-1, self._start_id, float("-inf"))

    @torch.no_grad()
    def frame_embed(self, codes: torch.Tensor) -> torch.Tensor:
        """speech_emb(token) [B, H] (the position is added in forward). A gather: the bits
        never depend on the batch. Garbage ids are clamped to stay in bounds."""
        return self.module.speech_emb(codes[:, 0].long().clamp(0, self.config.codebook_size - 1))
