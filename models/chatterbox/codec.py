"""Chatterbox has no audio output here: its S3Gen decoder cannot run beside this project's pins (the refusal, by name)."""

from __future__ import annotations

from models.codec_support import refusing_decoder

MISSING = ("its decoder, S3Gen S3Token2Wav (chatterbox-tts 0.1.7), pins torch 2.6 (this project runs torch 2.13) "
           "and exists only at full size (263M parameters, a flow-matching vocoder, no size knobs): it needs a "
           "side environment of its own, not built here; its speech tokens are served as codes only")


tiny_demo_decoder = load_decoder = refusing_decoder("chatterbox", MISSING)
