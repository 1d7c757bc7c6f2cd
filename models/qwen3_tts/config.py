"""Qwen3-TTS talker and code-predictor configurations, presets, and HF config.json mapping."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class CodePredictorConfig:
    """The MTP stage ("code predictor"): a small Qwen3 stack predicting codebooks 1..Q-1."""

    hidden_size: int = 1024
    num_hidden_layers: int = 5
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 3072
    vocab_size: int = 2048  # codebook size: valid residual codes are [0, vocab_size)
    num_code_groups: int = 16
    rms_norm_eps: float = 1e-6
    # Upstream's class default is 10000, but released config.json files carry 1e6.
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 65536


@attrs.frozen(kw_only=True)
class Qwen3TTSConfig:
    """The talker (backbone that samples CB0) plus its code predictor; defaults are the 1.7B."""

    hidden_size: int = 2048
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 6144
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    vocab_size: int = 3072  # codec vocab of the CB0 head: 2048 codes + specials
    text_vocab_size: int = 151936
    text_hidden_size: int = 2048
    num_code_groups: int = 16
    max_position_embeddings: int = 32768
    # Codec special ids (released 12 Hz checkpoints).
    codec_pad_id: int = 2148
    codec_bos_id: int = 2149
    codec_eos_token_id: int = 2150
    codec_think_id: int = 2154
    codec_nothink_id: int = 2155
    codec_think_bos_id: int = 2156
    codec_think_eos_id: int = 2157
    # Text-side special ids (Qwen tokenizer); newline is the "\n" token of the role prefix.
    im_start_token_id: int = 151644
    im_end_token_id: int = 151645
    assistant_token_id: int = 77091
    newline_token_id: int = 198
    tts_pad_token_id: int = 151671
    tts_bos_token_id: int = 151672
    tts_eos_token_id: int = 151673
    # Engine sizing (not upstream): KV positions per slot and the trailing-text column length.
    max_context: int = 4096
    max_trailing_text: int = 1024
    # "bytes" = ByteTextTokenizer built in; "qwen" = caller passes text_ids or a tokenizer.
    text_tokenizer: str = "qwen"
    # Tiny-model knobs: row-invariant matmuls, a readable EOS signal, init scale.
    batch_invariant: bool = False
    demo_eos_wiring: bool = False
    init_std: float = 0.02
    code_predictor: CodePredictorConfig = attrs.field(factory=CodePredictorConfig)

    def __attrs_post_init__(self) -> None:
        cp = self.code_predictor
        if cp.num_code_groups != self.num_code_groups:
            raise ValueError(f"num_code_groups {self.num_code_groups} != code predictor {cp.num_code_groups}")
        if cp.vocab_size > self.vocab_size:
            raise ValueError("codebook size exceeds the codec vocab")
        for name in ("codec_pad_id", "codec_bos_id", "codec_eos_token_id", "codec_think_id",
                     "codec_nothink_id", "codec_think_bos_id", "codec_think_eos_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ValueError(f"{name}={getattr(self, name)} outside codec vocab {self.vocab_size}")
        for name in ("im_start_token_id", "im_end_token_id", "assistant_token_id", "newline_token_id",
                     "tts_pad_token_id", "tts_bos_token_id", "tts_eos_token_id"):
            if not 0 <= getattr(self, name) < self.text_vocab_size:
                raise ValueError(f"{name}={getattr(self, name)} outside text vocab {self.text_vocab_size}")
        if not 0 < self.max_trailing_text < self.max_context:
            raise ValueError("max_trailing_text must be in (0, max_context)")

    @property
    def codebook_size(self) -> int:
        return self.code_predictor.vocab_size

    # ---- HF config.json (upstream nesting: talker_config holds code_predictor_config) ----

    def to_hf_dict(self) -> dict[str, Any]:
        cp = self.code_predictor
        talker = {
            "model_type": "qwen3_tts_talker",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            # Kept for upstream compatibility; with audio-only 1-D positions the sections coincide.
            "rope_scaling": {"rope_type": "default", "mrope_section": _mrope_section(self.head_dim),
                             "interleaved": True},
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "text_vocab_size": self.text_vocab_size,
            "text_hidden_size": self.text_hidden_size,
            "num_code_groups": self.num_code_groups,
            "max_position_embeddings": self.max_position_embeddings,
            **{k: getattr(self, k) for k in _TALKER_IDS},
            "code_predictor_config": {
                "model_type": "qwen3_tts_talker_code_predictor",
                **attrs.asdict(cp),
                "hidden_act": "silu",
            },
        }
        return {
            "architectures": ["Qwen3TTSForConditionalGeneration"],
            "model_type": "qwen3_tts",
            **{k: getattr(self, k) for k in _TOP_IDS},
            "talker_config": talker,
            "mtp_fsm": {k: getattr(self, k) for k in _ENGINE_KEYS},
        }

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> Qwen3TTSConfig:
        talker = dict(data["talker_config"])
        cp_raw = dict(talker.pop("code_predictor_config", {}))
        cp_fields = {f.name for f in attrs.fields(CodePredictorConfig)}
        cp_kwargs = {k: v for k, v in cp_raw.items() if k in cp_fields}
        if "head_dim" not in cp_kwargs and "hidden_size" in cp_kwargs:
            cp_kwargs["head_dim"] = cp_kwargs["hidden_size"] // cp_kwargs.get("num_attention_heads", 16)
        # Absent from the file: the upstream class default (released files carry 1e6).
        cp_kwargs.setdefault("rope_theta", (cp_raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        fields = {f.name for f in attrs.fields(cls)}
        kwargs = {k: v for k, v in talker.items() if k in fields and k not in _ENGINE_KEYS}
        if "head_dim" not in kwargs:
            kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
        # Newer transformers serialise rope_theta inside rope_parameters.
        kwargs.setdefault("rope_theta", (talker.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        kwargs.update({k: data[k] for k in _TOP_IDS if k in data})
        engine = data.get("mtp_fsm", {})
        kwargs.update({k: v for k, v in engine.items() if k in _ENGINE_KEYS})
        kwargs.setdefault("max_context", min(4096, kwargs.get("max_position_embeddings", 32768)))
        return cls(code_predictor=CodePredictorConfig(**cp_kwargs), **kwargs)


_TALKER_IDS = ("codec_pad_id", "codec_bos_id", "codec_eos_token_id", "codec_think_id",
               "codec_nothink_id", "codec_think_bos_id", "codec_think_eos_id")
_TOP_IDS = ("im_start_token_id", "im_end_token_id", "assistant_token_id", "tts_pad_token_id",
            "tts_bos_token_id", "tts_eos_token_id")
_ENGINE_KEYS = ("newline_token_id", "max_context", "max_trailing_text", "text_tokenizer",
                "batch_invariant", "demo_eos_wiring", "init_std")


def _mrope_section(head_dim: int) -> list[int]:
    # Upstream uses [24, 20, 20] for head_dim 128; scale proportionally for other sizes.
    half = head_dim // 2
    t = half * 24 // 64
    h = (half - t) // 2
    return [t, h, half - t - h]


def config_1_7b(**overrides: Any) -> Qwen3TTSConfig:
    """Qwen3-TTS-12Hz-1.7B: talker 2048 x 28, code predictor 1024 x 5 (with projection)."""
    return Qwen3TTSConfig(**overrides)


def config_0_6b(**overrides: Any) -> Qwen3TTSConfig:
    """Qwen3-TTS-12Hz-0.6B: talker 1024 x 28; hidden sizes match, so no small_to_mtp_projection."""
    base: dict[str, Any] = dict(hidden_size=1024, intermediate_size=3072, text_hidden_size=2048)
    base.update(overrides)
    return Qwen3TTSConfig(**base)


def tiny_config(**overrides: Any) -> Qwen3TTSConfig:
    """A few-hundred-k-parameter random model with the real vocabularies, Q and special ids.

    Text ids come from ByteTextTokenizer (256 bytes + specials in a 512-entry vocab).
    """
    from .prompt import ByteTextTokenizer

    tok = ByteTextTokenizer()
    base: dict[str, Any] = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, text_vocab_size=tok.vocab_size, text_hidden_size=48,
        max_position_embeddings=512, max_context=512, max_trailing_text=256,
        im_start_token_id=tok.im_start_id, im_end_token_id=tok.im_end_id,
        assistant_token_id=tok.assistant_id, newline_token_id=tok.newline_id,
        tts_pad_token_id=tok.tts_pad_id, tts_bos_token_id=tok.tts_bos_id, tts_eos_token_id=tok.tts_eos_id,
        text_tokenizer="bytes", batch_invariant=True, demo_eos_wiring=True,
        code_predictor=CodePredictorConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                           max_position_embeddings=64),
    )
    base.update(overrides)
    return Qwen3TTSConfig(**base)
