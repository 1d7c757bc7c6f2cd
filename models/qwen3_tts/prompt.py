"""Qwen3-TTS request inputs (TTSInputs), the tiny byte tokenizer, and the talker prompt layouts."""

from __future__ import annotations

from numbers import Integral
from typing import Callable, Protocol

import attrs
import torch

from .config import Qwen3TTSConfig
from .voice_clone import check_ref_codes, check_speaker_embedding, icl_layout



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
    user_id: int = 262  # stands in for the Qwen "user" token of the instruct template
    newline_id: int = 10  # the byte "\n"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


_optional_list = attrs.converters.optional(list)


def _same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b or (a is not None and b is not None and a.shape == b.shape and a.dtype == b.dtype
                      and bool(torch.equal(a, b)))


def _tensor_field():
    # Compared by value; left out of the hash so text-only inputs stay hashable.
    return attrs.field(default=None, eq=attrs.cmp_using(eq=_same_tensor), hash=False)


@attrs.frozen(kw_only=True)
class TTSInputs:
    """One Qwen3-TTS request (upstream `Qwen3TTSForConditionalGeneration.generate`, one sample).

    Token ids are always *content* ids (lists of ints): the tokenizer's ids of the bare string,
    no chat template and no special tokens. The prompt builder adds every template token itself.
    A string field is tokenized with the model's tokenizer; its `*_ids` twin takes ids.

    text / text_ids       the text to speak; exactly one, non-empty. Upstream slices the same
                          ids out of "<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n".
    non_streaming         False (default): streaming-text layout, the text is fed one token per
                          frame after the first. True: the whole text sits in the prompt and every
                          frame's text input is tts_pad. Upstream `non_streaming_mode`; its entry
                          points default to True for custom voice / voice design and False for
                          voice clone; here the default is False for every request.
    speaker               preset speaker name, a key of config.spk_id (case-insensitive); "" means
                          no speaker, as upstream.
    speaker_id            raw codec id used instead of a name (no dialect handling).
    speaker_embedding     voice-clone x-vector: float tensor [hidden_size], placed where the
                          speaker's codec embedding goes (cast to the model dtype). Upstream computes
                          it from the reference audio with its ECAPA speaker encoder
                          (`extract_speaker_embedding`), which is not shipped here: the caller
                          provides the vector. At most one of speaker / speaker_id /
                          speaker_embedding.
    language              a key of config.codec_language_id or "auto" (case-insensitive); None
                          means "auto" (upstream's entry-point default): no language id.
                          Dialect override (upstream): with a `speaker` name whose
                          config.spk_is_dialect entry names a dialect, language None / "auto" /
                          "chinese" becomes that dialect's language id.
    language_id           raw codec language id instead of a name (no dialect override).
                          At most one of language / language_id.
    instruct / instruct_ids
                          voice/style instruction (upstream `instruct`), at most one; content ids,
                          the builder wraps them as [im_start, user, "\\n"] + ids + [im_end, "\\n"]
                          (see `instruct_template_ids`; "user" is config.user_token_id, the Qwen
                          tokenizer's 872 or the byte tokenizer's user_id) and prepends their text
                          projection to the prompt. Empty ("" or []) means no instruction, as
                          upstream. Rejected by the 0.6B CustomVoice model, whose upstream entry
                          point drops it.
    ref_text / ref_text_ids
                          voice-clone ICL reference transcript, at most one, non-empty; upstream
                          slices the same ids out of "<|im_start|>assistant\\n{ref_text}<|im_end|>\\n".
    ref_codes             ICL reference audio codes: integer tensor [T, Q] (T >= 1 frames,
                          Q = num_code_groups, values in [0, codebook_size)), upstream `ref_code`
                          from the speech tokenizer's encode.

    Voice clone: `speaker_embedding` alone is upstream's x_vector_only_mode; adding
    `ref_codes` + `ref_text`/`ref_text_ids` is ICL mode, which upstream always pairs with the
    x-vector, so ICL requires `speaker_embedding` too. ICL has a streaming and a non-streaming
    variant (`non_streaming`). `instruct` and `language` combine with every mode.
    Combination errors raise ValueError here; vocab, codebook, shape, dtype and name errors
    raise ValueError from the model's `prepare` (the engine's AdmissionError).

    The same request upstream: generate(input_ids=[im_start, assistant, "\\n"] + text_ids +
    [im_end, "\\n", im_start, assistant, "\\n"], instruct_ids=instruct_template_ids(cfg, ids),
    languages=[language or "auto"], speakers=[speaker], ref_ids=[im_start, assistant, "\\n"] +
    ref_text_ids + [im_end, "\\n"], voice_clone_prompt={ref_spk_embedding: [speaker_embedding],
    ref_code: [ref_codes], icl_mode: [ref_codes given], x_vector_only_mode: [not icl_mode]},
    non_streaming_mode=non_streaming). Content ids equal upstream's slices of its templated
    tokenization unless a string starts with a line break (BPE would merge it with the "\\n").
    """

    text: str | None = None
    text_ids: list[int] | None = attrs.field(default=None, converter=_optional_list)
    non_streaming: bool = False
    speaker: str | None = None
    speaker_id: int | None = None
    speaker_embedding: torch.Tensor | None = _tensor_field()
    language: str | None = None
    language_id: int | None = None
    instruct: str | None = None
    instruct_ids: list[int] | None = attrs.field(default=None, converter=_optional_list)
    ref_text: str | None = None
    ref_text_ids: list[int] | None = attrs.field(default=None, converter=_optional_list)
    ref_codes: torch.Tensor | None = _tensor_field()

    def __attrs_post_init__(self) -> None:
        if (self.text is None) == (self.text_ids is None):
            raise ValueError("TTSInputs needs exactly one of text and text_ids")
        for group in (("speaker", "speaker_id", "speaker_embedding"), ("language", "language_id"),
                      ("instruct", "instruct_ids"), ("ref_text", "ref_text_ids")):
            given = [name for name in group if getattr(self, name) is not None]
            if len(given) > 1:
                raise ValueError(f"TTSInputs takes at most one of {', '.join(group)}; got {', '.join(given)}")
        for name in ("text", "speaker", "language", "instruct", "ref_text"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"TTSInputs.{name} must be a str, got {type(value).__name__}")
        if not isinstance(self.non_streaming, bool):
            raise ValueError(f"TTSInputs.non_streaming must be a bool, got {self.non_streaming!r}")
        has_ref_text = self.ref_text is not None or self.ref_text_ids is not None
        if has_ref_text != (self.ref_codes is not None):
            raise ValueError("voice-clone ICL needs both ref_codes and ref_text (or ref_text_ids); got only "
                             + ("ref_codes" if self.ref_codes is not None else "the reference text"))
        if self.ref_codes is not None and self.speaker_embedding is None:
            raise ValueError("voice-clone ICL (ref_codes) needs speaker_embedding as well: upstream always "
                             "places the reference x-vector in the prompt in ICL mode")


