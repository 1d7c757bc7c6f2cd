"""Qwen3-TTS talker (CB0) + code predictor (CB1..15) as an mtp_fsm TalkerModel."""

from .adapter import Qwen3TTSTalker
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .config import CodePredictorConfig, Qwen3TTSConfig, UnsupportedConfigError, config_0_6b, config_1_7b, tiny_config
from .prompt import ByteTextTokenizer, TTSInputs

__all__ = [
    "ByteTextTokenizer",
    "CheckpointError",
    "CodePredictorConfig",
    "Qwen3TTSConfig",
    "Qwen3TTSTalker",
    "TTSInputs",
    "UnsupportedConfigError",
    "config_0_6b",
    "config_1_7b",
    "load_checkpoint",
    "save_checkpoint",
    "tiny_config",
]


def tiny_demo_talker(seed: int = 0, **kwargs) -> Qwen3TTSTalker:
    """The tiny, seeded, randomly initialised talker that `make demo` and the tests run."""
    return Qwen3TTSTalker(tiny_config(), seed=seed, **kwargs)


def text_inputs(text: str) -> TTSInputs:
    """Request inputs for plain text (the serving CLI's plugin hook)."""
    return TTSInputs(text=text)


__all__ += ["tiny_demo_talker", "text_inputs"]

# The codec decoder (codes -> PCM) this talker declares, resolved by name (mtp_fsm.serving.codec.load_decoder).
CODEC_DECODER = "models.qwen3_tts.codec:tiny_demo_decoder"
