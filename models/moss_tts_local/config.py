"""MOSS-TTS Local (v1.5) backbone + local depth transformer configuration, presets and HF config.json mapping."""

from __future__ import annotations

from typing import Any

import attrs

TEMPLATES = ("full", "compact")


@attrs.frozen(kw_only=True)
class LocalTransformerConfig:
    """The per-frame depth transformer (upstream `gpt2_config`): GPT2-style blocks with
    LayerNorm + bias, fused QKV `c_attn`, interleaved RoPE and a SiLU MLP. Its width equals
    the backbone's (upstream builds it with `hidden_size=` the backbone hidden size)."""

    hidden_size: int = 2560  # n_embd
    num_hidden_layers: int = 1  # n_layer
    num_attention_heads: int = 32  # n_head (head_dim 80 in v1.5)
    intermediate_size: int = 9728  # n_inner
    layer_norm_eps: float = 1e-5  # layer_norm_epsilon (GPT2Config default)
    rope_base: float = 1_000_000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_hf_dict(self) -> dict[str, Any]:
        return {"model_type": "gpt2", "n_embd": self.hidden_size, "n_layer": self.num_hidden_layers,
                "n_head": self.num_attention_heads, "n_inner": self.intermediate_size,
                "layer_norm_epsilon": self.layer_norm_eps, "rope_base": self.rope_base,
                "activation_function": "silu", "position_embedding_type": "rope"}

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any], hidden_size: int) -> LocalTransformerConfig:
        kwargs: dict[str, Any] = {"hidden_size": hidden_size}
        for ours, theirs in (("num_hidden_layers", "n_layer"), ("num_attention_heads", "n_head"),
                             ("intermediate_size", "n_inner"), ("layer_norm_eps", "layer_norm_epsilon"),
                             ("rope_base", "rope_base")):
            if data.get(theirs) is not None:
                kwargs[ours] = data[theirs]
        return cls(**kwargs)


@attrs.frozen(kw_only=True)
class MossTTSLocalConfig:
    """Qwen3 backbone (`qwen3_config`), audio tables, token ids and the local transformer.

    Defaults are MOSS-TTS-Local-Transformer-v1.5 (Qwen3-4B backbone, 12 x 1024 codebooks).
    """

    # Backbone (Qwen3-4B).
    hidden_size: int = 2560
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 9728
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    vocab_size: int = 151936  # text vocab of transformer.embed_tokens
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = True
    # Audio: n_vq codebooks of audio_vocab_size; the pad id lies outside the tables.
    n_vq: int = 12
    audio_vocab_size: int = 1024
    audio_pad_token_id: int = 1024
    # Text-side special ids (Qwen tokenizer).
    pad_token_id: int = 151643
    im_start_token_id: int = 151644
    im_end_token_id: int = 151645
    audio_start_token_id: int = 151669
    audio_end_token_id: int = 151670
    audio_user_slot_token_id: int = 151654
    audio_assistant_slot_token_id: int = 151656
    sampling_rate: int = 48000
    local_text_head_mode: str = "binary"
    local: LocalTransformerConfig = attrs.field(factory=LocalTransformerConfig)
    # Engine sizing and tiny-model knobs (not upstream).
    max_context: int = 4096
    text_tokenizer: str = "qwen"  # "bytes": MossByteTokenizer built in
    prompt_template: str = "full"  # "full": upstream v1.5 processor layout; "compact": demo
    batch_invariant: bool = False
    demo_stop_wiring: bool = False
    init_std: float = 0.02

    def __attrs_post_init__(self) -> None:
        if self.local.hidden_size != self.hidden_size:
            raise ValueError(f"local transformer width {self.local.hidden_size} != backbone hidden {self.hidden_size}")
        if self.hidden_size % self.local.num_attention_heads or self.local.head_dim % 2:
            raise ValueError("local transformer heads must split hidden_size into even head dims (RoPE pairs)")
        if self.n_vq < 2:
            raise ValueError("MOSS-TTS Local needs n_vq >= 2 (codebook 0 plus a depth stage)")
        if self.audio_pad_token_id < self.audio_vocab_size:
            raise ValueError(f"audio_pad_token_id {self.audio_pad_token_id} must lie outside the audio "
                             f"table [0, {self.audio_vocab_size})")
        if self.local_text_head_mode != "binary":
            raise ValueError(f"only local_text_head_mode 'binary' is supported, got {self.local_text_head_mode!r}")
        if self.prompt_template not in TEMPLATES:
            raise ValueError(f"prompt_template must be one of {TEMPLATES}, got {self.prompt_template!r}")
        for name in _TEXT_IDS:
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ValueError(f"{name}={getattr(self, name)} outside text vocab {self.vocab_size}")
        if not 1 < self.max_context <= self.max_position_embeddings:
            raise ValueError("max_context must be in (1, max_position_embeddings]")

    # ---- HF config.json (upstream MossTTSLocalConfig: nested qwen3_config and gpt2_config) ----

    def to_hf_dict(self) -> dict[str, Any]:
        qwen3 = {
            "model_type": "qwen3",
            **{k: getattr(self, k) for k in _QWEN3_KEYS},
            "hidden_act": "silu",
        }
        return {
            "architectures": ["MossTTSLocalModel"],
            "model_type": "moss_tts_local",
            "qwen3_config": qwen3,
            "gpt2_config": self.local.to_hf_dict(),
            "local_transformer_layers": self.local.num_hidden_layers,
            **{k: getattr(self, k) for k in _TOP_KEYS},
            "mtp_fsm": {k: getattr(self, k) for k in _ENGINE_KEYS},
        }

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> MossTTSLocalConfig:
        qwen3 = dict(data.get("qwen3_config") or data.get("language_config") or {})
        kwargs: dict[str, Any] = {k: qwen3[k] for k in _QWEN3_KEYS if k in qwen3}
        if "head_dim" not in kwargs and "hidden_size" in kwargs:
            kwargs["head_dim"] = kwargs["hidden_size"] // kwargs.get("num_attention_heads", 32)
        # Newer transformers serialise rope_theta inside rope_parameters.
        if "rope_theta" not in kwargs and isinstance(qwen3.get("rope_parameters"), dict):
            kwargs["rope_theta"] = qwen3["rope_parameters"].get("rope_theta", 1_000_000.0)
        kwargs.update({k: data[k] for k in _TOP_KEYS if k in data})
        if "audio_pad_token_id" not in data and "audio_pad_code" in data:
            kwargs["audio_pad_token_id"] = data["audio_pad_code"]
        hidden = kwargs.get("hidden_size", 2560)
        local = LocalTransformerConfig.from_hf_dict(dict(data.get("gpt2_config") or {}), hidden)
        if data.get("local_transformer_layers") is not None:
            local = attrs.evolve(local, num_hidden_layers=int(data["local_transformer_layers"]))
        engine = data.get("mtp_fsm", {})
        kwargs.update({k: v for k, v in engine.items() if k in _ENGINE_KEYS})
        kwargs.setdefault("max_context", min(4096, kwargs.get("max_position_embeddings", 40960)))
        return cls(local=local, **kwargs)


