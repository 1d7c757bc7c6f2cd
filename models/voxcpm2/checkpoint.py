"""VoxCPM2 checkpoints: config.json + model.safetensors with upstream names (the AudioVAE file is separate)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from models.safetensors_files import CheckpointError, load_by_name, weight_files  # noqa: F401  (re-exported)

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
    load_by_name(core.module.state_dict(), directory, weight_files(directory), dtype,
                 skip=lambda key: key.startswith(IGNORED_PREFIXES))
    return core
