"""MOSS-TTS Local request inputs, the tiny byte tokenizer, and the prompt row layout (text id + n_vq codes per row)."""

from __future__ import annotations

from typing import Protocol

import attrs
import torch

from .config import MossTTSLocalConfig


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


@attrs.frozen
class MossByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus the MOSS specials, for the tiny config's 512-entry vocab.

    Real checkpoints use the Qwen tokenizer: pass it as `tokenizer=` or send `prompt_ids`.
    """

    vocab_size: int = 512
    pad_id: int = 256
    im_start_id: int = 257
    im_end_id: int = 258
    audio_start_id: int = 259
    audio_end_id: int = 260
    audio_user_slot_id: int = 261
    audio_assistant_slot_id: int = 262

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def _codes_or_none(value) -> torch.Tensor | None:
    return None if value is None else torch.as_tensor(value, dtype=torch.int64).cpu()


@attrs.frozen(kw_only=True)
class MossInputs:
    """One request: exactly one of `text` (model tokenizer), `text_ids` (content ids; the
    template is still tokenized) or `prompt_ids` (a complete prompt, no layout applied).

    reference_codes [L, n_vq]: voice-clone reference for `text` / `text_ids`.
    prompt_codes [len(prompt_ids), n_vq]: code columns aligned with `prompt_ids` (pad id
    where a row has no audio), added to the prompt rows like upstream `_apply_reference_batch`.
    language: the v1.5 template's "- Language:" field (full template only).
    """

    text: str | None = None
    text_ids: list[int] | None = attrs.field(default=None, converter=attrs.converters.optional(list))
    prompt_ids: list[int] | None = attrs.field(default=None, converter=attrs.converters.optional(list))
    reference_codes: torch.Tensor | None = attrs.field(default=None, converter=_codes_or_none, eq=False)
    prompt_codes: torch.Tensor | None = attrs.field(default=None, converter=_codes_or_none, eq=False)
    language: str | None = None

    def __attrs_post_init__(self) -> None:
        given = sum(x is not None for x in (self.text, self.text_ids, self.prompt_ids))
        if given != 1:
            raise ValueError("MossInputs needs exactly one of text, text_ids and prompt_ids")
        if self.prompt_codes is not None and self.prompt_ids is None:
            raise ValueError("prompt_codes go with prompt_ids (use reference_codes with text / text_ids)")
        if self.reference_codes is not None and self.prompt_ids is not None:
            raise ValueError("with prompt_ids, pass the reference as prompt_codes aligned to the prompt rows")


_AFTER_REFERENCE = ("\n- Instruction:\nNone\n- Tokens:\nNone\n- Quality:\nNone\n- Sound Event:\nNone"
                    "\n- Ambient Sound:\nNone\n- Language:\n{language}\n- Text:\n")


def check_codes(cfg: MossTTSLocalConfig, codes: torch.Tensor, rows: int | None, what: str) -> None:
    """Codes must be [rows, n_vq] ids in [0, audio_vocab_size) or the pad id."""
    if codes.dim() != 2 or codes.shape[1] != cfg.n_vq or (rows is not None and codes.shape[0] != rows):
        want = f"[{rows if rows is not None else 'L'}, {cfg.n_vq}]"
        raise ValueError(f"{what} must have shape {want}, got {list(codes.shape)}")
    bad = ((codes < 0) | (codes >= cfg.audio_vocab_size)) & (codes != cfg.audio_pad_token_id)
    if bool(bad.any()):
        raise ValueError(f"{what} holds ids outside [0, {cfg.audio_vocab_size}) that are not the pad id "
                         f"{cfg.audio_pad_token_id}: {codes[bad][:8].tolist()}")


def build_prompt_rows(cfg: MossTTSLocalConfig, inputs: MossInputs,
                      tokenizer: TextTokenizer | None) -> tuple[list[int], torch.Tensor]:
    """(text ids [P], codes int64 [P, n_vq]) of the prompt.

    Every prompt row is (text id, code_0 .. code_{n_vq-1}) with the audio pad id where a row
    carries no audio; its embedding is embed_tokens(text id) + sum_q audio_embeddings[q](code_q)
    (pad contributes zero). Layouts (upstream `MossTTSLocalProcessor`, v1.5, generation mode):

      full      <im_start> "user\\n" "<user_inst>\\n- Reference(s):\\n" REF "\\n- Instruction:\\nNone ..."
                "- Language:\\n{language}\\n- Text:\\n" TEXT "\\n</user_inst>" <im_end> "\\n"
                <im_start> "assistant\\n" <audio_start>
      compact   <im_start> "user\\n" [REF] TEXT <im_end> "\\n" <im_start> "assistant\\n" <audio_start>
                (the tiny demo's short form; not a trained layout)

    REF is "None" (full) or nothing (compact) without a voice-clone reference, else
    <audio_start> <audio_user_slot> x L <audio_end> with the reference codes [L, n_vq] on the
    slot rows. Callers holding a prompt from the upstream processor pass `prompt_ids` plus
    `prompt_codes` (its code columns, upstream `codes.ref`) and no layout is applied.
    Generation starts from the hidden state of the final <audio_start> row.
    """
    pad = cfg.audio_pad_token_id
    if inputs.prompt_ids is not None:
        ids = list(inputs.prompt_ids)
        if not ids:
            raise ValueError("empty prompt_ids")
        codes = inputs.prompt_codes if inputs.prompt_codes is not None else torch.full((len(ids), cfg.n_vq), pad)
        check_codes(cfg, codes, len(ids), "prompt_codes")
        _check_ids(cfg, ids)
        return ids, codes.clone()
    if tokenizer is None:
        raise ValueError("this config has no built-in tokenizer: construct the model with tokenizer= or pass "
                         "MossInputs(prompt_ids=...) built by the upstream processor")
    text = list(inputs.text_ids) if inputs.text_ids is not None else tokenizer.encode(inputs.text or "")
    if not text:
        raise ValueError("empty text: MOSS-TTS Local needs at least one text token")
    enc = tokenizer.encode
    pieces: list[tuple[list[int], torch.Tensor | None]] = []  # (ids, codes of those rows or None = pad)
    pieces.append(([cfg.im_start_token_id] + enc("user\n"), None))
    if cfg.prompt_template == "full":
        pieces.append((enc("<user_inst>\n- Reference(s):\n"), None))
    ref = inputs.reference_codes
    if ref is not None:
        check_codes(cfg, ref, None, "reference_codes")
        pieces.append(([cfg.audio_start_token_id], None))
        pieces.append(([cfg.audio_user_slot_token_id] * ref.shape[0], ref))
        pieces.append(([cfg.audio_end_token_id], None))
    elif cfg.prompt_template == "full":
        pieces.append((enc("None"), None))
    if cfg.prompt_template == "full":
        pieces.append((enc(_AFTER_REFERENCE.format(language=(inputs.language or "").strip() or "None")), None))
    pieces.append((text, None))
    if cfg.prompt_template == "full":
        pieces.append((enc("\n</user_inst>"), None))
    pieces.append(([cfg.im_end_token_id] + enc("\n") + [cfg.im_start_token_id] + enc("assistant\n")
                   + [cfg.audio_start_token_id], None))
    ids: list[int] = []
    code_parts = []
    for piece_ids, piece_codes in pieces:
        ids.extend(piece_ids)
        code_parts.append(piece_codes if piece_codes is not None else torch.full((len(piece_ids), cfg.n_vq), pad))
    _check_ids(cfg, ids)
    return ids, torch.cat(code_parts, dim=0).to(torch.int64)


def _check_ids(cfg: MossTTSLocalConfig, ids: list[int]) -> None:
    bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ValueError(f"text ids outside the text vocab [0, {cfg.vocab_size}): {bad[:8]}")
