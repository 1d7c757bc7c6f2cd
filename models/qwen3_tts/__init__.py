"""Qwen3-TTS talker (CB0) + code predictor (CB1..15) as an mtp_fsm TalkerModel."""

from .adapter import Qwen3TTSTalker
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .config import CodePredictorConfig, Qwen3TTSConfig, config_0_6b, config_1_7b, tiny_config
from .prompt import ByteTextTokenizer, TTSInputs

__all__ = [
    "ByteTextTokenizer",
    "CheckpointError",
    "CodePredictorConfig",
    "Qwen3TTSConfig",
    "Qwen3TTSTalker",
    "TTSInputs",
    "config_0_6b",
    "config_1_7b",
    "load_checkpoint",
    "save_checkpoint",
    "tiny_config",
]
