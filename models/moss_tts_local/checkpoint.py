"""HF-format checkpoints for MOSS-TTS Local: config.json + (sharded) safetensors with upstream parameter names."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from models.safetensors_files import CheckpointError, load_by_name, weight_files

from .adapter import MossTTSLocalTalker
from .config import MossTTSLocalConfig

# The full-vocabulary text LM head: upstream declares it and ties it to the text embedding
# (`tie_weights`: text_lm_head.weight is transformer.embed_tokens.weight), so a checkpoint
# carries it and a loader of the upstream class requires it; at inference it is never
# consulted (the binary local head decides the text channel), so loading ignores it.
TEXT_LM_HEAD, TIED_TO = "text_lm_head.weight", "transformer.embed_tokens.weight"
IGNORED_KEYS = (TEXT_LM_HEAD,)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # non-persistent RoPE buffers


def save_checkpoint(model: MossTTSLocalTalker, directory: str | Path) -> Path:
    """Write config.json and model.safetensors (upstream parameter names) into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.module.state_dict().items()}
    tensors[TEXT_LM_HEAD] = tensors[TIED_TO].clone()  # safetensors stores no shared tensors
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
    load_by_name(model.module.state_dict(), directory, weight_files(directory), dtype, skip=_ignored, noun="keys")
    return model
