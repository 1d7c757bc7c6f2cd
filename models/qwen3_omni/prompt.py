"""Qwen3-Omni talker request inputs, the seeded byte "thinker stand-in", and the talker prompt layout.

Layout (upstream `Qwen3OmniMoeForConditionalGeneration.generate`, `_get_talker_user_parts` and
`_get_talker_assistant_parts`). The thinker side of a request is a sequence of thinker rows
(width thinker_hidden_size): its *input embeddings* e(x) for text tokens, and, for multimodal
user positions, its hidden state of layer accept_hidden_layer h(x). `T` = text_projection,
`Hp` = hidden_projection, `C` = talker codec_embedding:

    user turn       T(e(x)) per text position, Hp(h(x)) per multimodal position   (may be empty)
    assistant       T(e(im_start)), T(e(assistant)), T(e("\\n"))
                    T(e(tts_pad)) + C(nothink), + C(think_bos), + C(think_eos), + C(speaker)
                    T(e(tts_bos)) + C(codec_pad)
                    T(e(t0)) + C(codec_bos)           <- CB0 of frame 0 is sampled here
    conditioning    frame f's input adds T(feed[f]) where feed = e(t1), e(t2), ... arrive over
                    time (engine.feed); once the feed is done: T(e(tts_eos)) once, then T(e(tts_pad)).

Prefill rows carry no frame (upstream's placeholder codec rows are codes 0, never published).
"""

from __future__ import annotations

import functools
from typing import Callable

import attrs
import torch

from models.module_init import seeded_normal
from models.qwen3_tts.prompt import ByteTextTokenizer

from .config import Qwen3OmniConfig


@attrs.frozen
class ThinkerStandIn(ByteTextTokenizer):
    """The tiny demo's thinker: the byte tokenizer's ids (UTF-8 bytes 0..255 plus specials),
    embedded by a fixed seeded table.

    Real deployments feed the real thinker's rows (OmniInputs.prompt_rows, engine.feed()).
    """

    seed: int = 0x0511
    std: float = 1.0


STAND_IN = ThinkerStandIn()


