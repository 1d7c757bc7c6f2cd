"""Qwen3-Omni MoE talker configuration, presets (30B-A3B talker, tiny) and HF config.json mapping."""

from __future__ import annotations

from typing import Any

import attrs

from models.qwen3_tts.config import CodePredictorConfig

_SPEAKERS_30B = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}


@attrs.frozen(kw_only=True)
class Qwen3OmniConfig:
    """The MoE talker (`talker_config.text_config`), its code predictor, and the thinker-side ids.

    Defaults are the released Qwen3-Omni-30B-A3B talker (config.json `talker_config`).
    """

    # ---- talker_config.text_config: the MoE decoder
    hidden_size: int = 1024
    num_hidden_layers: int = 20
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 128
    intermediate_size: int = 2048  # upstream uses it only as text/hidden_projection's middle width
    moe_intermediate_size: int = 384
    shared_expert_intermediate_size: int = 768
    num_experts: int = 128
    num_experts_per_tok: int = 6
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    vocab_size: int = 3072  # codec vocab of the CB0 head: 2048 codes + specials
    max_position_embeddings: int = 65536
    # ---- talker_config
    num_code_groups: int = 16
    thinker_hidden_size: int = 2048  # width of a thinker row (text_projection / hidden_projection input)
    accept_hidden_layer: int = 24
    codec_pad_id: int = 2148
    codec_bos_id: int = 2149
    codec_eos_token_id: int = 2150
    codec_nothink_id: int = 2155
    codec_think_bos_id: int = 2156
    codec_think_eos_id: int = 2157
    speaker_id: dict[str, int] = attrs.field(factory=lambda: dict(_SPEAKERS_30B), hash=False)
    default_speaker: str = "ethan"
    # ---- top level: thinker-side token ids (their thinker embeddings condition the talker)
    thinker_vocab_size: int = 152064
    tts_pad_token_id: int = 151671
    tts_bos_token_id: int = 151672
    tts_eos_token_id: int = 151673
    im_start_token_id: int = 151644
    im_end_token_id: int = 151645
    user_token_id: int = 872
    assistant_token_id: int = 77091
    # ---- engine sizing and tiny-model knobs (not upstream; kept in config.json's "mtp_fsm" block)
    max_context: int = 4096
    max_feed: int = 0  # conditioning rows per request (0: max_context)
    thinker_stand_in: bool = False  # the seeded byte-table thinker of prompt.thinker_rows
    batch_invariant: bool = False
    demo_eos_wiring: bool = False
    init_std: float = 0.02
    code_predictor: CodePredictorConfig = attrs.field(
        factory=lambda: CodePredictorConfig(hidden_size=1024, num_hidden_layers=5, num_attention_heads=16,
                                            num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                                            vocab_size=2048, num_code_groups=16, max_position_embeddings=65536))

    def __attrs_post_init__(self) -> None:
        cp = self.code_predictor
        if cp.num_code_groups != self.num_code_groups:
            raise ValueError(f"num_code_groups {self.num_code_groups} != code predictor {cp.num_code_groups}")
        if cp.hidden_size != self.hidden_size:
            # Upstream feeds cat(talker hidden, talker codec embedding) straight into the predictor.
            raise ValueError(f"code predictor hidden {cp.hidden_size} != talker hidden {self.hidden_size}")
        if cp.vocab_size > self.vocab_size:
            raise ValueError("codebook size exceeds the codec vocab")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} not in [1, {self.num_experts}]")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        codec = ["codec_pad_id", "codec_bos_id", "codec_eos_token_id", "codec_nothink_id",
                 "codec_think_bos_id", "codec_think_eos_id"]
        for name in codec:
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ValueError(f"{name}={getattr(self, name)} outside codec vocab {self.vocab_size}")
        for name, value in self.speaker_id.items():
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"speaker {name!r}={value} outside codec vocab {self.vocab_size}")
        if self.default_speaker not in self.speaker_id:
            raise ValueError(f"default_speaker {self.default_speaker!r} not in speaker_id")
        for name in _THINKER_IDS:
            if not 0 <= getattr(self, name) < self.thinker_vocab_size:
                raise ValueError(f"{name}={getattr(self, name)} outside thinker vocab {self.thinker_vocab_size}")
        if self.max_feed < 0:
            raise ValueError("max_feed must be >= 0")

    @property
    def codebook_size(self) -> int:
        return self.code_predictor.vocab_size

    @property
    def feed_capacity(self) -> int:
        return self.max_feed or self.max_context

    # ---- HF config.json (upstream nesting: talker_config holds text_config and code_predictor_config)

    def to_hf_dict(self) -> dict[str, Any]:
        text = {"model_type": "qwen3_omni_moe_talker_text", **{k: getattr(self, k) for k in _TEXT_KEYS},
                "hidden_act": "silu", "decoder_sparse_step": 1, "mlp_only_layers": [],
                "rope_scaling": {"rope_type": "default", "mrope_section": _mrope_section(self.head_dim),
                                 "interleaved": True}}
        cp = {"model_type": "qwen3_omni_moe_talker_code_predictor", **attrs.asdict(self.code_predictor),
              "hidden_act": "silu"}
        # spatial_merge_size: the vision tower's patch merge, which the talker's multimodal RoPE
        # positions divide by; upstream's talker reads it in __init__ with no default (2 in the
        # released config), so without it the official class cannot be built from this file.
        talker = {"model_type": "qwen3_omni_moe_talker", **{k: getattr(self, k) for k in _TALKER_KEYS},
                  "speaker_id": dict(self.speaker_id), "spatial_merge_size": SPATIAL_MERGE_SIZE,
                  "text_config": text, "code_predictor_config": cp}
        return {
            "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
            "model_type": "qwen3_omni_moe",
            **{k: getattr(self, k) for k in _THINKER_IDS},
            "talker_config": talker,
            "thinker_config": {"text_config": {"vocab_size": self.thinker_vocab_size,
                                               "hidden_size": self.thinker_hidden_size}},
            "mtp_fsm": {k: getattr(self, k) for k in _ENGINE_KEYS},
        }

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> Qwen3OmniConfig:
        talker = dict(data["talker_config"])
        text = dict(talker.get("text_config") or {})
        cp_raw = dict(talker.get("code_predictor_config") or {})
        kwargs: dict[str, Any] = {k: text[k] for k in _TEXT_KEYS if k in text}
        if "num_experts" not in text and "num_local_experts" in text:  # newer attribute_map spelling
            kwargs["num_experts"] = text["num_local_experts"]
        kwargs.setdefault("head_dim", kwargs.get("hidden_size", 1024) // kwargs.get("num_attention_heads", 16))
        kwargs.setdefault("rope_theta", (text.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0))
        kwargs.update({k: talker[k] for k in _TALKER_KEYS if k in talker})
        if talker.get("speaker_id"):
            kwargs["speaker_id"] = dict(talker["speaker_id"])
        kwargs.update({k: data[k] for k in _THINKER_IDS if k in data})
        thinker_text = (data.get("thinker_config") or {}).get("text_config") or {}
        if "vocab_size" in thinker_text:
            kwargs["thinker_vocab_size"] = thinker_text["vocab_size"]
        engine = data.get("mtp_fsm", {})
        kwargs.update({k: v for k, v in engine.items() if k in _ENGINE_KEYS})
        speakers = kwargs.get("speaker_id", _SPEAKERS_30B)
        if kwargs.get("default_speaker", "ethan") not in speakers:
            kwargs["default_speaker"] = sorted(speakers)[0]
        kwargs.setdefault("max_context", min(4096, kwargs.get("max_position_embeddings", 65536)))
        cp_fields = {f.name for f in attrs.fields(CodePredictorConfig)}
        cp_kwargs = {k: v for k, v in cp_raw.items() if k in cp_fields}
        cp_kwargs.setdefault("head_dim", cp_kwargs.get("hidden_size", 1024) // cp_kwargs.get("num_attention_heads", 16))
        cp_kwargs.setdefault("rope_theta", (cp_raw.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0))
        return cls(code_predictor=CodePredictorConfig(**cp_kwargs), **kwargs)


_TEXT_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
              "num_experts_per_tok", "norm_topk_prob", "rms_norm_eps", "rope_theta", "vocab_size",
              "max_position_embeddings")
SPATIAL_MERGE_SIZE = 2  # Qwen3-Omni's released talker_config value
_TALKER_KEYS = ("num_code_groups", "thinker_hidden_size", "accept_hidden_layer", "codec_pad_id", "codec_bos_id",
                "codec_eos_token_id", "codec_nothink_id", "codec_think_bos_id", "codec_think_eos_id")
_THINKER_IDS = ("tts_pad_token_id", "tts_bos_token_id", "tts_eos_token_id", "im_start_token_id",
                "im_end_token_id", "user_token_id", "assistant_token_id")
_ENGINE_KEYS = ("default_speaker", "max_context", "max_feed", "thinker_stand_in", "batch_invariant",
                "demo_eos_wiring", "init_std")


def _mrope_section(head_dim: int) -> list[int]:
    # Upstream [24, 20, 20] for head_dim 128; with 1-D (text/audio-only) positions the sections coincide.
    half = head_dim // 2
    t = half * 24 // 64
    h = (half - t) // 2
    return [t, h, half - t - h]


def config_30b_a3b(**overrides: Any) -> Qwen3OmniConfig:
    """The talker of Qwen3-Omni-30B-A3B (Instruct): MoE 1024 x 20, 128 experts top-6 + shared expert."""
    return Qwen3OmniConfig(**overrides)


def tiny_config(**overrides: Any) -> Qwen3OmniConfig:
    """A small seeded random model: 4 experts top-2 + shared expert, real codec vocab, Q and ids.

    Thinker-side ids come from the byte stand-in (prompt.STAND_IN: 256 bytes + specials, 512 rows).
    """
    from .prompt import STAND_IN

    tok = STAND_IN
    base: dict[str, Any] = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=512, max_context=256, thinker_hidden_size=48,
        thinker_vocab_size=tok.vocab_size, tts_pad_token_id=tok.tts_pad_id, tts_bos_token_id=tok.tts_bos_id,
        tts_eos_token_id=tok.tts_eos_id, im_start_token_id=tok.im_start_id, im_end_token_id=tok.im_end_id,
        user_token_id=tok.user_id, assistant_token_id=tok.assistant_id, thinker_stand_in=True,
        batch_invariant=True, demo_eos_wiring=True,
        code_predictor=CodePredictorConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                           max_position_embeddings=64, num_code_groups=16, vocab_size=2048),
    )
    base.update(overrides)
    return Qwen3OmniConfig(**base)
