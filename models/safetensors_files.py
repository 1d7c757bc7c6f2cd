"""Checkpoint safetensors shared by the adapters: locating the files, matching and loading tensors by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not match the model built from its config.json."""


def weight_files(directory: Path) -> list[Path]:
    """The shards a model.safetensors.index.json names, else every *.safetensors file."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [directory / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {directory}")
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise CheckpointError(f"shards named by the index are missing: {missing}")
    return files


def check_match(directory: Path, missing: list[str], unexpected: list[str], mismatched: list[str],
                noun: str = "keys") -> None:
    """Raise CheckpointError listing what does not match (missing, unexpected, wrong shape), if anything."""
    if not (missing or unexpected or mismatched):
        return
    parts = []
    if missing:
        parts.append(f"missing {noun}: {missing}")
    if unexpected:
        parts.append(f"unexpected {noun}: {sorted(set(unexpected))}")
    if mismatched:
        parts.append(f"shape mismatches: {mismatched}")
    raise CheckpointError(f"checkpoint {directory} does not match its config: " + "; ".join(parts))


def load_by_name(params: dict[str, torch.Tensor], directory: Path, files: list[Path], dtype: torch.dtype,
                 skip: Callable[[str], bool] = lambda key: False, noun: str = "tensors") -> None:
    """Fill `params` (a module's state_dict) from the safetensors `files` by tensor name.

    Every name is checked before any tensor data is read: a missing, unexpected or
    mis-shaped tensor raises CheckpointError naming each one. `skip(key)` marks checkpoint
    tensors the model does not hold (e.g. training-only heads)."""
    located: dict[str, Path] = {}
    unexpected: list[str] = []
    mismatched: list[str] = []
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                if skip(key):
                    continue
                if key not in params:
                    unexpected.append(key)
                    continue
                shape = tuple(handle.get_slice(key).get_shape())
                if shape != tuple(params[key].shape):
                    mismatched.append(f"{key}: checkpoint {shape} vs model {tuple(params[key].shape)}")
                located[key] = path
    check_match(directory, sorted(set(params) - set(located)), unexpected, mismatched, noun=noun)
    by_file: dict[Path, list[str]] = {}
    for key, path in located.items():
        by_file.setdefault(path, []).append(key)
    with torch.no_grad():
        for path, keys in by_file.items():
            with safe_open(str(path), framework="pt") as handle:
                for key in keys:
                    params[key].copy_(handle.get_tensor(key).to(dtype))
