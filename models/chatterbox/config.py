"""Chatterbox Turbo T3 configuration (GPT-2 backbone + T3 hyper-parameters), presets and config.json mapping."""

from __future__ import annotations

from typing import Any

import attrs

# HF names of the two GELU forms GPT-2 configs use (tanh approximation, exact erf).
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu")


@attrs.frozen(kw_only=True)
class ChatterboxConfig:
    """T3 of Chatterbox Turbo; the defaults are the released model (GPT-2 medium, 24 x 1024):
    upstream `GPT2_MEDIUM_CONFIG` (t3/llama_configs.py) with the Turbo `T3Config` overrides
    of `ChatterboxTurboTTS.from_local` (chatterbox-tts 0.1.7).

    Speech vocabulary (`speech_emb` / `speech_head`, 6563 rows): ids [0, 6561) are S3
    tokenizer codes (3^8), 6561 is start-of-speech and 6562 stop-of-speech. Upstream keeps
    the two specials in the same table just above the codes (and drops ids >= 6561 before
    the vocoder), so the engine's codebook is [0, min(start, stop)) and both specials live
    in the backbone head above it.
    """

    # GPT-2 backbone (`tfmr`)
    hidden_size: int = 1024  # n_embd
    num_hidden_layers: int = 24  # n_layer
    num_attention_heads: int = 16  # n_head
    intermediate_size: int = 4096  # n_inner; upstream leaves it None, which GPT-2 reads as 4 * n_embd
    n_positions: int = 8196  # rows of the learned position table `tfmr.wpe`
    layer_norm_epsilon: float = 1e-5
    activation_function: str = "gelu_new"
    # Rows of `tfmr.wte`: present in the upstream file but deleted after loading (T3 always
    # feeds inputs_embeds), so the adapter does not hold it; kept to write upstream-strict files.
    gpt_vocab_size: int = 50276
    # T3 hyper-parameters
    text_tokens_dict_size: int = 50276  # GPT-2 tokenizer ids (Turbo adds no start/stop text tokens)
    speech_tokens_dict_size: int = 6563
    start_speech_token: int = 6561
    stop_speech_token: int = 6562
    speaker_embed_size: int = 256  # voice-encoder embedding projected by cond_enc.spkr_enc
    speech_cond_prompt_len: int = 375  # most conditioning speech tokens (15 s of reference audio)
    # Engine sizing (not upstream): KV positions per slot. 2048 holds 1 + 375 + text + 1
    # prompt positions plus upstream's 1000-token generation cap for texts up to ~670 tokens.
    max_context: int = 2048
    # "gpt2": callers pass GPT-2 tokenizer ids (or a tokenizer); "bytes": built-in UTF-8 bytes.
    text_tokenizer: str = "gpt2"
    # Tiny-model knobs: row-invariant matmuls and the init scale.
    batch_invariant: bool = False
    init_std: float = 0.02

    def __attrs_post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} not divisible by {self.num_attention_heads} heads")
        if self.activation_function not in ACTIVATIONS:
            raise ValueError(f"activation_function {self.activation_function!r} not in {ACTIVATIONS}")
        if self.batch_invariant and self.activation_function == "gelu":
            raise ValueError("activation_function 'gelu' (erf) has no batch-invariant form; use 'gelu_new'")
        if not 0 < self.max_context <= self.n_positions:
            # Learned absolute positions: there is no embedding beyond n_positions.
            raise ValueError(f"max_context {self.max_context} must be in (0, n_positions={self.n_positions}]")
        start, stop, size = self.start_speech_token, self.stop_speech_token, self.speech_tokens_dict_size
        if start == stop or not (0 < min(start, stop) and max(start, stop) < size):
            raise ValueError(f"start/stop speech tokens {start}/{stop} must be distinct ids in (0, {size})")
        if self.text_tokenizer not in ("gpt2", "bytes"):
            raise ValueError(f"text_tokenizer {self.text_tokenizer!r} must be 'gpt2' or 'bytes'")
        if self.text_tokenizer == "bytes" and self.text_tokens_dict_size < 256:
            raise ValueError("the byte tokenizer needs text_tokens_dict_size >= 256")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def codebook_size(self) -> int:
        """Real speech ids are [0, codebook_size); start/stop sit at or above it."""
        return min(self.start_speech_token, self.stop_speech_token)

    # ---- config.json: a GPT-2 config for `tfmr` plus the T3 hyper-parameters ----

    def to_hf_dict(self) -> dict[str, Any]:
        return {
            "architectures": ["T3"],
            "model_type": "chatterbox_t3",
            "tfmr_config": {
                "model_type": "gpt2",
                "n_embd": self.hidden_size,
                "n_layer": self.num_hidden_layers,
                "n_head": self.num_attention_heads,
                "n_inner": self.intermediate_size,
                "n_positions": self.n_positions,
                "n_ctx": self.n_positions,
                "layer_norm_epsilon": self.layer_norm_epsilon,
                "activation_function": self.activation_function,
                "vocab_size": self.gpt_vocab_size,
            },
            "t3_hp": {k: getattr(self, k) for k in _HP_KEYS},
            "mtp_fsm": {k: getattr(self, k) for k in _ENGINE_KEYS},
        }

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> ChatterboxConfig:
        """Ours (tfmr_config + t3_hp), or a bare GPT-2 config.json (Turbo T3 defaults for the rest)."""
        gpt = data.get("tfmr_config", data)
        if gpt.get("model_type", "gpt2") != "gpt2":
            raise ValueError(f"expected a GPT-2 backbone config, got model_type {gpt.get('model_type')!r}")
        kwargs: dict[str, Any] = {}
        for ours, theirs in _GPT_KEYS:
            if theirs in gpt:
                kwargs[ours] = gpt[theirs]
        if kwargs.get("intermediate_size") is None:  # GPT-2's n_inner=None
            kwargs["intermediate_size"] = 4 * kwargs.get("hidden_size", 1024)
        kwargs.update({k: v for k, v in data.get("t3_hp", {}).items() if k in _HP_KEYS})
        kwargs.update({k: v for k, v in data.get("mtp_fsm", {}).items() if k in _ENGINE_KEYS})
        kwargs.setdefault("max_context", min(2048, kwargs.get("n_positions", 8196)))
        return cls(**kwargs)