@attrs.frozen
class PromptEmbedders:
    """The model's embedding functions the layouts are built from (all return [n, hidden])."""

    text: Callable[[torch.Tensor], torch.Tensor]  # text_projection(text_embedding(ids))
    codec: Callable[[torch.Tensor], torch.Tensor]  # talker codec_embedding(ids)
    frames: Callable[[torch.Tensor], torch.Tensor]  # codes [T, Q] -> summed codebook embeddings
    dtype: torch.dtype
    device: torch.device


def instruct_template_ids(cfg: Qwen3TTSConfig, content_ids: list[int]) -> list[int]:
    """Upstream's tokenized "<|im_start|>user\\n{instruct}<|im_end|>\\n" built from content ids."""
    return ([cfg.im_start_token_id, cfg.user_token_id, cfg.newline_token_id] + list(content_ids)
            + [cfg.im_end_token_id, cfg.newline_token_id])


def _content_ids(cfg: Qwen3TTSConfig, name: str, text: str | None, ids: list[int] | None,
                 tokenizer: TextTokenizer | None) -> list[int] | None:
    """The ids of a str field (via the tokenizer) or of its `*_ids` twin, checked against the vocab."""
    if ids is None and text is None:
        return None
    if ids is None:
        if tokenizer is None:
            raise ValueError(f"this config has no built-in tokenizer: pass {name}_ids instead of {name} "
                             "or construct the model with tokenizer=")
        ids = list(tokenizer.encode(text))
    else:
        name = f"{name}_ids"
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, Integral) or not 0 <= t < cfg.text_vocab_size]
    if bad:
        raise ValueError(f"{name}: ids outside the text vocab [0, {cfg.text_vocab_size}) or not ints: {bad[:8]}")
    return [int(t) for t in ids]


def _lookup(table: dict, name: str, field: str, extra: tuple[str, ...] = ()) -> int:
    key = name.lower()  # upstream lowercases names; config keys are lowercase
    if key not in table:
        known = ", ".join(sorted(table) + list(extra)) or "none: this config offers no names"
        raise ValueError(f"{field}={name!r} is not known to this model; known: {known}")
    return table[key]


