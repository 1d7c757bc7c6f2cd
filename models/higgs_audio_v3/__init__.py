"""Higgs Audio v3 (Qwen3 backbone, fused 8-codebook head, delay pattern, no MTP) as an mtp_fsm TalkerModel."""

from .adapter import HiggsAudioV3Talker
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .config import HiggsAudioV3Config, tiny_config, v3_config
from .prompt import ByteTextTokenizer, HiggsInputs

__all__ = [
    "ByteTextTokenizer",
    "CheckpointError",
    "HiggsAudioV3Config",
    "HiggsAudioV3Talker",
    "HiggsInputs",
    "load_checkpoint",
    "save_checkpoint",
    "tiny_config",
    "v3_config",
]


def tiny_demo_talker(seed: int = 0, **kwargs) -> HiggsAudioV3Talker:
    """The tiny, seeded, randomly initialised Higgs talker that the demo and the tests run."""
    return HiggsAudioV3Talker(tiny_config(), seed=seed, **kwargs)


def text_inputs(text: str) -> HiggsInputs:
    """Request inputs for plain text (the serving CLI's plugin hook)."""
    return HiggsInputs(text=text)


__all__ += ["tiny_demo_talker", "text_inputs"]

# The codec decoder (codes -> PCM) this talker declares, resolved by name (mtp_fsm.serving.codec.load_decoder).
CODEC_DECODER = "models.higgs_audio_v3.codec:tiny_demo_decoder"
