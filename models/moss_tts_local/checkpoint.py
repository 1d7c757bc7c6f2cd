"""HF-format checkpoints for MOSS-TTS Local: config.json + (sharded) safetensors with upstream parameter names."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.safetensors_files import CheckpointError, check_match, weight_files

from .adapter import MossTTSLocalTalker
from .config import MossTTSLocalConfig

# Checkpoint tensors the adapter does not use: the text LM head (never consulted at
# inference; the binary local head decides the text channel) and non-persistent RoPE buffers.
IGNORED_KEYS = ("text_lm_head.weight",)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def save_checkpoint(model: MossTTSLocalTalker, directory: str | Path) -> Path:
    """Write config.json and model.safetensors (upstream parameter names) into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.module.state_dict().items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def _ignored(key: str) -> bool:
    return key in IGNORED_KEYS or key.endswith(IGNORED_SUFFIXES)


def load_checkpoint(directory: str | Path, *, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", **model_kwargs) -> MossTTSLocalTalker:
    """Build the model from config.json and fill every parameter from the safetensors files.

    Raises CheckpointError naming every missing, unexpected or shape-mismatched key
    (checked from the headers before any tensor data is read).
    """
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"no config.json in {directory}")
    config = MossTTSLocalConfig.from_hf_dict(json.loads(config_path.read_text()))
    model = MossTTSLocalTalker(config, dtype=dtype, device=device, init_weights=False, **model_kwargs)
    params = model.module.state_dict()
    located: dict[str, Path] = {}
    unexpected: list[str] = []
    mismatched: list[str] = []
    for path in weight_files(directory):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                if _ignored(key):
                    continue
                if key not in params:
                    unexpected.append(key)
                    continue
                shape = tuple(handle.get_slice(key).get_shape())
                if shape != tuple(params[key].shape):
                    mismatched.append(f"{key}: checkpoint {shape} vs model {tuple(params[key].shape)}")
                located[key] = path
    missing = sorted(set(params) - set(located))
    check_match(directory, missing, unexpected, mismatched)
    by_file: dict[Path, list[str]] = {}
    for key, path in located.items():
        by_file.setdefault(path, []).append(key)
    with torch.no_grad():
        for path, keys in by_file.items():
            with safe_open(str(path), framework="pt") as handle:
                for key in keys:
                    params[key].copy_(handle.get_tensor(key).to(dtype))
    return model
