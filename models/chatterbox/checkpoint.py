"""Chatterbox T3 checkpoints: config.json + safetensors with upstream T3 names (reads the released t3_turbo_v1 file)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from models.safetensors_files import CheckpointError, load_by_name

from .adapter import ChatterboxTalker
from .config import ChatterboxConfig

# The released T3 weights next to the other Turbo files (ve, s3gen_meanflow, tokenizer).
UPSTREAM_FILE = "t3_turbo_v1.safetensors"
# Upstream tensors the adapter does not hold: `tfmr.wte` (deleted by upstream after loading:
# T3 feeds embeddings), `text_head` (the training-only text loss), and the causal-mask
# buffers older HF GPT-2 versions saved with their weights.
IGNORED = re.compile(r"^(tfmr\.wte\.|text_head\.)|\.attn\.(masked_)?bias$")


def save_checkpoint(model: ChatterboxTalker, directory: str | Path, *, upstream_strict: bool = False) -> Path:
    """Write config.json and model.safetensors (upstream T3 parameter names) into `directory`.

    upstream_strict: also write zero `tfmr.wte.weight` and `text_head.weight`, so that
    upstream's `T3.load_state_dict` (strict) accepts the file; neither is used at inference.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.module.state_dict().items()}
    if upstream_strict:
        cfg, dtype = model.config, model.dtype
        tensors["tfmr.wte.weight"] = torch.zeros(cfg.gpt_vocab_size, cfg.hidden_size, dtype=dtype)
        tensors["text_head.weight"] = torch.zeros(cfg.text_tokens_dict_size, cfg.hidden_size, dtype=dtype)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def _weight_files(directory: Path) -> list[Path]:
    # Never glob *.safetensors: a Turbo download also holds ve.safetensors and s3gen weights.
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"shards named by the index are missing: {missing}")
        return files
    for name in ("model.safetensors", UPSTREAM_FILE):
        if (directory / name).exists():
            return [directory / name]
    raise CheckpointError(f"no model.safetensors, model.safetensors.index.json or {UPSTREAM_FILE} in {directory}")


def _config(directory: Path) -> ChatterboxConfig:
    """Our config.json, else the released Turbo T3: upstream hard-codes its hyper-parameters
    and ships no T3 config, so any other config.json there belongs to the tokenizer."""
    path = directory / "config.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    return ChatterboxConfig.from_hf_dict(data) if "tfmr_config" in data else ChatterboxConfig()


def load_checkpoint(directory: str | Path, *, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", config: ChatterboxConfig | None = None,
                    **model_kwargs) -> ChatterboxTalker:
    """Build the model (from `config`, else the directory's) and fill every parameter.

    Raises CheckpointError naming every missing, unexpected or shape-mismatched tensor
    (checked before any tensor data is read).
    """
    directory = Path(directory)
    config = config if config is not None else _config(directory)
    model = ChatterboxTalker(config, dtype=dtype, device=device, init_weights=False, **model_kwargs)
    load_by_name(model.module.state_dict(), directory, _weight_files(directory), dtype,
                 skip=lambda key: IGNORED.search(key) is not None)
    return model
