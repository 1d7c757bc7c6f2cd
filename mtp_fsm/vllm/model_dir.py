"""The model directory vLLM opens for a talker: a config.json it can parse, naming the talker the worker builds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from ..model_api import ModelSpec, TalkerModel
from ..serving.model_loader import LoadedTalker, load_talker

CONFIG_KEY = "mtp_fsm"
ARCHITECTURE = "MtpFsmTalkerForTTS"


def stop_token_id(spec: ModelSpec) -> int:
    """The CB0 id that tells vLLM a request stopped: the codec EOS, or one past the CB0
    vocabulary for a talker whose stop is not a CB0 token (vLLM never detokenizes it)."""
    return spec.eos_token_id if spec.eos_token_id is not None else spec.backbone_vocab_size


@attrs.frozen
class TalkerDirConfig:
    """What the worker needs to build the talker: a factory import string (or a short name
    of `models/`) with its keyword arguments, and the engine's kernel backend."""

    talker: str
    talker_kwargs: dict[str, Any] | None = None  # None: the factory is called with seed=seed
    seed: int = 0
    kernels: str = "torch"
    stop_token_id: int = 0
    # Speculative decoding: k drafts per decode row (vLLM's speculative_config plans them).
    speculate: int = 0

    @property
    def extra_positions(self) -> int:
        """vLLM's max_model_len for a talker of `max_context` KV positions: plus k + 1 under
        speculation, so vLLM never cuts a verify row short at the context's end (the engine
        ends the request there by itself)."""
        return self.speculate + 1 if self.speculate else 0

    def load_talker(self) -> LoadedTalker:
        return load_talker(self.talker, seed=self.seed, kwargs=self.talker_kwargs)

    @staticmethod
    def from_hf_config(hf_config: Any) -> "TalkerDirConfig":
        raw = getattr(hf_config, CONFIG_KEY, None)
        if not isinstance(raw, dict):
            raise ValueError(f"the model directory's config.json has no {CONFIG_KEY!r} section: it was not written by "
                             "mtp_fsm.vllm.write_model_dir")
        return TalkerDirConfig(**raw)


def write_model_dir(directory: str | Path, config: TalkerDirConfig, model: TalkerModel, *,
                    architecture: str = ARCHITECTURE) -> Path:
    """Write config.json (a `qwen3` config transformers can parse, architecture
    MtpFsmTalkerForTTS (the V1 worker route; mrv2 names its stand-in), the CB0 vocabulary, max positions = the talker's KV context) and
    generation_config.json (the stop id as EOS, so every request stops on it). vLLM reads
    nothing else from the directory: the worker loads the talker itself."""
    spec = model.spec
    layout = model.kv_cache_layout()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stop = stop_token_id(spec)
    hf = {
        "architectures": [architecture],
        "model_type": "qwen3",  # vLLM validates model_type against transformers
        "vocab_size": max(spec.backbone_vocab_size, stop + 1),
        "max_position_embeddings": spec.max_context + config.extra_positions,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": layout.num_layers if layout else 1,
        "num_attention_heads": layout.kv_heads if layout else 1,
        "num_key_value_heads": layout.kv_heads if layout else 1,
        "head_dim": layout.head_dim if layout else 1,
        "torch_dtype": str(spec.dtype).removeprefix("torch."),
        "eos_token_id": stop,
        CONFIG_KEY: attrs.asdict(attrs.evolve(config, stop_token_id=stop)),
    }
    (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": stop}, indent=2) + "\n")
    return directory
