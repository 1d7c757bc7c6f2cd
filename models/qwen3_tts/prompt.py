"""Qwen3-TTS request inputs, the tiny byte tokenizer, and the streaming-text prompt layout.

Layout (upstream `Qwen3TTSForConditionalGeneration.generate`, streaming text, no voice
clone). `T(x)` = text_projection(text_embedding(x)), `C(x)` = talker codec_embedding(x);
the text is the content tokens t0, t1, ..., t_{n-1} (no chat template):

    role prefix     T(im_start), T(assistant), T("\\n")
    codec prefix    C(nothink) + T(tts_pad)            (or think, think_bos, language, think_eos
                    C(think_bos) + T(tts_pad)           when a language id is given)
                    C(think_eos) + T(tts_pad)
                    [C(speaker) + T(tts_pad)]          (only with a speaker id)
                    C(codec_pad) + T(tts_bos)
    first text      C(codec_bos) + T(t0)                <- CB0 of frame 0 is sampled here
    trailing text   T(t1), ..., T(t_{n-1}), T(tts_eos)  (N = n entries; text step of frame f)
    after that      T(tts_pad) for every later frame

The input carrying frame f is sum_g embed_g(code_g of frame f) + trailing[f] (or
T(tts_pad) once f >= N).
"""

from __future__ import annotations

from typing import Callable, Protocol

import attrs
import torch

from .config import Qwen3TTSConfig


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


@attrs.frozen
class ByteTextTokenizer:
    """UTF-8 bytes as ids 0..255 plus a few specials, for the tiny config's 512-entry vocab.

    Real checkpoints use the Qwen tokenizer; pass its ids as TTSInputs.text_ids.
    """

    vocab_size: int = 512
    im_start_id: int = 256
    im_end_id: int = 257
    assistant_id: int = 258
    tts_pad_id: int = 259
    tts_bos_id: int = 260
    tts_eos_id: int = 261
    newline_id: int = 10  # the byte "\n"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


@attrs.frozen(kw_only=True)
class TTSInputs:
    """One request: exactly one of `text` (tokenized by the model's tokenizer) or `text_ids`
    (content token ids, without the chat template); optional codec-side speaker and
    language ids (values of upstream's `spk_id` / `codec_language_id` maps)."""

    text: str | None = None
    text_ids: list[int] | None = attrs.field(default=None, converter=attrs.converters.optional(list))
    speaker_id: int | None = None
    language_id: int | None = None

    def __attrs_post_init__(self) -> None:
        if (self.text is None) == (self.text_ids is None):
            raise ValueError("TTSInputs needs exactly one of text and text_ids")


def codec_prefix_ids(cfg: Qwen3TTSConfig, speaker_id: int | None, language_id: int | None) -> list[int]:
    if language_id is None:
        ids = [cfg.codec_nothink_id, cfg.codec_think_bos_id, cfg.codec_think_eos_id]
    else:
        ids = [cfg.codec_think_id, cfg.codec_think_bos_id, language_id, cfg.codec_think_eos_id]
    if speaker_id is not None:
        ids.append(speaker_id)
    return ids + [cfg.codec_pad_id, cfg.codec_bos_id]


def build_prompt(
    cfg: Qwen3TTSConfig,
    text_ids: list[int],
    *,
    speaker_id: int | None,
    language_id: int | None,
    text_embed: Callable[[torch.Tensor], torch.Tensor],
    codec_embed: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (prompt_embeds [P, H], trailing_text [N, H]) following the module docstring."""
    if not text_ids:
        raise ValueError("empty text: Qwen3-TTS needs at least one text token")
    for name, value, limit in (("speaker_id", speaker_id, cfg.vocab_size),
                               ("language_id", language_id, cfg.vocab_size)):
        if value is not None and not 0 <= value < limit:
            raise ValueError(f"{name}={value} outside the codec vocab [0, {limit})")
    bad = [t for t in text_ids if not 0 <= t < cfg.text_vocab_size]
    if bad:
        raise ValueError(f"text ids outside the text vocab [0, {cfg.text_vocab_size}): {bad[:8]}")
    codec = codec_prefix_ids(cfg, speaker_id, language_id)
    role = [cfg.im_start_token_id, cfg.assistant_token_id, cfg.newline_token_id]
    codec_text = [cfg.tts_pad_token_id] * (len(codec) - 2) + [cfg.tts_bos_token_id, text_ids[0]]
    trailing = list(text_ids[1:]) + [cfg.tts_eos_token_id]
    # One projection call for every text position of the request.
    text = text_embed(torch.tensor(role + codec_text + trailing, dtype=torch.long, device=device))
    codec_part = codec_embed(torch.tensor(codec, dtype=torch.long, device=device))
    n_role, n_codec = len(role), len(codec)
    prompt = torch.cat([text[:n_role], text[n_role:n_role + n_codec] + codec_part], dim=0)
    return prompt, text[n_role + n_codec:]
