"""HF-format checkpoints for the Qwen3-Omni talker: config.json + (sharded) safetensors with upstream names."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.safetensors_files import CheckpointError, check_match, weight_files  # noqa: F401  (CheckpointError re-exported)

from .adapter import Qwen3OmniTalker
from .config import Qwen3OmniConfig
from .prompt import thinker_table

# Parts of a full Qwen3-Omni checkpoint the talker adapter does not use. Of the thinker only
# the input-embedding rows of tts_bos / tts_eos / tts_pad are read (THINKER_EMBED).
IGNORED_PREFIXES = ("thinker.", "code2wav.")
THINKER_EMBED = "thinker.model.embed_tokens.weight"
# transformers >= 5 may store the experts fused: mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I].
_FUSED = re.compile(r"^(talker\.model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def save_checkpoint(model: Qwen3OmniTalker, directory: str | Path, *,
                    thinker_embed_tokens: torch.Tensor | None = None) -> Path:
    """Write config.json and model.safetensors (upstream names, per-expert layout) into `directory`.

    Besides `talker.*`, the file holds `thinker.model.embed_tokens.weight`, where the loader
    finds the tts_* rows: the stand-in thinker's table for stand-in configs, else the
    `thinker_embed_tokens` given (its tts_* rows must equal the model's).
    """
    cfg = model.config
    if thinker_embed_tokens is None:
        if not cfg.thinker_stand_in:
            raise ValueError("pass thinker_embed_tokens= (the thinker's input-embedding table) for a "
                             "model without the stand-in thinker")
        thinker_embed_tokens = thinker_table(cfg.thinker_hidden_size)
    ids = [cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id]
    expected = (cfg.thinker_vocab_size, cfg.thinker_hidden_size)
    if tuple(thinker_embed_tokens.shape) != expected:
        raise ValueError(f"thinker_embed_tokens must be {expected}, got {tuple(thinker_embed_tokens.shape)}")
    table = thinker_embed_tokens.detach().to("cpu", model.dtype).contiguous()
    if not torch.equal(table[ids], model.thinker_special_rows.to("cpu")):
        raise ValueError("thinker_embed_tokens' tts_bos/tts_eos/tts_pad rows differ from the model's")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.module.state_dict().items()}
    tensors[THINKER_EMBED] = table
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def _fused_names(key: str, shape: tuple[int, ...], cfg: Qwen3OmniConfig) -> tuple[tuple[int, ...], list[str]] | None:
    """For a fused experts tensor: (its expected shape, the per-expert parameters it fills); else None."""
    match = _FUSED.match(key)
    if match is None:
        return None
    base, kind = match.groups()
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    if kind == "gate_up_proj":
        return (e, 2 * i, h), [f"{base}.{x}.{n}.weight" for x in range(e) for n in ("gate_proj", "up_proj")]
    return (e, h, i), [f"{base}.{x}.down_proj.weight" for x in range(e)]


def load_checkpoint(directory: str | Path, *, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", **model_kwargs) -> Qwen3OmniTalker:
    """Build the model from config.json and fill every talker parameter from the safetensors files.

    Accepts the per-expert layout of released checkpoints and the fused layout of
    transformers >= 5. Raises CheckpointError naming every missing, unexpected or
    shape-mismatched key (checked before any tensor data is read).
    """
    directory = Path(directory)
    config = Qwen3OmniConfig.from_hf_dict(json.loads((directory / "config.json").read_text()))
    model = Qwen3OmniTalker(config, dtype=dtype, device=device, init_weights=False, **model_kwargs)
    params = model.module.state_dict()
    located: dict[str, tuple[Path, str]] = {}  # param -> (file, stored key)
    unexpected: list[str] = []
    mismatched: list[str] = []
    thinker: tuple[Path, tuple[int, ...]] | None = None
    for path in weight_files(directory):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                shape = tuple(handle.get_slice(key).get_shape())
                if key == THINKER_EMBED:
                    thinker = (path, shape)
                    continue
                if key.startswith(IGNORED_PREFIXES):
                    continue
                fused = _fused_names(key, shape, config)
                if fused is not None:
                    want, names = fused
                    if shape != want:
                        mismatched.append(f"{key}: checkpoint {shape} vs model {want}")
                    elif any(name not in params for name in names):
                        unexpected.append(key)
                    else:
                        located.update({name: (path, key) for name in names})
                    continue
                if key not in params:
                    unexpected.append(key)
                    continue
                if shape != tuple(params[key].shape):
                    mismatched.append(f"{key}: checkpoint {shape} vs model {tuple(params[key].shape)}")
                located[key] = (path, key)
    missing = sorted(set(params) - set(located))
    width = (config.thinker_vocab_size, config.thinker_hidden_size)
    if thinker is None:
        missing.append(f"{THINKER_EMBED} (its tts_bos/tts_eos/tts_pad rows condition the talker)")
    elif thinker[1] != width:
        mismatched.append(f"{THINKER_EMBED}: checkpoint {thinker[1]} vs config {width}")
    check_match(directory, missing, unexpected, mismatched)
    by_file: dict[Path, dict[str, list[str]]] = {}
    for name, (path, key) in located.items():
        by_file.setdefault(path, {}).setdefault(key, []).append(name)
    ids = [config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id]
    with torch.no_grad():
        for path, keys in by_file.items():
            with safe_open(str(path), framework="pt") as handle:
                for key, names in keys.items():
                    tensor = handle.get_tensor(key)
                    for name in names:
                        params[name].copy_(_part(key, name, tensor, config).to(dtype))
        with safe_open(str(thinker[0]), framework="pt") as handle:
            table = handle.get_slice(THINKER_EMBED)
            model.set_thinker_special_rows(torch.cat([table[i:i + 1] for i in ids]))
    return model


def _part(key: str, name: str, tensor: torch.Tensor, cfg: Qwen3OmniConfig) -> torch.Tensor:
    """The slice of a (possibly fused) stored tensor that fills parameter `name`."""
    if key == name:
        return tensor
    expert, proj = name.rsplit(".", 3)[1:3]
    e, i = int(expert), cfg.moe_intermediate_size
    if proj == "gate_proj":
        return tensor[e, :i]
    if proj == "up_proj":
        return tensor[e, i:]
    return tensor[e]
