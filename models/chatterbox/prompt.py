"""Chatterbox request inputs, the tiny byte tokenizer, the demo voice, and the T3 Turbo prompt layout."""

from __future__ import annotations

import math
from typing import Protocol

import attrs
import torch

from .config import ChatterboxConfig
from .t3 import T3Turbo

# Layout (upstream `T3.inference_turbo` -> `prepare_input_embeds`, Turbo hyper-parameters):
#
#     speaker         cond_enc.spkr_enc(speaker_emb)          1 position
#     conditioning    speech_emb(cond_prompt_speech_tokens)   0..speech_cond_prompt_len positions
#     text            text_emb(text ids)                       no start/stop text tokens in Turbo
#     start           speech_emb(start_speech_token)           <- speech token 0 is sampled here
#
# No position embeddings are added here: `input_pos_emb` is None for Turbo, and the GPT-2
# backbone adds `wpe[position]` to every input itself (prompt positions from 0).
# Each later input is speech_emb(previous token).


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


@attrs.frozen
class ByteTextTokenizer:
    """UTF-8 bytes as ids 0..255, for the tiny config. Real checkpoints use the GPT-2
    tokenizer shipped with Chatterbox Turbo; pass its ids as ChatterboxInputs.text_ids."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def _floats(value) -> tuple[float, ...]:
    if isinstance(value, torch.Tensor):
        value = value.detach().to("cpu", torch.float64).flatten().tolist()
    return tuple(float(v) for v in value)


def _ints(value) -> tuple[int, ...]:
    if isinstance(value, torch.Tensor):
        value = value.detach().to("cpu").flatten().tolist()
    return tuple(int(v) for v in value)


@attrs.frozen(kw_only=True)
class ChatterboxInputs:
    """One request: exactly one of `text` / `text_ids`, the voice-encoder speaker embedding
    (upstream `T3Cond.speaker_emb`) and the reference speech tokens (`cond_prompt_speech_tokens`).

    Stored as tuples so the inputs are hashable (test harnesses key reference runs on them).
    """

    text: str | None = None
    text_ids: tuple[int, ...] | None = attrs.field(default=None, converter=attrs.converters.optional(_ints))
    speaker_emb: tuple[float, ...] = attrs.field(converter=_floats)
    cond_tokens: tuple[int, ...] = attrs.field(default=(), converter=_ints)

    def __attrs_post_init__(self) -> None:
        if (self.text is None) == (self.text_ids is None):
            raise ValueError("ChatterboxInputs needs exactly one of text and text_ids")


def demo_conditioning(cfg: ChatterboxConfig) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """A fixed, platform-independent demo voice: (speaker embedding, conditioning tokens).

    Stands in for a voice-encoder embedding and S3 tokens of reference audio, which the
    tiny random model has no use for beyond making the prompt look like the real one.
    """
    speaker = tuple(round(math.sin(1.7 * i + 0.3), 6) for i in range(cfg.speaker_embed_size))
    tokens = tuple((37 * i + 11) % cfg.codebook_size for i in range(cfg.speech_cond_prompt_len))
    return speaker, tokens


def _check(cfg: ChatterboxConfig, text_ids: list[int], inputs: ChatterboxInputs) -> None:
    if not text_ids:
        raise ValueError("empty text: T3 needs at least one text token")
    bad = [t for t in text_ids if not 0 <= t < cfg.text_tokens_dict_size]
    if bad:
        raise ValueError(f"text ids outside the text vocab [0, {cfg.text_tokens_dict_size}): {bad[:8]}")
    if len(inputs.speaker_emb) != cfg.speaker_embed_size:
        raise ValueError(f"speaker_emb has {len(inputs.speaker_emb)} values, expected {cfg.speaker_embed_size}")
    if not all(math.isfinite(v) for v in inputs.speaker_emb):
        raise ValueError("speaker_emb holds a non-finite value")
    if len(inputs.cond_tokens) > cfg.speech_cond_prompt_len:
        raise ValueError(f"{len(inputs.cond_tokens)} conditioning tokens > speech_cond_prompt_len "
                         f"{cfg.speech_cond_prompt_len}")
    bad = [t for t in inputs.cond_tokens if not 0 <= t < cfg.codebook_size]
    if bad:
        raise ValueError(f"conditioning tokens outside the speech codebook [0, {cfg.codebook_size}): {bad[:8]}")


def build_prompt(cfg: ChatterboxConfig, module: T3Turbo, inputs: ChatterboxInputs, text_ids: list[int],
                 *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Prompt embeddings [1 + n_cond + n_text + 1, H] following the module docstring."""
    _check(cfg, text_ids, inputs)
    speaker = torch.tensor(inputs.speaker_emb, dtype=torch.float64).to(device=device, dtype=dtype)
    # One speech_emb gather for the conditioning tokens and start-of-speech together.
    speech_ids = torch.tensor(list(inputs.cond_tokens) + [cfg.start_speech_token], dtype=torch.long, device=device)
    speech = module.speech_emb(speech_ids)
    text = module.text_emb(torch.tensor(text_ids, dtype=torch.long, device=device))
    return torch.cat([module.speaker_embed(speaker), speech[:-1], text, speech[-1:]], dim=0)
