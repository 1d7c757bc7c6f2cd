"""MossTTSLocalTalker: the mtp_fsm TalkerModel adapter (weights, slot KV cache, text step, local MTP + stop)."""

from __future__ import annotations

import math

import torch

from models.module_init import materialize, seeded_normal_init
from models.slot_cache import PagedKVCache
from mtp_fsm.model_api import CodebookSampler, ModelSpec, MtpResult, PreparedPrompt, TalkerModel
from mtp_fsm.sampling import SamplingParams
from models.qwen3_tts.layers import Linear, RMSNorm, rope_tables

from .config import MossTTSLocalConfig
from .local import LayerNorm, interleaved_rope_tables
from .model import STOP, MossTTSLocalRoot
from .prompt import MossByteTokenizer, MossInputs, TextTokenizer, build_prompt_rows

# Upstream's fixed audio sampling (README / vllm-omni `talker_mtp`): owned by the model,
# replacing every request's CB0 and MTP parameters.
MOSS_AUDIO_SAMPLING = SamplingParams(temperature=1.7, top_k=25, top_p=0.8)

# Tiny-model stop wiring (see _wire_demo_stop): reserved residual channels, the flag value
# the audio-assistant-slot text embedding writes, and the generated fraction of the context
# past which the binary head says stop.
_FLAG_DIM = 0
_PROGRESS_DIM = 1
_FLAG_VALUE = 4.0
_STOP_FRACTION = 0.25
_STOP_GAIN = 8.0
# The two schedules (chosen per instance): "current" publishes a frame in the step that sampled
# it (upstream mrv2_eager_mtp); "deferred" runs its MTP at the start of the next step from the
# cached hidden state (upstream's canonical MossLocalModelState path). Same frames, one step apart.
SCHEDULES = {"current": "mtp_stop", "deferred": "mtp_stop_deferred"}
# Upstream's sampling of the binary continue/stop head (not the request's, not the audio's).
STOP_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=1.0)