def _codec_id(cfg: Qwen3TTSConfig, field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or not 0 <= value < cfg.vocab_size:
        raise ValueError(f"{field}={value!r} is not an id in the codec vocab [0, {cfg.vocab_size})")
    return int(value)


def resolve_voice(cfg: Qwen3TTSConfig, inputs: TTSInputs) -> tuple[int | None, int | None]:
    """(speaker codec id or None, language codec id or None) following upstream `generate`."""
    speaker_id = None
    speaker = inputs.speaker or None  # upstream: "" = no preset speaker
    if speaker is not None:
        speaker_id = _lookup(cfg.spk_id, speaker, "speaker")
    elif inputs.speaker_id is not None:
        speaker_id = _codec_id(cfg, "speaker_id", inputs.speaker_id)
    if inputs.language_id is not None:
        return speaker_id, _codec_id(cfg, "language_id", inputs.language_id)
    language = (inputs.language if inputs.language is not None else "auto").lower()
    language_id = None if language == "auto" else _lookup(cfg.codec_language_id, language, "language", ("auto",))
    if speaker is not None and language in ("chinese", "auto"):
        # A dialect speaker (e.g. a Sichuanese one) speaks its dialect unless another language is asked for.
        dialect = cfg.spk_is_dialect.get(speaker.lower(), False)
        if dialect is not False:
            language_id = cfg.codec_language_id[dialect]
    return speaker_id, language_id


def codec_prefix_ids(cfg: Qwen3TTSConfig, language_id: int | None) -> list[int]:
    """The think/nothink tag (+ language) codec ids that precede the speaker position."""
    if language_id is None:
        return [cfg.codec_nothink_id, cfg.codec_think_bos_id, cfg.codec_think_eos_id]
    return [cfg.codec_think_id, cfg.codec_think_bos_id, language_id, cfg.codec_think_eos_id]


def build_prompt(cfg: Qwen3TTSConfig, inputs: TTSInputs, tokenizer: TextTokenizer | None,
                 embed: PromptEmbedders) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_embeds [P, H], trailing_text [N, H]) of one request.

    T(x) = text_projection(text_embedding(x)), C(x) = talker codec_embedding(x), text content
    ids t0..t_{n-1}; S = the speaker position (C(speaker id) or the x-vector), if any:

        instruct        T(instruct_template_ids(...))                       (only with an instruct)
        role            T(im_start), T(assistant), T("\\n")
        codec prefix    C(c) + T(tts_pad) for c in nothink, think_bos, think_eos
                        (or think, think_bos, language, think_eos), then S + T(tts_pad),
                        then C(codec_pad) + T(tts_bos)
        streaming       C(codec_bos) + T(t0)              trailing T(t1..t_{n-1}), T(tts_eos)
        non-streaming   C(codec_pad) + T(x) for x in t0..t_{n-1}, tts_eos;
                        then C(codec_bos) + T(tts_pad)   trailing T(tts_pad)
        ICL             see voice_clone.icl_layout

    CB0 of frame 0 is sampled from the last prompt position; the input carrying frame f is
    sum_g embed_g(code_g of frame f) + trailing[f] (or T(tts_pad) once f >= N).
    """
    text = _content_ids(cfg, "text", inputs.text, inputs.text_ids, tokenizer)
    if not text:
        raise ValueError("text: empty; Qwen3-TTS needs at least one text token")
    instruct = _content_ids(cfg, "instruct", inputs.instruct, inputs.instruct_ids, tokenizer)
    if instruct and cfg.tts_model_type == "custom_voice" and cfg.tts_model_size == "0b6":
        raise ValueError("instruct: the 0.6B CustomVoice model does not take an instruction "
                         "(upstream generate_custom_voice drops it)")
    ref_text = _content_ids(cfg, "ref_text", inputs.ref_text, inputs.ref_text_ids, tokenizer)
    speaker_id, language_id = resolve_voice(cfg, inputs)
    xvector = ref_codes = None
    if inputs.speaker_embedding is not None:
        xvector = check_speaker_embedding(cfg, inputs.speaker_embedding).to(embed.device, embed.dtype)
    if inputs.ref_codes is not None:
        if not ref_text:
            raise ValueError("ref_text: empty; voice-clone ICL needs the reference transcript")
        ref_codes = check_ref_codes(cfg, inputs.ref_codes).to(embed.device)

    def T(ids: list[int]) -> torch.Tensor:
        return embed.text(torch.tensor(ids, dtype=torch.long, device=embed.device))

    def C(ids: list[int]) -> torch.Tensor:
        return embed.codec(torch.tensor(ids, dtype=torch.long, device=embed.device))

    pad, bos, eos = T([cfg.tts_pad_token_id, cfg.tts_bos_token_id, cfg.tts_eos_token_id])
    codec = [C(codec_prefix_ids(cfg, language_id))]
    if speaker_id is not None:
        codec.append(C([speaker_id]))
    elif xvector is not None:
        codec.append(xvector[None])
    codec.append(C([cfg.codec_pad_id]))
    codec_rows = torch.cat(codec)
    # Every codec prefix position carries tts_pad except the last (codec_pad), which carries tts_bos.
    text_rows = torch.cat([pad.expand(codec_rows.shape[0] - 1, -1), bos[None]])
    parts = [T([cfg.im_start_token_id, cfg.assistant_token_id, cfg.newline_token_id]), codec_rows + text_rows]
    if instruct:
        parts.insert(0, T(instruct_template_ids(cfg, instruct)))
    codec_bos = C([cfg.codec_bos_id])
    if ref_codes is not None:
        tail, trailing = icl_layout(cfg, text, ref_text, ref_codes, T=T, C=C, frames=embed.frames,
                                    pad=pad, eos=eos, non_streaming=inputs.non_streaming)
    elif inputs.non_streaming:
        whole = torch.cat([T(text), eos[None]])
        tail = torch.cat([whole + C([cfg.codec_pad_id]), codec_bos + pad])
        trailing = pad[None]
    else:
        tail = T(text[:1]) + codec_bos
        trailing = torch.cat([T(text[1:]), eos[None]]) if len(text) > 1 else eos[None]
    return torch.cat(parts + [tail]), trailing
