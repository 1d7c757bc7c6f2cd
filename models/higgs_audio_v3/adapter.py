"""HiggsAudioV3Talker: Higgs Audio v3 as an mtp_fsm TalkerModel (delay pattern, no MTP stage, slot KV cache)."""

from __future__ import annotations

import math

import torch

from models.module_init import materialize, seeded_normal_init
from models.qwen3_tts.layers import Linear, RMSNorm, rope_tables
from models.slot_cache import PagedKVCache
from mtp_fsm.model_api import CodebookSampler, DelayPattern, ModelSpec, PreparedPrompt, TalkerModel

from .config import HiggsAudioV3Config
from .model import HiggsAudioV3Root
from .prompt import ByteTextTokenizer, HiggsInputs, TextTokenizer, prompt_ids, text_ids_of

# Tiny-model EOC wiring (see _wire_demo_eoc): two reserved residual channels, the flag value
# every audio-mode row carries, the fraction of flagged context rows past which EOC wins on
# codebook 0, and the gain that turns that margin into logits.
_FLAG_DIM = 0
_PROGRESS_DIM = 1
_FLAG_VALUE = 4.0
_STOP_FRACTION = 0.4
_EOC_GAIN = 4.0


class HiggsAudioV3Talker(PagedKVCache, TalkerModel):
    """Higgs Audio v3 (Qwen3 backbone, fused 8-codebook audio embedding and tied head)
    driven by the lockstep engine under the `delay_pattern` lifecycle.

    All Q codebooks come from the same hidden state: `cb0_logits` is codebook 0's slice of
    the fused head and `mtp` hands codebooks 1..Q-1's slices to the engine's sampler, which
    applies the delay pattern's masks (ramp-up BOC, wind-down EOC, BOC/EOC bans), the
    request's sampling and its counter-based noise; the model applies no masks and owns no
    RNG. The next input is the audio feedback `frame_embed` (sum of the frame's Q codebook
    embeddings). Every method except `prepare` is batched and free of host syncs.
    `device="meta"` builds shapes only (parameter counts of real sizes).
    """

    def __init__(self, config: HiggsAudioV3Config, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", tokenizer: TextTokenizer | None = None,
                 init_weights: bool = True):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.module = materialize(lambda: HiggsAudioV3Root(config), dtype, self.device)
        if init_weights and self.device.type != "meta":
            self._init_weights(seed)
        if tokenizer is None and config.text_tokenizer == "bytes":
            tokenizer = ByteTextTokenizer()
        self.tokenizer = tokenizer
        self._cos, self._sin = rope_tables(config.max_context, config.head_dim, config.rope_theta,
                                           dtype, self.device)
        self._cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._spec = ModelSpec(
            name="higgs_audio_v3", hidden_size=config.hidden_size, num_codebooks=config.num_codebooks,
            # BOC/EOC are legal frame codes (the pattern's fillers), so the codebook is all V ids.
            backbone_vocab_size=config.codebook_size, codebook_size=config.codebook_size,
            eos_token_id=None, max_context=config.max_context, dtype=dtype, variant="delay_pattern",
            delay_pattern=DelayPattern(boc=config.audio_stream_bos_id, eoc=config.audio_stream_eos_id),
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
                           weights=(Linear, torch.nn.Embedding), norms=(RMSNorm,))
        if self.config.demo_eoc_wiring:
            self._wire_demo_eoc()

    @torch.no_grad()
    def _wire_demo_eoc(self) -> None:
        """Tiny init only: make codebook 0's EOC win once audio is a fixed share of the context.

        With random weights EOC is one of ~1025 near-equal logits, so a request would run to
        max_context. Two residual channels are reserved (the MOSS tiny model's trick): no
        embedding and no layer output writes them, except FLAG = _FLAG_VALUE on every
        audio-mode row (the <|audio|> prompt token and, through codebook 0's table rows,
        every fed-back frame), and one layer-0 head whose query is zero (so it attends
        uniformly over the row's own context) reads FLAG through its value and writes the
        average into PROGRESS. PROGRESS / FLAG thus tracks (k + 1) / (P + k) for frame k of
        a P-position prompt. The head is tied to the table, so codebook 0's EOC row reads
        _EOC_GAIN * (PROGRESS - FLAG) on top of the FLAG_VALUE * FLAG every codebook-0 row
        reads (a shift shared by all codes, which sampling ignores); the final norm only
        rescales both channels. EOC thus stays far below the codes until the flagged share
        passes _STOP_FRACTION and dominates soon after (greedy: about frame 2P/3; sampled at
        temperature 1: about frame P). EOC's row doubles as its embedding, which only
        wind-down frames (codebook 0 locked to EOC) feed back.
        """
        m, cfg = self.module, self.config
        dims = [_FLAG_DIM, _PROGRESS_DIM]
        text, table = m.text_embedding.weight, m.audio_table.weight
        text[:, dims] = 0
        text[cfg.audio_continuation_id, _FLAG_DIM] = _FLAG_VALUE
        table[:, dims] = 0
        table[: cfg.codebook_size, _FLAG_DIM] = _FLAG_VALUE  # codebook 0's rows
        for layer in m.body.layers:
            layer.self_attn.o_proj.weight[dims] = 0
            layer.mlp.down_proj.weight[dims] = 0
        first = m.body.layers[0].self_attn
        first.q_proj.weight[: cfg.head_dim] = 0  # query head 0: zero query -> uniform attention
        first.v_proj.weight[0] = 0  # KV head 0, dim 0 reads only FLAG
        first.v_proj.weight[0, _FLAG_DIM] = 1.0
        # FLAG normalises to ~sqrt(H) in layer 0's RMSNorm: PROGRESS = FLAG at _STOP_FRACTION.
        first.o_proj.weight[_PROGRESS_DIM, 0] = _FLAG_VALUE / (_STOP_FRACTION * math.sqrt(cfg.hidden_size))
        eoc = table[cfg.audio_stream_eos_id]  # codebook 0's EOC row
        eoc.zero_()
        eoc[_FLAG_DIM] = _FLAG_VALUE - _EOC_GAIN
        eoc[_PROGRESS_DIM] = _EOC_GAIN

    # ---------------------------------------------------------------- admission

    @torch.no_grad()
    def prepare(self, inputs: HiggsInputs) -> PreparedPrompt:
        """Prompt embeddings [P, H]: text_embedding of [<|tts|>, <|text|>, text, <|audio|>]
        (prompt.py). No slot columns: v3 has no per-frame text conditioning. Host side, once."""
        ids = prompt_ids(self.config, text_ids_of(inputs, self.tokenizer))
        if len(ids) >= self.config.max_context:
            raise ValueError(f"prompt of {len(ids)} positions leaves no room in max_context "
                             f"{self.config.max_context}")
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
        return PreparedPrompt(prompt_embeds=self.module.text_embedding(ids_t))

    # ---------------------------------------------------------------- per-slot state

    def _kv_layout(self) -> tuple[int, int, int, int]:
        cfg = self.config
        return cfg.num_hidden_layers, cfg.max_context, cfg.num_key_value_heads, cfg.head_dim

    # ---------------------------------------------------------------- step hooks

    def text_step(self, columns: dict[str, torch.Tensor], slots: torch.Tensor,
                  frame_index: torch.Tensor) -> torch.Tensor:
        """Zeros [B, H]: in audio mode every input is the audio feedback alone."""
        return torch.zeros(slots.shape[0], self.config.hidden_size, dtype=self.dtype, device=slots.device)

    @torch.no_grad()
    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                token_slots: torch.Tensor) -> torch.Tensor:
        return self.module.body(inputs_embeds.to(self.dtype), positions.long(), token_slots.long(),
                                self._require_cache(), self._cos, self._sin)

    @torch.no_grad()
    def cb0_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Codebook 0's slice of the tied audio head: [B, V], BOC and EOC included (the
        engine's delay pattern decides when either may be sampled)."""
        return self.module.audio_logits(hidden.to(self.dtype), 1)[:, 0]

    @torch.no_grad()
    def mtp(self, hidden: torch.Tensor, cb0: torch.Tensor, sample: CodebookSampler) -> torch.Tensor:
        """codes [B, Q]: cb0, then sample(logits_q [B, V], q) for q = 1..Q-1, every codebook's
        logits taken from one evaluation of the fused head on the same hidden state."""
        logits = self.module.audio_logits(hidden.to(self.dtype))
        codes = [cb0.long()]
        for q in range(1, self.config.num_codebooks):
            codes.append(sample(logits[:, q].contiguous(), q).long())
        return torch.stack(codes, dim=1)

    @torch.no_grad()
    def frame_embed(self, codes: torch.Tensor) -> torch.Tensor:
        """The audio feedback sum_q embed_q(codes[:, q]) [B, H] in the fixed order q = 0..Q-1."""
        return self.module.audio_embed(codes)
