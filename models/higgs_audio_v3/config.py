"""Higgs Audio v3 configuration (Qwen3 backbone + fused 8-codebook audio tables), presets and config.json mapping."""

from __future__ import annotations

from typing import Any

import attrs

from models.qwen3_tts.config import UnsupportedConfigError, _check_supported

# Upstream (vllm-omni configuration_higgs_audio_v3.py) substitutes this when a Qwen3
# text_config carries rope_theta null: the training default.
_QWEN3_ROPE_THETA = 1_000_000.0


@attrs.frozen(kw_only=True)
class HiggsAudioV3Config:
    """Higgs Audio v3 TTS (`higgs_multimodal_qwen3`); the defaults are the released 4B model.

    config.json nests a Qwen3 `text_config` (the backbone) and an `audio_encoder_config`
    (discrete codes: `num_codebooks` x `vocab_size`, embedding tied with the audio head)
    under top-level audio constants and the prompt's special token ids, as upstream's
    `HiggsAudioV3Config` reads them. Each codebook's ids are [0, 1024) codec codes plus
    BOC (1024) and EOC (1025), the fillers of the MusicGen-style delay pattern.
    """

    # Qwen3 backbone (`text_config`); Qwen3-4B sizes.
    hidden_size: int = 2560
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 9728
    rms_norm_eps: float = 1e-6
    rope_theta: float = _QWEN3_ROPE_THETA
    vocab_size: int = 151936  # text vocab (`tied.embedding.text_embedding`)
    max_position_embeddings: int = 40960
    # Text head tied with the text embedding (Qwen3-4B); the talker never holds a text head.
    tie_word_embeddings: bool = True
    # Audio (`audio_encoder_config` + top-level audio constants).
    num_codebooks: int = 8
    codebook_size: int = 1026  # per-codebook ids: 1024 codes + BOC + EOC
    audio_stream_bos_id: int = 1024
    audio_stream_eos_id: int = 1025
    sample_rate: int = 24000
    frame_rate: int = 25
    # Prompt specials of the released tokenizer (<|tts|>, <|text|>, <|audio|>); upstream
    # resolves them from the tokenizer's added vocab and stores them on the config.
    tts_token_id: int = 151667
    text_token_id: int = 151672
    audio_continuation_id: int = 151670
    # Engine sizing (not upstream): KV positions per slot; 8192 is the training length.
    max_context: int = 8192
    # "qwen": callers pass Qwen tokenizer ids (or a tokenizer); "bytes": built-in UTF-8 bytes.
    text_tokenizer: str = "qwen"
    # Tiny-model knobs: row-invariant matmuls, a reachable EOC (adapter._wire_demo_eoc), init scale.
    batch_invariant: bool = False
    demo_eoc_wiring: bool = False
    init_std: float = 0.02

    def __attrs_post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.num_attention_heads} query heads not a multiple of "
                             f"{self.num_key_value_heads} KV heads")
        bos, eoc, size = self.audio_stream_bos_id, self.audio_stream_eos_id, self.codebook_size
        if bos == eoc or not (0 <= bos < size and 0 <= eoc < size):
            raise ValueError(f"BOC/EOC {bos}/{eoc} must be distinct ids in [0, {size})")
        if self.num_codebooks < 2:
            raise ValueError("the delay pattern needs at least 2 codebooks")
        specials = (self.tts_token_id, self.text_token_id, self.audio_continuation_id)
        if len(set(specials)) != 3 or not all(0 <= t < self.vocab_size for t in specials):
            raise ValueError(f"prompt specials {specials} must be distinct ids in [0, {self.vocab_size})")
        if not 0 < self.max_context <= self.max_position_embeddings:
            raise ValueError(f"max_context {self.max_context} must be in (0, {self.max_position_embeddings}]")
        if self.text_tokenizer not in ("qwen", "bytes"):
            raise ValueError(f"text_tokenizer {self.text_tokenizer!r} must be 'qwen' or 'bytes'")
        if self.text_tokenizer == "bytes" and min(specials) < 256:
            raise ValueError("the byte tokenizer needs the prompt specials above the 256 byte ids")

    # ---- config.json: upstream's nested layout plus our engine keys ----

    def to_hf_dict(self) -> dict[str, Any]:
        return {
            "architectures": ["HiggsMultimodalQwen3ForConditionalGeneration"],
            "model_type": "higgs_multimodal_qwen3",
            "audio_encoder_config": {
                "encoder_type": "discrete",
                "num_codebooks": self.num_codebooks,
                "vocab_size": self.codebook_size,
                "tie_word_embeddings": True,
            },
            "text_config": {
                "model_type": "qwen3",
                "hidden_act": "silu",
                "attention_bias": False,
                **{theirs: getattr(self, ours) for ours, theirs in _TEXT_KEYS},
            },
            **{k: getattr(self, k) for k in _TOP_KEYS},
            "mtp_fsm": {k: getattr(self, k) for k in _ENGINE_KEYS},
        }

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> HiggsAudioV3Config:
        """Upstream's config.json (ours or the released one); absent keys keep the 4B defaults.

        Raises UnsupportedConfigError for backbone options this implementation would compute
        differently (sliding window, attention bias, scaled RoPE, ...) and for an audio head
        untied from the audio embedding (the released model ties them; we hold one table).
        """
        text = dict(data.get("text_config") or {})
        if text.get("model_type", "qwen3") != "qwen3":
            raise UnsupportedConfigError(f"text_config.model_type={text['model_type']!r} (supported: 'qwen3')")
        kwargs: dict[str, Any] = {ours: text[theirs] for ours, theirs in _TEXT_KEYS if text.get(theirs) is not None}
        # An absent head_dim keeps ours (128), as transformers' Qwen3Config defaults it.
        _check_supported("text_config", text, kwargs.get("head_dim", _default("head_dim")), mrope=False)
        audio = data.get("audio_encoder_config") or {}
        if not audio.get("tie_word_embeddings", True):
            raise UnsupportedConfigError("audio_encoder_config.tie_word_embeddings=False is not supported "
                                         "(supported: true, the audio head is the audio embedding)")
        hidden = kwargs.get("hidden_size", _default("hidden_size"))
        if audio.get("out_dim", hidden) != hidden:
            raise UnsupportedConfigError("audio_encoder_config.out_dim must equal the backbone hidden_size")
        # Top-level num_codebooks / codebook_size are upstream's fallbacks for the encoder config.
        for ours, theirs in (("num_codebooks", "num_codebooks"), ("codebook_size", "vocab_size")):
            value = audio.get(theirs, data.get(ours))
            if value is not None:
                kwargs[ours] = value
        kwargs.update({k: data[k] for k in _TOP_KEYS if data.get(k) is not None})
        kwargs.update({k: v for k, v in (data.get("mtp_fsm") or {}).items() if k in _ENGINE_KEYS})
        positions = kwargs.get("max_position_embeddings", _default("max_position_embeddings"))
        kwargs.setdefault("max_context", min(_default("max_context"), positions))
        return cls(**kwargs)


