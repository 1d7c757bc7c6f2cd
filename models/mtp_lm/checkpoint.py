"""MTP LM checkpoints: config.json + safetensors with HF Qwen3 names and DeepSeek-V3 MTP names (`model.layers.N.*`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.safetensors_files import CheckpointError, load_by_name, weight_files

from .adapter import MtpLMTalker
from .config import MtpLMConfig


def shared_copies(config: MtpLMConfig) -> dict[str, str]:
    """DeepSeek-V3's per-MTP-layer copies of shared tensors -> the tensor they equal here."""
    n = config.num_hidden_layers
    return {f"model.layers.{n}.shared_head.head.weight": "lm_head.weight",
            f"model.layers.{n}.embed_tokens.weight": "model.embed_tokens.weight"}


def save_checkpoint(model: MtpLMTalker, directory: str | Path, *, with_shared_copies: bool = True) -> Path:
    """Write config.json and model.safetensors into `directory`.

    with_shared_copies: also write `model.layers.N.shared_head.head` and
    `model.layers.N.embed_tokens` (copies of lm_head and embed_tokens) as DeepSeek-V3's file
    does: vLLM's DeepSeekMTP loads its MTP head and embedding from them.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.module.state_dict().items()}
    if with_shared_copies:
        for copy, source in shared_copies(model.config).items():
            tensors[copy] = tensors[source].clone()  # safetensors refuses tensors sharing storage
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def load_checkpoint(directory: str | Path, *, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", config: MtpLMConfig | None = None,
                    **model_kwargs) -> MtpLMTalker:
    """Build the model (from `config`, else the directory's config.json) and fill every parameter.

    Raises CheckpointError naming every missing, unexpected or shape-mismatched tensor (checked
    before any tensor data is read), and any shared copy that differs from the tensor it must
    equal (the model ties them, so a different copy would be silently dropped otherwise).
    """
    directory = Path(directory)
    if config is None:
        path = directory / "config.json"
        if not path.exists():
            raise CheckpointError(f"no config.json in {directory}")
        config = MtpLMConfig.from_hf_dict(json.loads(path.read_text()))
    model = MtpLMTalker(config, dtype=dtype, device=device, init_weights=False, **model_kwargs)
    params, copies, files = model.module.state_dict(), shared_copies(config), weight_files(directory)
    load_by_name(params, directory, files, dtype, skip=lambda key: key in copies)
    differing = []
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                copy = handle.get_tensor(key).to(dtype) if key in copies else None
                if copy is not None and not (copy.shape == params[copies[key]].shape
                                             and torch.equal(copy, params[copies[key]])):
                    differing.append(f"{key} != {copies[key]}")
    if differing:
        raise CheckpointError(f"checkpoint {directory}: shared copies differ from the tied tensors "
                              f"(this model ties them): {differing}")
    return model
