"""Locating a checkpoint's safetensors files (single file or sharded index), shared by the adapters."""

from __future__ import annotations

import json
from pathlib import Path


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
