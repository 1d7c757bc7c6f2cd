"""Qwen3-TTS voice clone: x-vector and reference-code checks, and the ICL prompt layout."""

from __future__ import annotations

from typing import Callable

import torch

from .config import Qwen3TTSConfig

Embed = Callable[[list[int]], torch.Tensor]


def check_speaker_embedding(cfg: Qwen3TTSConfig, value: object) -> torch.Tensor:
    """The x-vector as given: a finite floating tensor [hidden_size]."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"speaker_embedding must be a torch.Tensor [{cfg.hidden_size}], got {type(value).__name__}")
    if not value.is_floating_point():
        raise ValueError(f"speaker_embedding must have a floating dtype, got {value.dtype}")
    if tuple(value.shape) != (cfg.hidden_size,):
        raise ValueError(f"speaker_embedding must have shape [{cfg.hidden_size}] (the talker hidden size), "
                         f"got {list(value.shape)}")
    if not bool(torch.isfinite(value).all()):
        raise ValueError("speaker_embedding holds NaN or infinite values")
    return value.detach()


def check_ref_codes(cfg: Qwen3TTSConfig, value: object) -> torch.Tensor:
    """The reference codes as int64 [T, Q]: T >= 1 frames, every code in [0, codebook_size)."""
    q, size = cfg.num_code_groups, cfg.codebook_size
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"ref_codes must be an integer torch.Tensor [T, {q}], got {type(value).__name__}")
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise ValueError(f"ref_codes must have an integer dtype, got {value.dtype}")
    if value.dim() != 2 or value.shape[1] != q or value.shape[0] < 1:
        raise ValueError(f"ref_codes must have shape [T, {q}] with T >= 1, got {list(value.shape)}")
    codes = value.detach().to(torch.int64)
    bad = (codes < 0) | (codes >= size)
    if bool(bad.any()):
        frame, group = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"ref_codes holds {int(bad.sum())} codes outside the codebook [0, {size}), first "
                         f"{int(codes[frame, group])} at frame {frame}, codebook {group}")
    return codes


def icl_layout(cfg: Qwen3TTSConfig, text: list[int], ref_text: list[int], ref_codes: torch.Tensor, *,
               T: Embed, C: Embed, frames: Callable[[torch.Tensor], torch.Tensor], pad: torch.Tensor,
               eos: torch.Tensor, non_streaming: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt tail, trailing text) of upstream `generate_icl_prompt`; it follows the codec prefix.

    The text column is T(ref_text + text) then T(tts_eos) (L rows); the codec column is
    C(codec_bos) then one row per reference frame, codec_embedding(code_0) +
    sum_{g>=1} code_predictor.codec_embedding[g-1](code_g) (T+1 rows).

        non-streaming   text + C(codec_pad) for all L rows, then codec + T(tts_pad) for all T+1
                        rows; trailing T(tts_pad)
        streaming       the two columns summed row by row: if L > T+1 the prompt takes the first
                        T+1 text rows and the rest is the trailing text; otherwise the text is
                        padded with T(tts_pad) to T+1 rows and the trailing text is T(tts_pad)
    """
    text_col = torch.cat([T(ref_text + text), eos[None]])
    codec_col = torch.cat([C([cfg.codec_bos_id]), frames(ref_codes)])
    n_text, n_codec = text_col.shape[0], codec_col.shape[0]
    if non_streaming:
        tail = torch.cat([text_col + C([cfg.codec_pad_id]), codec_col + pad])
        return tail, pad[None]
    if n_text > n_codec:
        return text_col[:n_codec] + codec_col, text_col[n_codec:]
    padded = torch.cat([text_col, pad.expand(n_codec - n_text, -1)])
    return padded + codec_col, pad[None]
