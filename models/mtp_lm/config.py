"""MTP LM configuration (Qwen3 backbone + one DeepSeek-V3-style MTP layer), presets, request inputs, byte tokenizer."""

from __future__ import annotations

from typing import Any

import attrs

# config.json keys that are the HF Qwen3 config's own (names and meaning unchanged).
_HF_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "rms_norm_eps", "rope_theta", "vocab_size", "max_position_embeddings",
            "tie_word_embeddings", "num_nextn_predict_layers", "bos_token_id", "eos_token_id")
# Ours, nested under "mtp_fsm" so an HF Qwen3Config built from the file ignores them.
_ENGINE_KEYS = ("codebook_size", "max_context", "text_tokenizer", "batch_invariant", "demo_wiring", "init_std",
                "demo_stop_position")


@attrs.frozen(kw_only=True)
class MtpLMConfig:
    """A Qwen3 decoder LM with one multi-token-prediction layer at `model.layers.{num_hidden_layers}`
    (DeepSeek-V3 names, as vLLM's `deepseek_mtp` loads them).

    The defaults are MiMo-7B's sizes (hidden 4096, 36 layers, 32 query / 8 KV heads of 128,
    SwiGLU 11008, vocab 151680, rope_theta 640000, one MTP layer, untied head), recalled from
    its released config.json. MiMo's own layers are Qwen2's (q/k/v biases, no q/k norm) and
    its MTP names are `model.mtp_layers.*` with the concat order [hidden, token]; this model
    keeps MiMo's sizes but Qwen3 layers and DeepSeek's names and order, so a MiMo checkpoint
    does not load into it as is.

    Frames are token ids: ids [0, codebook_size) may be emitted, `eos_token_id` ends the
    request, the other ids (BOS, reserved) are never sampled by the engine.
    """

    hidden_size: int = 4096
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 11008
    rms_norm_eps: float = 1e-5
    rope_theta: float = 640_000.0
    vocab_size: int = 151680
    max_position_embeddings: int = 32768
    # The MTP head is the LM head (DeepSeek-V3 shares it); an embedding-tied head is not supported.
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 1
    bos_token_id: int | None = None  # Qwen tokenizers add none
    eos_token_id: int = 151643  # <|endoftext|>; ordinary BPE ids lie below it
    # Engine sizing (not upstream).
    codebook_size: int = 151643
    max_context: int = 4096
    # "ids": callers pass token ids; "bytes": built-in UTF-8 bytes (ids 0..255).
    text_tokenizer: str = "ids"
    # Tiny-model knobs: row-invariant matmuls, the demo EOS / drafter wiring (adapter.py), init scale,
    # and the position past which the wired EOS wins.
    batch_invariant: bool = False
    demo_wiring: bool = False
    init_std: float = 0.02
    demo_stop_position: int = 80

    def __attrs_post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.num_attention_heads} query heads not a multiple of "
                             f"{self.num_key_value_heads} KV heads")
        if self.num_nextn_predict_layers != 1:
            raise ValueError(f"exactly one MTP layer is supported, got {self.num_nextn_predict_layers}")
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings=True is not supported (the MTP head is the separate lm_head)")
        if not 0 < self.codebook_size <= self.eos_token_id < self.vocab_size:
            raise ValueError(f"need 0 < codebook_size {self.codebook_size} <= eos {self.eos_token_id} "
                             f"< vocab {self.vocab_size}")
        if self.bos_token_id is not None and not (self.codebook_size <= self.bos_token_id < self.vocab_size
                                                  and self.bos_token_id != self.eos_token_id):
            raise ValueError(f"bos {self.bos_token_id} must be a non-frame id other than eos")
        if not 0 < self.max_context <= self.max_position_embeddings:
            raise ValueError(f"max_context {self.max_context} must be in (0, {self.max_position_embeddings}]")
        if self.text_tokenizer not in ("ids", "bytes"):
            raise ValueError(f"text_tokenizer {self.text_tokenizer!r} must be 'ids' or 'bytes'")
        if self.text_tokenizer == "bytes" and self.codebook_size < 256:
            raise ValueError("the byte tokenizer needs ids 0..255 to be frame ids")
        if self.demo_wiring and (self.bos_token_id is None or self.hidden_size < 8):
            raise ValueError("the demo wiring needs a BOS token and hidden_size >= 8")

    # ---- config.json: an HF Qwen3 config plus DeepSeek's MTP count plus our engine keys ----

    def to_hf_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                                "hidden_act": "silu", "attention_bias": False}
        data.update({k: getattr(self, k) for k in _HF_KEYS})
        data["mtp_fsm"] = {k: getattr(self, k) for k in _ENGINE_KEYS}
        return data

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> MtpLMConfig:
        if data.get("model_type", "qwen3") != "qwen3":
            raise ValueError(f"expected a qwen3 config, got model_type {data.get('model_type')!r}")
        if data.get("attention_bias") or data.get("hidden_act", "silu") != "silu":
            raise ValueError("only Qwen3 layers without attention biases and with SiLU are supported")
        kwargs = {k: data[k] for k in _HF_KEYS if k in data}
        if "rope_theta" not in kwargs and "rope_theta" in (data.get("rope_parameters") or {}):
            kwargs["rope_theta"] = data["rope_parameters"]["rope_theta"]  # transformers >= 5 layout
        if isinstance(kwargs.get("eos_token_id"), list):
            kwargs["eos_token_id"] = kwargs["eos_token_id"][0]
        kwargs.update({k: v for k, v in data.get("mtp_fsm", {}).items() if k in _ENGINE_KEYS})
        return cls(**kwargs)


