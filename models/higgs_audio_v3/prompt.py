"""Higgs Audio v3 request inputs, the tiny byte tokenizer, and the zero-shot TTS prompt's token ids."""

from __future__ import annotations

from typing import Protocol

import attrs

from .config import HiggsAudioV3Config

# Layout (upstream zero-shot TTS prompt: vllm-omni `HiggsAudioV3TokenizerAdapter.build_prompt`,
# sglang-omni `HiggsTokenizerAdapter.build_prompt`):
#
#     <|tts|>  <|text|>  text ids ...  <|audio|>      <- frame 0 is sampled at <|audio|>
#
# Every position is a text-token embedding. Each later input is the audio feedback: the sum
# of the 8 codebook embeddings of the previous frame (delay-pattern fillers included).
# Voice cloning (<|ref_text|> / <|ref_audio|> + delayed reference codes) is not built here.


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


@attrs.frozen
class ByteTextTokenizer:
    """UTF-8 bytes as ids 0..255 plus the three prompt specials, for the tiny config's
    259-entry vocab. Real checkpoints use the Qwen tokenizer shipped with the model; pass
    its ids (no special tokens added) as HiggsInputs.text_ids."""

    vocab_size: int = 259
    tts_id: int = 256
    text_id: int = 257
    audio_id: int = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def _ints(value) -> tuple[int, ...]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    return tuple(int(v) for v in value)


@attrs.frozen(kw_only=True)
class HiggsInputs:
    """One request: exactly one of `text` (through the model's tokenizer) or `text_ids`
    (content ids of the bare text). Tuples keep the inputs hashable."""

    text: str | None = None
    text_ids: tuple[int, ...] | None = attrs.field(default=None, converter=attrs.converters.optional(_ints))

    def __attrs_post_init__(self) -> None:
        if (self.text is None) == (self.text_ids is None):
            raise ValueError("HiggsInputs needs exactly one of text and text_ids")


def text_ids_of(inputs: HiggsInputs, tokenizer: TextTokenizer | None) -> list[int]:
    """The request's content ids; empty or whitespace-only text is refused like upstream."""
    if not isinstance(inputs, HiggsInputs):
        raise ValueError(f"Higgs Audio v3 takes HiggsInputs, got {type(inputs).__name__}")
    if inputs.text_ids is not None:
        return list(inputs.text_ids)
    if not inputs.text or not inputs.text.strip():
        raise ValueError("Higgs Audio v3 needs non-empty text")
    if tokenizer is None:
        raise ValueError("this config has no built-in tokenizer: pass HiggsInputs(text_ids=...) "
                         "(Qwen tokenizer ids) or construct the model with tokenizer=")
    return list(tokenizer.encode(inputs.text))


def prompt_ids(cfg: HiggsAudioV3Config, text_ids: list[int]) -> list[int]:
    """[<|tts|>, <|text|>, *text_ids, <|audio|>] following the module layout."""
    if not text_ids:
        raise ValueError("empty text: Higgs Audio v3 needs at least one text token")
    bad = [t for t in text_ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ValueError(f"text ids outside the text vocab [0, {cfg.vocab_size}): {bad[:8]}")
    return [cfg.tts_token_id, cfg.text_token_id, *text_ids, cfg.audio_continuation_id]