_GPT_KEYS = (("hidden_size", "n_embd"), ("num_hidden_layers", "n_layer"), ("num_attention_heads", "n_head"),
             ("intermediate_size", "n_inner"), ("n_positions", "n_positions"),
             ("layer_norm_epsilon", "layer_norm_epsilon"), ("activation_function", "activation_function"),
             ("gpt_vocab_size", "vocab_size"))
_HP_KEYS = ("text_tokens_dict_size", "speech_tokens_dict_size", "start_speech_token", "stop_speech_token",
            "speaker_embed_size", "speech_cond_prompt_len")
_ENGINE_KEYS = ("max_context", "text_tokenizer", "batch_invariant", "init_std")


def turbo_config(**overrides: Any) -> ChatterboxConfig:
    """Chatterbox Turbo T3 as released (`t3_turbo_v1.safetensors`)."""
    return ChatterboxConfig(**overrides)


def tiny_config(**overrides: Any) -> ChatterboxConfig:
    """A ~150k-parameter random T3: 2 x 64 GPT-2, byte text, 128 speech codes + start/stop."""
    base: dict[str, Any] = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
        n_positions=256, max_context=256, gpt_vocab_size=8, text_tokens_dict_size=256,
        speech_tokens_dict_size=130, start_speech_token=128, stop_speech_token=129,
        speaker_embed_size=16, speech_cond_prompt_len=8, text_tokenizer="bytes", batch_invariant=True,
    )
    base.update(overrides)
    return ChatterboxConfig(**base)
