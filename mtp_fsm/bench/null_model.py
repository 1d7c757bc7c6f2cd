"""NullTalker: a talker whose model outputs are precomputed, so a step times lifecycle work only."""

from __future__ import annotations

import attrs
import torch

from ..model_api import CodebookSampler, ModelSpec, PreparedPrompt, TalkerModel

# Distinct precomputed rows; a prime so (position + cb0) % ROWS mixes well.
NUM_ROWS = 61
TEXT_ROWS = 8


@attrs.frozen
class NullInputs:
    """A request's inputs for the NullTalker: only the prompt length matters."""

    prompt_len: int = 4


@attrs.frozen
class NullConfig:
    """Sizes of the null talker. Q=16 and the backbone/codebook vocab split mirror Qwen3-TTS;
    the vocab sizes are scaled down by default (see `lifecycle_config`)."""

    hidden_size: int = 64
    num_codebooks: int = 16
    codebook_size: int = 2048
    backbone_vocab_size: int = 3072
    eos_token_id: int = 2150
    max_context: int = 512
    dtype: torch.dtype = torch.float32


def qwen3_tts_sizes(**overrides) -> NullConfig:
    """Real Qwen3-TTS vocabularies: CB0 head 3072 (2048 codes + specials, EOS 2150), Q=16."""
    return NullConfig(**overrides)


def lifecycle_config(**overrides) -> NullConfig:
    """The lifecycle benchmark's sizes: Q=16 (real), vocabularies scaled 1/32 (CB0 head 96, codes 64).

    Why smaller: on a CPU the batched sampler's work is elementwise over [B, V] per codebook
    (a counter hash, a Gumbel lookup, a top-k sort), which at V=2048, B=1024 is ~30M element
    ops per codebook and would make every design's step time measure memory bandwidth, not
    lifecycle work. On a GPU that work is one launch of a few microseconds. The number of
    sampler calls, ops and Python per row (what the designs differ in) does not depend on V.
    `qwen3_tts_sizes()` gives the real vocabularies for a side-by-side check.
    """
    base = dict(codebook_size=64, backbone_vocab_size=96, eos_token_id=66)
    base.update(overrides)
    return NullConfig(**base)


class NullTalker(TalkerModel):
    """Precomputed hidden states and logits: every method is an index into a buffer.

    forward: hidden row = buffer[position % NUM_ROWS] (channel 0 carries the row id);
    cb0_logits: logits row by that id; mtp: for each codebook g, precomputed logits row
    (id + cb0) % NUM_ROWS handed to the engine's sampler (the sampling work is real);
    frame_embed: a gather-sum of per-codebook embeddings. The EOS logit is very negative,
    so no request ends by EOS: every row stays in decode for as long as the bench runs.
    No host synchronisation anywhere; outputs depend only on the row's own inputs.
    """

    def __init__(self, config: NullConfig | None = None, *, seed: int = 0, device: torch.device | str = "cpu") -> None:
        cfg = config or lifecycle_config()
        self.config = cfg
        self.device = torch.device(device)
        self.spec = ModelSpec(
            name="null", hidden_size=cfg.hidden_size, num_codebooks=cfg.num_codebooks,
            backbone_vocab_size=cfg.backbone_vocab_size, codebook_size=cfg.codebook_size,
            eos_token_id=cfg.eos_token_id, max_context=cfg.max_context, dtype=cfg.dtype,
        )
        g = torch.Generator().manual_seed(seed)
        h, q, v, v0 = cfg.hidden_size, cfg.num_codebooks, cfg.codebook_size, cfg.backbone_vocab_size

        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, dtype=torch.float32) * scale).to(cfg.dtype)

        hidden = rand(NUM_ROWS, h)
        hidden[:, 0] = torch.arange(NUM_ROWS, dtype=cfg.dtype)
        cb0 = rand(NUM_ROWS, v0, scale=3.0)
        if cfg.eos_token_id is not None:
            cb0[:, cfg.eos_token_id] = -1e4
        put = lambda t: t.to(self.device)  # noqa: E731
        self._hidden = put(hidden)
        self._cb0_logits = put(cb0)
        self._mtp_logits = put(rand(max(q - 1, 1), NUM_ROWS, v, scale=3.0))
        self._code_embed = put(rand(q, v, h, scale=0.1))
        self._text = put(rand(TEXT_ROWS, h, scale=0.1))
        self._codebooks = put(torch.arange(q))
        self.max_slots = 0

    # -- admission / slots --------------------------------------------------------------

    def prepare(self, inputs: NullInputs | int) -> PreparedPrompt:
        n = inputs if isinstance(inputs, int) else inputs.prompt_len
        return PreparedPrompt(prompt_embeds=torch.zeros(n, self.spec.hidden_size, dtype=self.spec.dtype))

    def bind_slots(self, max_slots, device, columns=None) -> None:
        self.max_slots = max_slots

    def reset_slots(self, slots: torch.Tensor) -> None:
        pass  # no per-slot model state (no KV cache)

    # -- step hooks ----------------------------------------------------------------------

    def text_step(self, columns, slots, frame_index):
        return self._text[frame_index % TEXT_ROWS]

    def forward(self, inputs_embeds, positions, token_slots):
        return self._hidden[positions % NUM_ROWS]

    def row_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[:, 0].long()

    def cb0_logits(self, hidden):
        return self._cb0_logits[self.row_ids(hidden)]

    def mtp(self, hidden, cb0: torch.Tensor, sample: CodebookSampler) -> torch.Tensor:
        rows = (self.row_ids(hidden) + cb0.long()) % NUM_ROWS
        codes = [cb0.long()]
        for g in range(1, self.spec.num_codebooks):
            codes.append(sample(self._mtp_logits[g - 1][rows], g).long())
        return torch.stack(codes, dim=1)

    def frame_embed(self, codes: torch.Tensor) -> torch.Tensor:
        codes = codes.long().clamp(0, self.spec.codebook_size - 1)
        return self._code_embed[self._codebooks[None, :], codes].sum(1)
