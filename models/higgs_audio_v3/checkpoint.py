"""Higgs Audio v3 checkpoints: config.json + (sharded) safetensors with the upstream HF checkpoint's names."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.safetensors_files import CheckpointError, check_match, weight_files  # noqa: F401  (CheckpointError re-exported)

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
    params = model.module.state_dict()
    located: dict[str, Path] = {}
    unexpected: list[str] = []
    mismatched: list[str] = []
    for path in weight_files(directory):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                if key.startswith(IGNORED_PREFIXES):
                    continue
                if key not in params:
                    unexpected.append(key)
                    continue
                shape = tuple(handle.get_slice(key).get_shape())
                if shape != tuple(params[key].shape):
                    mismatched.append(f"{key}: checkpoint {shape} vs model {tuple(params[key].shape)}")
                located[key] = path
    missing = sorted(set(params) - set(located))
    check_match(directory, missing, unexpected, mismatched, noun="tensors")
    by_file: dict[Path, list[str]] = {}
    for key, path in located.items():
        by_file.setdefault(path, []).append(key)
    with torch.no_grad():
        for path, keys in by_file.items():
            with safe_open(str(path), framework="pt") as handle:
                for key in keys:
                    params[key].copy_(handle.get_tensor(key).to(dtype))
    return model
