"""Higgs Audio v3 checkpoints: config.json + (sharded) safetensors with the upstream HF checkpoint's names."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from models.safetensors_files import CheckpointError, load_by_name, weight_files  # noqa: F401  (CheckpointError re-exported)

from .adapter import HiggsAudioV3Talker
from .config import HiggsAudioV3Config

# Released-checkpoint tensors the talker does not hold (vllm-omni's loader skips the same):
# the codec bundled for code2wav, the text head (tied to the text embedding; audio mode
# never samples text) and the audio head (tied to the audio table, which we hold).
IGNORED_PREFIXES = ("tied.embedding.modality_embeddings.0.model.", "tied.head.")


def save_checkpoint(model: HiggsAudioV3Talker, directory: str | Path) -> Path:
    """Write config.json and model.safetensors (upstream tensor names) into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.module.state_dict().items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def load_checkpoint(directory: str | Path, *, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", config: HiggsAudioV3Config | None = None,
                    **model_kwargs) -> HiggsAudioV3Talker:
    """Build the model (from `config`, else the directory's config.json) and fill every parameter.

    Raises CheckpointError naming every missing, unexpected or shape-mismatched tensor
    (checked before any tensor data is read).
    """
    directory = Path(directory)
    if config is None:
        config = HiggsAudioV3Config.from_hf_dict(json.loads((directory / "config.json").read_text()))
    model = HiggsAudioV3Talker(config, dtype=dtype, device=device, init_weights=False, **model_kwargs)
    load_by_name(model.module.state_dict(), directory, weight_files(directory), dtype,
                 skip=lambda key: key.startswith(IGNORED_PREFIXES))
    return model
