"""Chatterbox Turbo T3 (GPT-2 backbone, one speech codebook, no MTP) as an mtp_fsm TalkerModel."""

from .adapter import ChatterboxTalker
from .checkpoint import UPSTREAM_FILE, CheckpointError, load_checkpoint, save_checkpoint
from .config import ChatterboxConfig, tiny_config, turbo_config
from .prompt import ByteTextTokenizer, ChatterboxInputs, demo_conditioning

__all__ = [
    "ByteTextTokenizer",
    "ChatterboxConfig",
    "ChatterboxInputs",
    "ChatterboxTalker",
    "CheckpointError",
    "UPSTREAM_FILE",
    "demo_conditioning",
    "load_checkpoint",
    "save_checkpoint",
    "tiny_config",
    "turbo_config",
]


def tiny_demo_talker(seed: int = 0, **kwargs) -> ChatterboxTalker:
    """The tiny, seeded, randomly initialised T3 that the demo and the tests run."""
    return ChatterboxTalker(tiny_config(), seed=seed, **kwargs)


def text_inputs(text: str) -> ChatterboxInputs:
    """Request inputs for plain text with the fixed demo voice (the serving CLI's plugin hook)."""
    speaker, tokens = demo_conditioning(tiny_config())
    return ChatterboxInputs(text=text, speaker_emb=speaker, cond_tokens=tokens)


__all__ += ["tiny_demo_talker", "text_inputs"]

# The codec decoder (codes -> PCM) this talker declares, resolved by name (mtp_fsm.serving.codec.load_decoder).
CODEC_DECODER = "models.chatterbox.codec:tiny_demo_decoder"
