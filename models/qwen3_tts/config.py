"""Qwen3-TTS talker and code-predictor configurations, presets, and HF config.json mapping."""

from __future__ import annotations

from typing import Any

import attrs


class UnsupportedConfigError(ValueError):
    """A config.json value this implementation would silently compute differently."""


class FrozenMap(dict):
    """A read-only, hashable dict: keeps the frozen config hashable and unmodifiable while
    staying a plain dict for JSON, `in`, `[]` and `.items()`."""

    def _readonly(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("config maps are read-only; build a new config instead")

    __setitem__ = __delitem__ = __ior__ = _readonly  # type: ignore[assignment]
    clear = pop = popitem = setdefault = update = _readonly  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))

    def __reduce__(self):
        # The default dict-subclass pickling refills through __setitem__ (blocked above);
        # copy.deepcopy(model) in the test harness pickles the config this way.
        return (FrozenMap, (dict(self),))


def _frozen_map(value: Any) -> FrozenMap:
    return value if isinstance(value, FrozenMap) else FrozenMap(value or {})


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
    user_token_id: int = 872  # "user", the role word of the instruct template
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
    # Upstream talker_config maps (lowercase names -> codec ids): preset speakers, a speaker's
    # dialect (a codec_language_id key, or False) and language tags. Empty = none offered.
    spk_id: dict[str, int] = attrs.field(factory=FrozenMap, converter=_frozen_map)
    spk_is_dialect: dict[str, str | bool] = attrs.field(factory=FrozenMap, converter=_frozen_map)
    codec_language_id: dict[str, int] = attrs.field(factory=FrozenMap, converter=_frozen_map)
    # Upstream top-level descriptors, written back so the official class loads the file
    # ("base" makes it build a speaker encoder, whose weights this talker does not carry).
    tts_model_type: str = "custom_voice"
    tts_model_size: str = "1b7"
    tokenizer_type: str = "qwen3_tts_tokenizer_12hz"
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
        for name in ("im_start_token_id", "im_end_token_id", "assistant_token_id", "newline_token_id", "user_token_id",
                     "tts_pad_token_id", "tts_bos_token_id", "tts_eos_token_id"):
            if not 0 <= getattr(self, name) < self.text_vocab_size:
                raise ValueError(f"{name}={getattr(self, name)} outside text vocab {self.text_vocab_size}")
        if not 0 < self.max_trailing_text < self.max_context:
            raise ValueError("max_trailing_text must be in (0, max_context)")
        self._check_maps()

    def _check_maps(self) -> None:
        for map_name in ("spk_id", "spk_is_dialect", "codec_language_id"):
            for key in getattr(self, map_name):
                # Upstream looks names up with .lower(): a mixed-case key could never match.
                if not isinstance(key, str) or key != key.lower():
                    raise ValueError(f"{map_name} key {key!r} must be a lowercase string")
        for map_name in ("spk_id", "codec_language_id"):
            for key, value in getattr(self, map_name).items():
                if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.vocab_size:
                    raise ValueError(f"{map_name}[{key!r}]={value!r} is not an id in the codec vocab "
                                     f"[0, {self.vocab_size})")
        for key, dialect in self.spk_is_dialect.items():
            if dialect is not False and dialect not in self.codec_language_id:
                raise ValueError(f"spk_is_dialect[{key!r}]={dialect!r} must be False or a codec_language_id "
                                 f"key ({sorted(self.codec_language_id)})")

    @property
    def codebook_size(self) -> int:
        return self.code_predictor.vocab_size

    # ---- HF config.json (upstream nesting: talker_config holds code_predictor_config) ----

    def to_hf_dict(self) -> dict[str, Any]:
        """Everything upstream's Qwen3TTSConfig needs to build Qwen3TTSForConditionalGeneration
        (its __init__ iterates spk_id and codec_language_id, so they are always written)."""
        cp = self.code_predictor
        exact = {"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False}
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
            # Upstream's talker attention indexes rope_scaling["mrope_section"], so it must be
            # present; with audio-only 1-D positions every section gives the same angles.
            "rope_scaling": {"rope_type": "default", "mrope_section": _mrope_section(self.head_dim),
                             "interleaved": True},
            **exact,
            "vocab_size": self.vocab_size,
            "text_vocab_size": self.text_vocab_size,
            "text_hidden_size": self.text_hidden_size,
            "num_code_groups": self.num_code_groups,
            "max_position_embeddings": self.max_position_embeddings,
            **{k: getattr(self, k) for k in _TALKER_IDS},
            **{k: dict(getattr(self, k)) for k in _TALKER_MAPS},
            "code_predictor_config": {
                "model_type": "qwen3_tts_talker_code_predictor",
                **attrs.asdict(cp),
                **exact,
            },
        }
        return {
            "architectures": ["Qwen3TTSForConditionalGeneration"],
            "model_type": "qwen3_tts",
            **{k: getattr(self, k) for k in _TOP_IDS + _TOP_DESCRIPTORS},
            # Only read upstream for tts_model_type "base"; the x-vector is added to talker inputs.
            "speaker_encoder_config": {"enc_dim": self.hidden_size, "sample_rate": 24000},
            "talker_config": talker,
            "mtp_fsm": {k: getattr(self, k) for k in _ENGINE_KEYS},
        }

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> Qwen3TTSConfig:
        """Raises UnsupportedConfigError for a value that would change the math this model
        implements (sliding windows, attention biases, non-SiLU MLPs, scaled RoPE)."""
        talker = dict(data["talker_config"])
        cp_raw = dict(talker.pop("code_predictor_config", None) or {})
        cp_fields = {f.name for f in attrs.fields(CodePredictorConfig)}
        cp_kwargs = {k: v for k, v in cp_raw.items() if k in cp_fields}
        # Upstream's code-predictor config class defaults head_dim to 128 (not hidden / heads).
        cp_kwargs.setdefault("head_dim", 128)
        # Absent from the file: the upstream class default (released files carry 1e6).
        cp_kwargs.setdefault("rope_theta", (cp_raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        fields = {f.name for f in attrs.fields(cls)}
        kwargs = {k: v for k, v in talker.items() if k in fields and k not in _ENGINE_KEYS}
        if "head_dim" not in kwargs:
            # Upstream's talker config has no head_dim default: its attention falls back to this.
            defaults = attrs.fields(cls)
            hidden = kwargs.get("hidden_size", defaults.hidden_size.default)
            kwargs["head_dim"] = hidden // kwargs.get("num_attention_heads", defaults.num_attention_heads.default)
        _check_supported("talker_config", talker, kwargs["head_dim"], mrope=True)
        _check_supported("talker_config.code_predictor_config", cp_raw, cp_kwargs["head_dim"], mrope=False)
        # Newer transformers serialise rope_theta inside rope_parameters.
        kwargs.setdefault("rope_theta", (talker.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        # Upstream reads missing maps as None (and then fails); some files store ids as [id].
        kwargs["spk_id"] = {k: _single_id(v) for k, v in (talker.get("spk_id") or {}).items()}
        for k in ("spk_is_dialect", "codec_language_id"):
            kwargs[k] = talker.get(k) or {}
        kwargs.update({k: data[k] for k in _TOP_IDS + _TOP_DESCRIPTORS if data.get(k) is not None})
        engine = data.get("mtp_fsm", {})
        kwargs.update({k: v for k, v in engine.items() if k in _ENGINE_KEYS})
        kwargs.setdefault("max_context", min(4096, kwargs.get("max_position_embeddings", 32768)))
        return cls(code_predictor=CodePredictorConfig(**cp_kwargs), **kwargs)


_TALKER_IDS = ("codec_pad_id", "codec_bos_id", "codec_eos_token_id", "codec_think_id",
               "codec_nothink_id", "codec_think_bos_id", "codec_think_eos_id")
_TALKER_MAPS = ("spk_id", "spk_is_dialect", "codec_language_id")
_TOP_IDS = ("im_start_token_id", "im_end_token_id", "assistant_token_id", "tts_pad_token_id",
            "tts_bos_token_id", "tts_eos_token_id")
_TOP_DESCRIPTORS = ("tts_model_type", "tts_model_size", "tokenizer_type")
_ENGINE_KEYS = ("newline_token_id", "user_token_id", "max_context", "max_trailing_text", "text_tokenizer",
                "batch_invariant", "demo_eos_wiring", "init_std")


def _single_id(value: Any) -> Any:
    # Some exported config.json files write each speaker id as a one-element list; upstream
    # embeds either form the same way.
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def _unsupported(where: str, name: str, value: Any, supported: str) -> UnsupportedConfigError:
    return UnsupportedConfigError(f"{where}.{name}={value!r} is not supported (supported: {supported})")


def _check_supported(where: str, raw: dict[str, Any], head_dim: int, *, mrope: bool) -> None:
    """Reject config.json values whose upstream meaning this implementation does not compute."""
    if raw.get("use_sliding_window", False):
        raise _unsupported(where, "use_sliding_window", raw["use_sliding_window"], "false (full causal attention)")
    if raw.get("attention_bias", False):
        raise _unsupported(where, "attention_bias", raw["attention_bias"], "false (bias-free q/k/v/o)")
    if raw.get("hidden_act", "silu") != "silu":
        raise _unsupported(where, "hidden_act", raw["hidden_act"], "'silu'")
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise _unsupported(where, "partial_rotary_factor", raw["partial_rotary_factor"], "1.0 (full-width RoPE)")
    for key in ("rope_scaling", "rope_parameters"):
        rope = raw.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise _unsupported(where, key, rope, "null or a dict with rope_type 'default'")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise _unsupported(where, f"{key}.rope_type", rope_type, "'default' (unscaled RoPE)")
        if not mrope or "mrope_section" not in rope:
            continue
        # The talker's MRoPE: its three position streams are equal for audio-only sequences,
        # so any split of the head_dim/2 frequencies is plain 1-D RoPE; other sums are malformed.
        section = rope["mrope_section"]
        if (not isinstance(section, list) or not all(isinstance(n, int) and n > 0 for n in section)
                or sum(section) != head_dim // 2):
            raise _unsupported(where, f"{key}.mrope_section", section,
                               f"positive ints summing to head_dim/2 = {head_dim // 2}")


def _mrope_section(head_dim: int) -> list[int]:
    # Upstream uses [24, 20, 20] for head_dim 128; scale proportionally for other sizes.
    half = head_dim // 2
    t = half * 24 // 64
    h = (half - t) // 2
    return [t, h, half - t - h]


# talker_config maps of the released 12 Hz CustomVoice checkpoints (1.7B and 0.6B share them),
# as published in Qwen/Qwen3-TTS-12Hz-*-CustomVoice config.json.
RELEASED_SPK_ID = {"serena": 3066, "vivian": 3065, "uncle_fu": 3010, "ryan": 3061, "aiden": 2861,
                   "ono_anna": 2873, "sohee": 2864, "eric": 2875, "dylan": 2878}
RELEASED_SPK_IS_DIALECT: dict[str, str | bool] = {
    **{name: False for name in RELEASED_SPK_ID}, "eric": "sichuan_dialect", "dylan": "beijing_dialect"}
RELEASED_CODEC_LANGUAGE_ID = {"chinese": 2055, "english": 2050, "german": 2053, "italian": 2070,
                              "portuguese": 2071, "spanish": 2054, "japanese": 2058, "korean": 2064,
                              "french": 2061, "russian": 2069, "beijing_dialect": 2074,
                              "sichuan_dialect": 2062}
_RELEASED_MAPS: dict[str, Any] = dict(spk_id=RELEASED_SPK_ID, spk_is_dialect=RELEASED_SPK_IS_DIALECT,
                                      codec_language_id=RELEASED_CODEC_LANGUAGE_ID)


def config_1_7b(**overrides: Any) -> Qwen3TTSConfig:
    """Qwen3-TTS-12Hz-1.7B(-CustomVoice): talker 2048 x 28, code predictor 1024 x 5 (with projection)."""
    return Qwen3TTSConfig(**{**_RELEASED_MAPS, **overrides})


def config_0_6b(**overrides: Any) -> Qwen3TTSConfig:
    """Qwen3-TTS-12Hz-0.6B(-CustomVoice): talker 1024 x 28; hidden sizes match, so no small_to_mtp_projection."""
    base: dict[str, Any] = dict(hidden_size=1024, intermediate_size=3072, text_hidden_size=2048,
                                tts_model_size="0b6", **_RELEASED_MAPS)
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
        assistant_token_id=tok.assistant_id, newline_token_id=tok.newline_id, user_token_id=tok.user_id,
        tts_pad_token_id=tok.tts_pad_id, tts_bos_token_id=tok.tts_bos_id, tts_eos_token_id=tok.tts_eos_id,
        text_tokenizer="bytes", batch_invariant=True, demo_eos_wiring=True, tts_model_size="tiny",
        # The tiny model keeps the real 3072-entry codec vocab, so it carries real (clash-free) ids.
        spk_id={"vivian": 3065, "eric": 2875}, spk_is_dialect={"vivian": False, "eric": "sichuan_dialect"},
        codec_language_id={"english": 2050, "chinese": 2055, "sichuan_dialect": 2062},
        code_predictor=CodePredictorConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                           max_position_embeddings=64),
    )
    base.update(overrides)
    return Qwen3TTSConfig(**base)
