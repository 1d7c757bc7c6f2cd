"""What the talkers' codec decoders share: seeded construction, code checks, final-window padding, loading by name, refusals."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable, Iterator, NoReturn

import torch
from torch import nn

from models.module_init import seeded_normal
from models.safetensors_files import CheckpointError, load_by_name, weight_files
from mtp_fsm.serving.codec import CodecUnavailableError


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Module construction under torch's global RNG seeded with `seed` (upstream modules draw their
    own init from it), leaving the caller's RNG state as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


@torch.no_grad()
def audible_init(module: nn.Module, seed: int, gain: float = 1.0) -> None:
    """Redraw every conv / linear weight N(0, gain^2 / fan-in) and every embedding N(0, 1), biases 0:
    upstream's inits (std 0.02) leave a tiny random decoder all but silent, a demo WAV inaudible and
    a chunked == whole check comparing near-zeros. Draws go through seeded_normal (the same numbers
    on every CPU kernel set)."""
    gen = torch.Generator().manual_seed(seed)
    for m in module.modules():
        if isinstance(m, nn.Embedding):
            m.weight.copy_(seeded_normal(m.weight.shape, gen))
        elif isinstance(m, (nn.Conv1d, nn.ConvTranspose1d, nn.Linear)):
            fan_in = m.weight[0].numel() if not isinstance(m, nn.ConvTranspose1d) else m.weight.shape[0] * m.weight.shape[2]
            m.weight.copy_(seeded_normal(m.weight.shape, gen, gain / fan_in ** 0.5))
            if m.bias is not None:
                m.bias.zero_()


def check_codes(codes: torch.Tensor, num_codebooks: int, codebook_size: int, what: str) -> None:
    """codes int64 [B, W, Q]: Q codebooks, every id in [0, codebook_size); ValueError saying which is wrong."""
    if codes.dim() != 3 or codes.shape[2] != num_codebooks:
        raise ValueError(f"{what}: expected frames [B, W, {num_codebooks}], got {tuple(codes.shape)}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= codebook_size):
        bad = codes[(codes < 0) | (codes >= codebook_size)]
        raise ValueError(f"{what}: code ids must be in [0, {codebook_size}), got {sorted(set(bad.tolist()))[:8]}")


def pad_to(pcm: torch.Tensor, length: int) -> torch.Tensor:
    """[B, S] -> [B, length]: zeros after the end (a final window's samples past what the decoder
    computes: upstream trims them, the stream ends in silence there)."""
    if pcm.shape[1] >= length:
        return pcm[:, :length]
    return torch.nn.functional.pad(pcm, (0, length - pcm.shape[1]))


def read_config(directory: Path, section: str | None = None) -> dict:
    """config.json of a checkpoint directory; `section` (e.g. "code2wav_config") when the decoder's
    config sits inside a bigger model's config, else the whole file."""
    path = directory / "config.json"
    if not path.exists():
        raise CheckpointError(f"no config.json in {directory}")
    data = json.loads(path.read_text())
    return data.get(section, data) if section is not None else data


def load_module(module: nn.Module, directory: str | Path, *, prefixes: tuple[str, ...] = ("",),
                ignore: tuple[str, ...] = (), dtype: torch.dtype = torch.float32) -> None:
    """Fill `module`'s parameters and persistent buffers from the directory's safetensors, by name.

    The checkpoint may hold the decoder under one of `prefixes` (e.g. "code2wav." in a full
    Qwen3-Omni checkpoint); tensors under other prefixes and names starting with `ignore`
    (e.g. an encoder the decoder does not use) are skipped. CheckpointError names every
    missing, unexpected or mis-shaped tensor."""
    directory = Path(directory)
    files = weight_files(directory)
    from safetensors import safe_open

    keys: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            keys.update(handle.keys())
    # The prefix is the one most of the module's names are found under.
    state = module.state_dict()
    prefix = max(prefixes, key=lambda p: sum(f"{p}{k}" in keys for k in state))
    params = {f"{prefix}{k}": v for k, v in state.items() if not k.startswith(ignore)}  # () ignores nothing
    skip_prefixes = tuple(f"{prefix}{i}" for i in ignore)

    def skip(key: str) -> bool:
        return not key.startswith(prefix) or key.startswith(skip_prefixes)

    load_by_name(params, directory, files, dtype, skip=skip, noun="decoder tensors")


def refusing_decoder(talker: str, missing: str) -> Callable[..., NoReturn]:
    """The decoder factory of a talker without audio output: every call (tiny or by checkpoint)
    raises CodecUnavailableError naming the talker and what is missing."""
    def refuse(*_: object, **__: object) -> NoReturn:
        raise CodecUnavailableError(talker, missing)

    refuse.__doc__ = f"Refuses: {talker} has no codec decoder here ({missing})."
    return refuse
