"""MOSS-TTS Local has no audio output here: its v2 audio tokenizer's decoder is not published as a package (the refusal, by name)."""

from __future__ import annotations

from models.codec_support import refusing_decoder

MISSING = ("its 12 x 1024 codes come from the MOSS v2 audio tokenizer, whose decoder is not packaged on its own "
           "(moss-tts-lite's MossCodecDecoder decodes the different v1 tokenizer, about 0.9B hard-coded); "
           "its codes are served as codes only")


tiny_demo_decoder = load_decoder = refusing_decoder("moss_tts_local", MISSING)
