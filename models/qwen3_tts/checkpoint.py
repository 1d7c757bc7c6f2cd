"""HF-format checkpoints for Qwen3-TTS: config.json + (sharded) safetensors with upstream names."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from models.safetensors_files import CheckpointError, load_by_name, weight_files  # noqa: F401  (CheckpointError re-exported)

from .adapter import Qwen3TTSTalker
from .config import Qwen3TTSConfig

# Parts of a full upstream checkpoint the talker adapter does not use (the Base model's
# speaker encoder; the speech tokenizer normally lives in its own subfolder).
IGNORED_PREFIXES = ("speaker_encoder.", "speech_tokenizer.")

# generation_config.json of the released checkpoints. Upstream's from_pretrained refuses a
# directory without it; it holds upstream's sampling defaults (this engine takes sampling
# per request, so load_checkpoint does not read it).
GENERATION_CONFIG = {
    "do_sample": True, "repetition_penalty": 1.05, "temperature": 0.9, "top_p": 1.0, "top_k": 50,
    "subtalker_dosample": True, "subtalker_temperature": 0.9, "subtalker_top_p": 1.0, "subtalker_top_k": 50,
    "max_new_tokens": 8192,
}


def save_checkpoint(model: Qwen3TTSTalker, directory: str | Path) -> Path:
    """Write config.json, generation_config.json and model.safetensors (upstream parameter
    names) into `directory`. The speech tokenizer (codec) is a separate model, not written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
    (directory / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.module.state_dict().items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def load_checkpoint(directory: str | Path, *, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", **model_kwargs) -> Qwen3TTSTalker:
    """Build the model from config.json and fill every parameter from the safetensors files.

    Raises CheckpointError naming every missing, unexpected or shape-mismatched key
    (checked before any tensor data is read).
    """
    directory = Path(directory)
    config = Qwen3TTSConfig.from_hf_dict(json.loads((directory / "config.json").read_text()))
    model = Qwen3TTSTalker(config, dtype=dtype, device=device, init_weights=False, **model_kwargs)
    load_by_name(model.module.state_dict(), directory, weight_files(directory), dtype, skip=lambda key: key.startswith(IGNORED_PREFIXES), noun="keys")
    return model