@functools.lru_cache(maxsize=8)
def _table(width: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(STAND_IN.seed)
    return seeded_normal((STAND_IN.vocab_size, width), gen) * STAND_IN.std


def thinker_table(width: int) -> torch.Tensor:
    """The stand-in thinker's input-embedding table [512, width] (float32, same for every call)."""
    return _table(int(width)).clone()


def thinker_embed(ids: list[int], width: int) -> torch.Tensor:
    """Stand-in thinker input embeddings of token ids: [len(ids), width] float32."""
    bad = [i for i in ids if not 0 <= i < STAND_IN.vocab_size]
    if bad:
        raise ValueError(f"ids outside the stand-in thinker vocab [0, {STAND_IN.vocab_size}): {bad[:8]}")
    return _table(int(width))[torch.tensor(ids, dtype=torch.long)].clone()


def thinker_rows(text: str, width: int) -> torch.Tensor:
    """The stand-in thinker's rows for `text`: one input embedding per UTF-8 byte, [n, width]."""
    return thinker_embed(STAND_IN.encode(text), width)


@attrs.frozen(kw_only=True, eq=False)
class OmniInputs:
    """One talker request. Exactly one of:

    text: the demo path; the model's stand-in thinker (config.thinker_stand_in) makes the rows:
      prompt = user turn (none) + [im_start, assistant, "\\n", first byte], feed = the other bytes.
    prompt_rows [P >= 4, W]: thinker input embeddings of the prompt side; the last four are
      im_start, assistant, "\\n" and the first text token, any rows before them are the user turn.

    user_hidden [P - 4, W] with user_mm_mask bool [P - 4]: thinker hidden states (layer
    accept_hidden_layer) used, through hidden_projection, at the multimodal user positions.
    speaker_id: a codec speaker id (default: config.default_speaker).
    feed_rows / feed_done: conditioning rows already known at admission (prepare() hands them to
    the engine as PreparedPrompt.feed); the rest arrive through engine.feed(request_id, rows).
    """

    text: str | None = None
    prompt_rows: torch.Tensor | None = None
    user_hidden: torch.Tensor | None = None
    user_mm_mask: torch.Tensor | None = None
    speaker_id: int | None = None
    feed_rows: torch.Tensor | None = None
    feed_done: bool = False

    def __attrs_post_init__(self) -> None:
        if (self.text is None) == (self.prompt_rows is None):
            raise ValueError("OmniInputs needs exactly one of text and prompt_rows")
        if self.text is not None and not self.text:
            raise ValueError("empty text: the talker prompt needs a first text token")
        if (self.user_hidden is None) != (self.user_mm_mask is None):
            raise ValueError("user_hidden and user_mm_mask go together")
        if self.text is not None and (self.user_hidden is not None or self.feed_rows is not None):
            raise ValueError("text inputs make their own rows: no user_hidden / feed_rows")


def stand_in_prompt_rows(text: str, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_rows [4, W], feed [n - 1, W]) for `text` under the stand-in thinker."""
    ids = STAND_IN.encode(text)
    if not ids:
        raise ValueError("empty text: the talker prompt needs a first text token")
    head = thinker_embed([STAND_IN.im_start_id, STAND_IN.assistant_id, STAND_IN.newline_id, ids[0]], width)
    return head, thinker_embed(ids[1:], width)


def codec_prefix_ids(cfg: Qwen3OmniConfig, speaker_id: int) -> list[int]:
    return [cfg.codec_nothink_id, cfg.codec_think_bos_id, cfg.codec_think_eos_id, speaker_id,
            cfg.codec_pad_id, cfg.codec_bos_id]


def build_prompt(
    cfg: Qwen3OmniConfig,
    rows: torch.Tensor,
    *,
    speaker_id: int,
    user_hidden: torch.Tensor | None,
    user_mm_mask: torch.Tensor | None,
    specials: torch.Tensor,
    text_projection: Callable[[torch.Tensor], torch.Tensor],
    hidden_projection: Callable[[torch.Tensor], torch.Tensor],
    codec_embed: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Prompt embeddings [U + 9, H] following the module docstring.

    rows: [U + 4, W] thinker rows (model dtype/device); specials: projected [tts_bos, tts_eos,
    tts_pad] rows [3, H] (the same tensors the text step uses, so they match bit for bit).
    """
    width = cfg.thinker_hidden_size
    if rows.dim() != 2 or rows.shape[1] != width or rows.shape[0] < 4:
        raise ValueError(f"prompt_rows must be [P >= 4, {width}], got {tuple(rows.shape)}")
    if not bool(torch.isfinite(rows).all()):
        raise ValueError("prompt_rows must be finite")
    if not 0 <= speaker_id < cfg.vocab_size:
        raise ValueError(f"speaker_id={speaker_id} outside the codec vocab [0, {cfg.vocab_size})")
    n_user = rows.shape[0] - 4
    text = text_projection(rows)  # one projection call for every text row of the request
    user = text[:n_user]
    if user_hidden is not None:
        mask = user_mm_mask.to(device=rows.device, dtype=torch.bool)
        if user_hidden.shape != (n_user, width) or mask.shape != (n_user,):
            raise ValueError(f"user_hidden must be [{n_user}, {width}] and user_mm_mask [{n_user}]")
        hidden = hidden_projection(user_hidden.to(device=rows.device, dtype=rows.dtype))
        user = torch.where(mask[:, None], hidden, user)
    bos, pad = specials[0], specials[2]
    assistant_text = torch.cat([text[n_user:n_user + 3], pad.expand(4, -1), bos[None], text[n_user + 3:]])
    codec = codec_embed(torch.tensor(codec_prefix_ids(cfg, speaker_id), dtype=torch.long, device=rows.device))
    assistant = torch.cat([assistant_text[:3], assistant_text[3:] + codec.to(assistant_text.dtype)])
    return torch.cat([user, assistant])