def real_config(**overrides: Any) -> MtpLMConfig:
    """MiMo-7B's sizes with Qwen3 layers (see MtpLMConfig)."""
    return MtpLMConfig(**overrides)


def tiny_config(**overrides: Any) -> MtpLMConfig:
    """A ~150k-parameter random model: 2 x 64 Qwen3 + MTP, byte frames 0..255, BOS 256, EOS 257,
    ids 258..299 reserved (unused padding of the vocab, as real vocabs have)."""
    base: dict[str, Any] = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, rms_norm_eps=1e-6, rope_theta=10_000.0, vocab_size=300,
        max_position_embeddings=512, bos_token_id=256, eos_token_id=257, codebook_size=256, max_context=160,
        text_tokenizer="bytes", batch_invariant=True, demo_wiring=True,
    )
    base.update(overrides)
    return MtpLMConfig(**base)


def wide_config(**overrides: Any) -> MtpLMConfig:
    """A ~120M-parameter random model of realistic shape for the speculative bench: 16 x 768
    Qwen3 layers (12 query / 4 KV heads of 64, SwiGLU 2048) + MTP, an 8192-id vocab (frames
    0..7999, EOS 8000, BOS 8001, byte prompts), wired like the tiny one so drafts are often
    accepted. Deep for its width, as released MTP models are (a draft pass is one layer and
    the head, a small part of the target's forward). Its linears are plain GEMMs (run it in
    bfloat16: on a CPU a forward of a few tokens then costs about one token's, reading the
    weights once), so unlike the tiny model its rows are batch-invariant only where the
    kernels are (tests/models/test_mtp_lm_wide.py checks this machine)."""
    base: dict[str, Any] = dict(
        hidden_size=768, num_hidden_layers=16, num_attention_heads=12, num_key_value_heads=4, head_dim=64,
        intermediate_size=2048, rms_norm_eps=1e-6, rope_theta=10_000.0, vocab_size=8192,
        max_position_embeddings=4096, bos_token_id=8001, eos_token_id=8000, codebook_size=8000, max_context=256,
        text_tokenizer="bytes", batch_invariant=False, demo_wiring=True,
    )
    base.update(overrides)
    return MtpLMConfig(**base)


def _ints(value) -> tuple[int, ...]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    return tuple(int(v) for v in value)


@attrs.frozen
class MtpLMInputs:
    """One request: exactly one of `text` (needs a tokenizer) or `token_ids` (the prompt after BOS).
    Tuples keep it hashable (test harnesses key reference runs on inputs)."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = attrs.field(default=None, converter=attrs.converters.optional(_ints))

    def __attrs_post_init__(self) -> None:
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("MtpLMInputs needs exactly one of text and token_ids")


@attrs.frozen
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 (the tiny config's text)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))
