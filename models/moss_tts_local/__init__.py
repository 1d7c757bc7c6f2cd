"""MOSS-TTS Local (Qwen3 backbone + local depth transformer with a binary stop head) as an mtp_fsm TalkerModel."""

from .adapter import MOSS_AUDIO_SAMPLING, MossTTSLocalTalker
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .config import LocalTransformerConfig, MossTTSLocalConfig, config_v1_5, tiny_config
from .prompt import MossByteTokenizer, MossInputs, build_prompt_rows

__all__ = [
    "MOSS_AUDIO_SAMPLING",
    "CheckpointError",
    "LocalTransformerConfig",
    "MossByteTokenizer",
    "MossInputs",
    "MossTTSLocalConfig",
    "MossTTSLocalTalker",
    "build_prompt_rows",
    "config_v1_5",
    "load_checkpoint",
    "save_checkpoint",
    "tiny_config",
]


def tiny_demo_talker(seed: int = 0, **kwargs) -> MossTTSLocalTalker:
    """The tiny, seeded, randomly initialised talker that demos and the tests run."""
    return MossTTSLocalTalker(tiny_config(), seed=seed, **kwargs)


def text_inputs(text: str) -> MossInputs:
    """Request inputs for plain text (the serving CLI's plugin hook)."""
    return MossInputs(text=text)


__all__ += ["tiny_demo_talker", "text_inputs"]

# The codec decoder (codes -> PCM) this talker declares, resolved by name (mtp_fsm.serving.codec.load_decoder).
CODEC_DECODER = "models.moss_tts_local.codec:tiny_demo_decoder"