class MossTTSLocalTalker(PagedKVCache, TalkerModel):
    """MOSS-TTS Local (Qwen3 backbone + local depth transformer) driven by the lockstep engine.

    Engine mapping: `cb0_logits` is the local transformer's codebook-0 head at local
    position 0 (fed the backbone hidden); `mtp` re-runs position 0, reads the binary
    continue/stop head there (deterministic: stop iff its stop logit is strictly larger)
    and decodes codebooks 1..n_vq-1 at positions 1..n_vq-1. Variant "mtp_stop": a row whose
    head says stop publishes nothing and finishes with reason eos. CB0 never stops.

    Every method except `prepare` is batched and free of host syncs. Parameters, the KV
    cache and returned embeddings use `dtype`; norms, RoPE and softmax run in at least
    float32. `device="meta"` builds shapes only (parameter counts of real sizes).
    """

    def __init__(self, config: MossTTSLocalConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", tokenizer: TextTokenizer | None = None,
                 init_weights: bool = True, schedule: str = "current"):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.module = materialize(lambda: MossTTSLocalRoot(config), dtype, self.device)
        if init_weights and self.device.type != "meta":
            self._init_weights(seed)
        if tokenizer is None and config.text_tokenizer == "bytes":
            tokenizer = MossByteTokenizer()
        self.tokenizer = tokenizer
        self._cos, self._sin = rope_tables(config.max_context, config.head_dim, config.rope_theta, dtype, self.device)
        self._local_cos, self._local_sin = interleaved_rope_tables(
            config.n_vq, config.local.head_dim, config.local.rope_base, dtype, self.device)
        self._cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        # Made once: building it per step would be a host-to-device copy (not graph-capturable).
        self._slot_ids = torch.tensor([config.audio_assistant_slot_token_id], dtype=torch.long, device=self.device)
        self._spec = ModelSpec(
            name="moss_tts_local", hidden_size=config.hidden_size, num_codebooks=config.n_vq,
            backbone_vocab_size=config.audio_vocab_size, codebook_size=config.audio_vocab_size,
            eos_token_id=None, max_context=config.max_context, dtype=dtype, variant=SCHEDULES[schedule],
            cb0_sampling=MOSS_AUDIO_SAMPLING, mtp_sampling=MOSS_AUDIO_SAMPLING,
        )

    @property
    def spec(self) -> ModelSpec:  # type: ignore[override]
        return self._spec

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    # ---------------------------------------------------------------- weights

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        """Deterministic from the seed alone (models.module_init)."""
        seeded_normal_init(self.module, seed, self.config.init_std,
                           weights=(Linear, torch.nn.Embedding), norms=(RMSNorm, LayerNorm))
        if self.config.demo_stop_wiring:
            self._wire_demo_stop()

    @torch.no_grad()
    def _wire_demo_stop(self) -> None:
        """Tiny init only: make the binary head stop once audio is a fixed share of the context.

        With random weights the stop head is a coin flip per frame. Here two residual
        channels are reserved: no embedding and no layer output writes them, except that the
        audio-assistant-slot text embedding (the text step of every generated frame) holds
        _FLAG_VALUE in channel FLAG, and one layer-0 head, whose query is zero (so it attends
        uniformly over the context), reads FLAG through its value and writes the average into
        PROGRESS. PROGRESS / FLAG thus tracks n / (P + n) for a prompt of P rows and n frames
        fed back; the stop row of the binary head reads PROGRESS - FLAG, which every norm on
        the way only rescales (LayerNorm's mean cancels in the difference). The prompt's last
        row (audio_start) has FLAG = PROGRESS = 0: a tie, and ties continue. So a request
        yields about P / 3 frames (fraction 1/4), the longer the text the longer the audio.
        """
        m, cfg = self.module, self.config
        dims = [_FLAG_DIM, _PROGRESS_DIM]
        m.transformer.embed_tokens.weight[:, dims] = 0
        m.transformer.embed_tokens.weight[cfg.audio_assistant_slot_token_id, _FLAG_DIM] = _FLAG_VALUE
        # The prompt's last row carries FLAG too, so the first sampled stop is a clear "continue".
        m.transformer.embed_tokens.weight[cfg.audio_start_token_id, _FLAG_DIM] = _FLAG_VALUE
        for table in m.audio_embeddings:
            table.weight[:, dims] = 0
        for layer in m.transformer.layers:
            layer.self_attn.o_proj.weight[dims] = 0
            layer.mlp.down_proj.weight[dims] = 0
        first = m.transformer.layers[0].self_attn
        first.q_proj.weight[: cfg.head_dim] = 0  # head 0: zero query -> uniform attention
        first.v_proj.weight[0] = 0  # kv head 0, dim 0 reads only FLAG
        first.v_proj.weight[0, _FLAG_DIM] = 1.0
        # FLAG normalises to ~sqrt(H) in layer 0's RMSNorm: PROGRESS = FLAG at fraction _STOP_FRACTION.
        first.o_proj.weight[_PROGRESS_DIM, 0] = _FLAG_VALUE / (_STOP_FRACTION * math.sqrt(cfg.hidden_size))
        for block in m.local_transformer.h:
            for proj in (block.attn.c_proj, block.mlp.fc_out):
                proj.weight[dims] = 0
                proj.bias[dims] = 0
        head = m.local_text_lm_head.weight
        head.zero_()
        # A large gain: the stop is sampled (temperature 1), so far from the threshold the
        # margin must make "continue" near certain, and past it "stop".
        head[STOP, _PROGRESS_DIM] = _STOP_GAIN
        head[STOP, _FLAG_DIM] = -_STOP_GAIN

    # ---------------------------------------------------------------- admission

    @torch.no_grad()
    def prepare(self, inputs: MossInputs) -> PreparedPrompt:
        """Prompt embeddings [P, H]: embed_tokens(text ids) + the rows' audio codes (reference
        codes for voice cloning; pad rows add zero). Host side, once per request."""
        ids, codes = build_prompt_rows(self.config, inputs, self.tokenizer)
        if len(ids) >= self.config.max_context:
            raise ValueError(f"prompt of {len(ids)} positions leaves no room in max_context "
                             f"{self.config.max_context}")
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
        embeds = self.module.transformer.embed_tokens(ids_t) + self.module.audio_embed(codes.to(self.device))
        return PreparedPrompt(prompt_embeds=embeds)

    # ---------------------------------------------------------------- per-slot state

    def _kv_layout(self) -> tuple[int, int, int, int]:
        cfg = self.config
        return cfg.num_hidden_layers, cfg.max_context, cfg.num_key_value_heads, cfg.head_dim

    # ---------------------------------------------------------------- step hooks

    @torch.no_grad()
    def assistant_slot_embed(self) -> torch.Tensor:
        """embed_tokens(audio_assistant_slot) [H]: the text channel of every generated frame."""
        return self.module.transformer.embed_tokens(self._slot_ids)[0]

    @torch.no_grad()
    def text_step(self, columns: dict[str, torch.Tensor], slots: torch.Tensor,
                  frame_index: torch.Tensor) -> torch.Tensor:
        """The same row for every frame and slot (upstream forces the text channel to
        audio_assistant_slot while audio continues): [B, H]."""
        return self.assistant_slot_embed()[None, :].expand(slots.shape[0], -1).contiguous()

    @torch.no_grad()
    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                token_slots: torch.Tensor) -> torch.Tensor:
        return self.module.transformer(inputs_embeds.to(self.dtype), positions.long(), token_slots.long(),
                                       self._require_cache(), self._cos, self._sin)

    @torch.no_grad()
    def cb0_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """audio_lm_heads[0] at local position 0 (input: the backbone hidden): [B, 1024]."""
        local0, _ = self.module.local_start(hidden.to(self.dtype), self._local_cos, self._local_sin)
        return self.module.audio_lm_heads[0](local0)

    @torch.no_grad()
    def stop_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The binary head at local position 0: [B, 2] = (continue, stop)."""
        local0, _ = self.module.local_start(hidden.to(self.dtype), self._local_cos, self._local_sin)
        return self.module.local_text_lm_head(local0)

    @torch.no_grad()
    def mtp(self, hidden: torch.Tensor, cb0: torch.Tensor, sample: CodebookSampler) -> MtpResult:
        """Codebooks 1..n_vq-1 (sample(logits, g) once per g, in order) and the stop flag.

        The stop is sampled from the binary head as upstream does (temperature 1, top-k 50,
        top-p 1: argmax would be biased toward continue), through the engine's sampler as
        codebook index n_vq with those model-owned parameters, so it is seeded per request
        like every other draw."""
        cb0 = cb0.long()
        local0, cache = self.module.local_start(hidden.to(self.dtype), self._local_cos, self._local_sin)
        binary = self.module.local_text_lm_head(local0)
        stop = sample(binary, self.spec.num_codebooks, STOP_SAMPLING) == STOP
        rest = self.module.generate_rest(cache, cb0, sample, self._local_cos, self._local_sin)
        return MtpResult(codes=torch.cat([cb0[:, None], rest], dim=1), stop=stop)

    @torch.no_grad()
    def frame_embed(self, codes: torch.Tensor) -> torch.Tensor:
        """sum_q audio_embeddings[q](code_q) in the fixed order q = 0..n_vq-1; pad adds zero."""
        return self.module.audio_embed(codes)
