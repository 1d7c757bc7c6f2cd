"""MOSS-TTS Local has no audio output here: its v2 audio tokenizer's decoder is not published as a package (the refusal, by name)."""

from __future__ import annotations

from mtp_fsm.serving.codec import CodecUnavailableError

MISSING = ("its 12 x 1024 codes come from the MOSS v2 audio tokenizer, whose decoder is not packaged on its own "
           "(moss-tts-lite's MossCodecDecoder decodes the different v1 tokenizer, about 0.9B hard-coded); "
           "its codes are served as codes only")


def tiny_demo_decoder(seed: int = 0, **_: object):
    """Refuses: see MISSING."""
    raise CodecUnavailableError("moss_tts_local", MISSING)


load_decoder = tiny_demo_decoder
