"""VoxCPM2 checkpoints: config.json + model.safetensors with upstream names (the AudioVAE file is separate)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.safetensors_files import CheckpointError, check_match, weight_files

from .config import VoxCPM2Config
from .core import VoxCPM2Core

# Upstream from_local merges audiovae.safetensors / audiovae.pth under this prefix; a
# checkpoint re-saved from a full upstream model carries it. The talker does not use it.
IGNORED_PREFIXES = ("audio_vae.",)


def save_checkpoint(core: VoxCPM2Core, directory: str | Path) -> Path:
    """Write config.json and model.safetensors (upstream names) into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(core.config.to_hf_dict(), indent=2) + "\n")
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in core.module.state_dict().items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def load_checkpoint(directory: str | Path, *, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", model_cls: type[VoxCPM2Core] | None = None,
                    **core_kwargs) -> VoxCPM2Core:
    """Build the core from config.json and fill every parameter from the safetensors files.

    Raises CheckpointError naming every missing, unexpected or mis-shaped tensor, checked
    from the file headers before any tensor data is read.
    """
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"no config.json in {directory}")
    config = VoxCPM2Config.from_hf_dict(json.loads(config_path.read_text()))
    # model_cls: the class to build (default VoxCPM2Core; VoxCPM2Talker for the engine).
    core = (model_cls or VoxCPM2Core)(config, dtype=dtype, device=device, init_weights=False, **core_kwargs)
    params = core.module.state_dict()
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
    check_match(directory, sorted(set(params) - set(located)), unexpected, mismatched, noun="tensors")
    by_file: dict[Path, list[str]] = {}
    for key, path in located.items():
        by_file.setdefault(path, []).append(key)
    with torch.no_grad():
        for path, keys in by_file.items():
            with safe_open(str(path), framework="pt") as handle:
                for key in keys:
                    params[key].copy_(handle.get_tensor(key).to(dtype))
    return core