def _default(name: str) -> Any:
    # Slotted attrs classes hold descriptors, not defaults, as class attributes.
    return attrs.fields_dict(HiggsAudioV3Config)[name].default


# (our field, upstream text_config key)
_TEXT_KEYS = (("hidden_size", "hidden_size"), ("num_hidden_layers", "num_hidden_layers"),
              ("num_attention_heads", "num_attention_heads"), ("num_key_value_heads", "num_key_value_heads"),
              ("head_dim", "head_dim"), ("intermediate_size", "intermediate_size"),
              ("rms_norm_eps", "rms_norm_eps"), ("rope_theta", "rope_theta"), ("vocab_size", "vocab_size"),
              ("max_position_embeddings", "max_position_embeddings"),
              ("tie_word_embeddings", "tie_word_embeddings"))
_TOP_KEYS = ("audio_stream_bos_id", "audio_stream_eos_id", "sample_rate", "frame_rate",
             "tts_token_id", "text_token_id", "audio_continuation_id")
_ENGINE_KEYS = ("max_context", "text_tokenizer", "batch_invariant", "demo_eoc_wiring", "init_std")


def v3_config(**overrides: Any) -> HiggsAudioV3Config:
    """Higgs Audio v3 TTS 4B as released (`bosonai/higgs-audio-v3-tts-4b`)."""
    return HiggsAudioV3Config(**overrides)


def tiny_config(**overrides: Any) -> HiggsAudioV3Config:
    """A ~0.6M-parameter random model: 2 x 64 Qwen3, byte text, the real 8 x 1026 codebooks and BOC/EOC."""
    from .prompt import ByteTextTokenizer

    tok = ByteTextTokenizer()
    base: dict[str, Any] = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=tok.vocab_size, max_position_embeddings=160, max_context=160,
        tts_token_id=tok.tts_id, text_token_id=tok.text_id, audio_continuation_id=tok.audio_id,
        text_tokenizer="bytes", batch_invariant=True, demo_eoc_wiring=True,
    )
    base.update(overrides)
    return HiggsAudioV3Config(**base)
