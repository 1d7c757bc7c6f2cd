"""CodecDecoder: the contract of a talker's codes-to-waveform decoder, and how a talker names its decoder."""

from __future__ import annotations

import math
import pkgutil
from typing import Any, Protocol, Sequence, runtime_checkable

import attrs
import torch

from ..errors import MtpFsmError
from .model_loader import MODEL_NAMES, ModelLoadError, resolve

# The attribute of a talker's package naming its decoder factory ("package.module:factory").
DECODER_ATTRIBUTE = "CODEC_DECODER"


class CodecUnavailableError(MtpFsmError):
    """A talker whose audio output cannot be produced here (no decoder, or one that is missing a part)."""

    def __init__(self, talker: str, missing: str) -> None:
        self.talker = talker
        super().__init__(f"talker {talker!r} has no audio output: {missing}")


@runtime_checkable
class CodecDecoder(Protocol):
    """Turns windows of a request's published frame rows into float32 PCM (mono).

    decode(frames, final) takes int64 [B, W, frame_width] rows: each window is frames
    [a, a + W) of one request, whose first rows are left context. It returns float32
    [B, S] samples aligned to the frame grid from the window's start: sample i is the
    request's sample a * samples_per_frame + i. For final=False, S counts only the samples
    the window determines exactly (a decoder with trimmed tails, lookahead or a delay
    pattern returns fewer than W * samples_per_frame); for final=True (the window ends the
    request) S covers the whole end of the stream.

    left_context_frames: how many frames before the first frame not yet turned into audio
    a window must start, so every sample it is asked for is exact (the receptive field
    plus the frames a window holds back). lookahead_frames: how many of a window's last
    frames produce no exact audio until later frames arrive (0 for a causal decoder).
    max_batch: windows one decode call may take (1: the decoder cannot batch).
    """

    sample_rate: int
    samples_per_frame: int
    left_context_frames: int
    lookahead_frames: int
    max_batch: int

    def decode(self, frames: torch.Tensor, final: bool) -> torch.Tensor | Sequence[torch.Tensor]: ...


def _positive(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"{attribute.name} must be an int >= 1, got {value!r}")


def _non_negative(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if type(value) is not int or value < 0:
        raise ValueError(f"{attribute.name} must be an int >= 0, got {value!r}")


@attrs.frozen
class DecoderTiming:
    """The facts of a decoder the streaming stage needs, validated once."""

    sample_rate: int = attrs.field(validator=_positive)
    samples_per_frame: int = attrs.field(validator=_positive)
    left_context_frames: int = attrs.field(validator=_non_negative)
    lookahead_frames: int = attrs.field(validator=_non_negative)
    max_batch: int = attrs.field(validator=_positive)

    @classmethod
    def of(cls, decoder: CodecDecoder) -> "DecoderTiming":
        missing = [n for n in ("sample_rate", "samples_per_frame", "left_context_frames", "lookahead_frames",
                               "max_batch", "decode") if not hasattr(decoder, n)]
        if missing:
            raise TypeError(f"{type(decoder).__name__} is not a CodecDecoder: it lacks {missing}")
        return cls(decoder.sample_rate, decoder.samples_per_frame, decoder.left_context_frames,
                   decoder.lookahead_frames, decoder.max_batch)

    @property
    def first_chunk_frames(self) -> int:
        """The smallest first chunk that yields audio: the held-back frames plus one."""
        return self.lookahead_frames + 1

    def seconds(self, num_samples: int) -> float:
        return num_samples / self.sample_rate


def frames_for(receptive_samples: int, samples_per_frame: int) -> int:
    """Frames covering `receptive_samples` samples (rounded up)."""
    return math.ceil(receptive_samples / samples_per_frame) if receptive_samples > 0 else 0


def decoder_factory_name(talker: str) -> str:
    """The import string of the decoder factory a talker declares (its package's CODEC_DECODER)."""
    spec = MODEL_NAMES.get(talker, talker)
    module_name = spec.partition(":")[0]
    try:
        module = pkgutil.resolve_name(module_name)
    except ImportError as exc:
        raise ModelLoadError(f"talker {talker!r}: cannot import {module_name!r}: {exc}") from exc
    name = getattr(module, DECODER_ATTRIBUTE, None)
    if name is None:
        raise CodecUnavailableError(talker, f"its module {module_name!r} declares no {DECODER_ATTRIBUTE}")
    return name


def load_decoder(talker: str, seed: int = 0, *, kwargs: dict[str, Any] | None = None) -> CodecDecoder:
    """The decoder `talker` declares, built by its factory with `seed` (tiny, seeded) or with
    `kwargs` instead (e.g. a checkpoint loader's `directory`)."""
    factory = resolve(decoder_factory_name(talker))
    decoder = factory(seed=seed) if kwargs is None else factory(**kwargs)
    DecoderTiming.of(decoder)  # a factory returning something else fails here, by name
    return decoder
