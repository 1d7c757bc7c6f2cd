"""Qwen3-Omni MoE talker (CB0) + code predictor (CB1..15), fed thinker rows, as an mtp_fsm TalkerModel."""

from .adapter import Qwen3OmniTalker
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .config import Qwen3OmniConfig, config_30b_a3b, tiny_config
from .prompt import STAND_IN, OmniInputs, ThinkerStandIn, thinker_embed, thinker_rows, thinker_table

__all__ = [
    "CheckpointError",
    "OmniInputs",
    "Qwen3OmniConfig",
    "Qwen3OmniTalker",
    "STAND_IN",
    "ThinkerStandIn",
    "config_30b_a3b",
    "load_checkpoint",
    "save_checkpoint",
    "thinker_embed",
    "thinker_rows",
    "thinker_table",
    "tiny_config",
]


def tiny_demo_talker(seed: int = 0, **kwargs) -> Qwen3OmniTalker:
    """The tiny, seeded, randomly initialised talker (stand-in thinker) that demos and tests run."""
    return Qwen3OmniTalker(tiny_config(), seed=seed, **kwargs)


def text_inputs(text: str) -> OmniInputs:
    """Request inputs for plain text (the serving CLI's plugin hook): the prompt side comes from the
    stand-in thinker; the rest of the text is the conditioning feed, all of it at admission (done)."""
    return OmniInputs(text=text)


__all__ += ["tiny_demo_talker", "text_inputs"]

# The codec decoder (codes -> PCM) this talker declares, resolved by name (mtp_fsm.serving.codec.load_decoder).
CODEC_DECODER = "models.qwen3_omni.codec:tiny_demo_decoder"