_QWEN3_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "rms_norm_eps", "rope_theta", "vocab_size", "max_position_embeddings",
               "tie_word_embeddings")
_TEXT_IDS = ("pad_token_id", "im_start_token_id", "im_end_token_id", "audio_start_token_id", "audio_end_token_id",
             "audio_user_slot_token_id", "audio_assistant_slot_token_id")
_TOP_KEYS = ("n_vq", "audio_vocab_size", "audio_pad_token_id", *_TEXT_IDS, "sampling_rate", "local_text_head_mode")
_ENGINE_KEYS = ("max_context", "text_tokenizer", "prompt_template", "batch_invariant", "demo_stop_wiring",
                "init_std")


def config_v1_5(**overrides: Any) -> MossTTSLocalConfig:
    """MOSS-TTS-Local-Transformer-v1.5: Qwen3-4B backbone (2560 x 36), one local block (2560, FFN 9728)."""
    return MossTTSLocalConfig(**overrides)


def tiny_config(**overrides: Any) -> MossTTSLocalConfig:
    """A ~1.7M-parameter random model with the real audio shape (12 x 1024, pad 1024).

    Text ids come from MossByteTokenizer (256 bytes + specials in a 512-entry vocab);
    the compact prompt template keeps demo prompts short.
    """
    from .prompt import MossByteTokenizer

    tok = MossByteTokenizer()
    local_overrides = overrides.pop("local", None)
    base: dict[str, Any] = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=tok.vocab_size, max_position_embeddings=256, max_context=256,
        tie_word_embeddings=False, pad_token_id=tok.pad_id, im_start_token_id=tok.im_start_id,
        im_end_token_id=tok.im_end_id, audio_start_token_id=tok.audio_start_id, audio_end_token_id=tok.audio_end_id,
        audio_user_slot_token_id=tok.audio_user_slot_id, audio_assistant_slot_token_id=tok.audio_assistant_slot_id,
        text_tokenizer="bytes", prompt_template="compact", batch_invariant=True, demo_stop_wiring=True,
    )
    base.update(overrides)
    local = local_overrides or LocalTransformerConfig(hidden_size=base["hidden_size"], num_hidden_layers=1,
                                                      num_attention_heads=4, intermediate_size=128)
    return MossTTSLocalConfig(local=local, **base)
