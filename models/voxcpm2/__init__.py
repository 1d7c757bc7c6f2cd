"""VoxCPM2 (MiniCPM-4 base + residual LM, FSQ, patch encoder, CFM local DiT) as an mtp_fsm TalkerModel."""

from .adapter import VoxCPM2Inputs, VoxCPM2Talker
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .config import LocalConfig, MiniCPM4Config, VoxCPM2Config, tiny_config, voxcpm2_config
from .core import STOP_TOKEN, VoxCPM2Core, VoxCPM2Model, byte_tokenize

__all__ = [
    "STOP_TOKEN",
    "CheckpointError",
    "LocalConfig",
    "MiniCPM4Config",
    "VoxCPM2Config",
    "VoxCPM2Core",
    "VoxCPM2Inputs",
    "VoxCPM2Talker",
    "VoxCPM2Model",
    "byte_tokenize",
    "load_checkpoint",
    "save_checkpoint",
    "tiny_config",
    "voxcpm2_config",
]

# The tiny random stop head mostly says "stop" as soon as it may: a longer minimum (an
# engine-side setting, not an upstream weight) gives the demo a dozen patches per request.
TINY_DEMO_MIN_LEN = 11


def tiny_demo_talker(seed: int = 0, **kwargs) -> VoxCPM2Talker:
    """The tiny, seeded, randomly initialised VoxCPM2 that the demo and the tests run."""
    return VoxCPM2Talker(tiny_config(min_len=TINY_DEMO_MIN_LEN), seed=seed, **kwargs)


def text_inputs(text: str) -> VoxCPM2Inputs:
    """Request inputs for plain text (the serving CLI's plugin hook)."""
    return VoxCPM2Inputs(text=text)


__all__ += ["TINY_DEMO_MIN_LEN", "tiny_demo_talker", "text_inputs"]

# The codec decoder (codes -> PCM) this talker declares, resolved by name (mtp_fsm.serving.codec.load_decoder).
CODEC_DECODER = "models.voxcpm2.codec:tiny_demo_decoder"
