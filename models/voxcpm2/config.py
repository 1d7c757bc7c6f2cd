"""VoxCPM2 configuration: upstream `VoxCPMConfig` keys (config.json), the released 2B sizes and a tiny test model."""

from __future__ import annotations

import math
from typing import Any

import attrs

# LongRoPE factors of the released openbmb/VoxCPM2 config.json (short == long there; with
# max_position_embeddings == original_max_position_embeddings upstream uses the short list).
VOXCPM2_ROPE_FACTORS: tuple[float, ...] = (
    0.9977997200264581, 1.014658295992452, 1.0349680404997148, 1.059429246056193,
    1.0888815016813513, 1.1243301355211495, 1.166977103606075, 1.2182568066927284,
    1.2798772354275727, 1.3538666751582975, 1.4426259039919596, 1.5489853358570191,
    1.6762658237220625, 1.8283407612492941, 2.0096956085876183, 2.225478927469756,
    2.481536379650452, 2.784415934557119, 3.1413289096347365, 3.560047844772632,
    4.048719380066383, 4.615569542115128, 5.2684819496549835, 6.014438591970396,
    6.858830049237097, 7.804668263503327, 8.851768731513417, 9.99600492938444,
    11.228766118181639, 12.536757560834843, 13.902257701387796, 15.303885189125953,
    16.717837610115794, 18.119465097853947, 19.484965238406907, 20.792956681060105,
    22.02571786985731, 23.16995406772833, 24.217054535738416, 25.16289275000465,
    26.007284207271347, 26.753240849586767, 27.40615325712662, 27.973003419175363,
    28.461674954469114, 28.880393889607006, 29.237306864684626, 29.540186419591297,
    29.79624387177199, 30.01202719065413, 30.193382037992453, 30.34545697551969,
    30.47273746338473, 30.579096895249787, 30.66785612408345, 30.741845563814174,
    30.80346599254902, 30.85474569563567, 30.897392663720595, 30.932841297560394,
    30.962293553185553, 30.986754758742034, 31.007064503249293, 31.02392307921529,
)

# Upstream's fixed text-token ids (VoxCPM2Model.__init__), used by the prompt builder.
AUDIO_START_TOKEN, AUDIO_END_TOKEN, REF_AUDIO_START_TOKEN, REF_AUDIO_END_TOKEN = 101, 102, 103, 104


@attrs.frozen(kw_only=True)
class MiniCPM4Config:
    """Upstream `MiniCPM4Config` (`lm_config`); the local modules are copies with other sizes."""

    bos_token_id: int = 1
    eos_token_id: int = 2
    hidden_size: int = 2048
    intermediate_size: int = 6144
    max_position_embeddings: int = 32768
    num_attention_heads: int = 16
    num_hidden_layers: int = 28
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    kv_channels: int | None = 128
    rope_type: str = "longrope"
    long_factor: tuple[float, ...] = VOXCPM2_ROPE_FACTORS
    short_factor: tuple[float, ...] = VOXCPM2_ROPE_FACTORS
    original_max_position_embeddings: int = 32768
    vocab_size: int = 73448
    use_mup: bool = False
    scale_emb: float = 12.0
    dim_model_base: int = 256
    scale_depth: float = 1.4
    no_rope: bool = False

    @property
    def head_dim(self) -> int:
        return self.kv_channels if self.kv_channels else self.hidden_size // self.num_attention_heads

    @property
    def rope_factors(self) -> tuple[float, ...]:
        # Upstream builds one table for max_position_embeddings positions and picks the
        # list by that length, not by the current sequence length.
        long = self.max_position_embeddings > self.original_max_position_embeddings
        return self.long_factor if long else self.short_factor

    @property
    def rope_scaling_factor(self) -> float:
        scale = self.max_position_embeddings / self.original_max_position_embeddings
        return math.sqrt(1 + math.log(scale) / math.log(self.original_max_position_embeddings))

    def validate(self, name: str) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{name}: {self.num_attention_heads} heads not divisible by "
                             f"{self.num_key_value_heads} KV heads")
        if not self.no_rope and (self.head_dim % 2 or len(self.rope_factors) not in (1, self.head_dim // 2)):
            raise ValueError(f"{name}: {len(self.rope_factors)} rope factors for head_dim {self.head_dim}")

    def to_hf_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in _LM_KEYS}
        out["rope_scaling"] = {"type": self.rope_type, "long_factor": list(self.long_factor),
                               "short_factor": list(self.short_factor),
                               "original_max_position_embeddings": self.original_max_position_embeddings}
        return out

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> MiniCPM4Config:
        kwargs: dict[str, Any] = {k: data[k] for k in _LM_KEYS if k in data}
        rope = data.get("rope_scaling") or {}
        for ours, theirs in (("rope_type", "type"), ("original_max_position_embeddings",
                                                      "original_max_position_embeddings")):
            if theirs in rope:
                kwargs[ours] = rope[theirs]
        for key in ("long_factor", "short_factor"):
            if key in rope:
                kwargs[key] = tuple(float(v) for v in rope[key])
        return cls(**kwargs)


_LM_KEYS = ("bos_token_id", "eos_token_id", "hidden_size", "intermediate_size", "max_position_embeddings",
            "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "rms_norm_eps", "rope_theta",
            "kv_channels", "vocab_size", "use_mup", "scale_emb", "dim_model_base", "scale_depth", "no_rope")


@attrs.frozen(kw_only=True)
class LocalConfig:
    """Upstream `VoxCPMEncoderConfig` / `VoxCPMDitConfig` (the DiT adds mean mode and the CFM dict).

    Defaults are the released checkpoint's (12 layers, kv_channels 128); the upstream class
    defaults are 4 layers and kv_channels None.
    """

    hidden_dim: int = 1024
    ffn_dim: int = 4096
    num_heads: int = 16
    num_layers: int = 12
    kv_channels: int | None = 128
    dit_mean_mode: bool = False
    cfm_config: dict[str, Any] | None = None  # opaque except "solver"; only Euler exists upstream

    def minicpm(self, lm: MiniCPM4Config) -> MiniCPM4Config:
        """The MiniCPM config upstream builds: a deep copy of lm_config with these sizes (KV
        heads, RoPE and mup settings stay the LM's)."""
        return attrs.evolve(lm, hidden_size=self.hidden_dim, intermediate_size=self.ffn_dim,
                            num_attention_heads=self.num_heads, num_hidden_layers=self.num_layers,
                            kv_channels=self.kv_channels, vocab_size=0)

    def to_hf_dict(self, dit: bool) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in _LOCAL_KEYS}
        if dit:
            out["dit_mean_mode"] = self.dit_mean_mode
            out["cfm_config"] = dict(self.cfm_config or {"solver": "euler"})
        return out

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> LocalConfig:
        # Upstream's pydantic field is `dit_mean_mode`; the released file's "mean_mode" key is
        # ignored by upstream, so it is ignored here too.
        kwargs: dict[str, Any] = {k: data[k] for k in (*_LOCAL_KEYS, "dit_mean_mode") if k in data}
        if "cfm_config" in data:
            kwargs["cfm_config"] = dict(data["cfm_config"])
        return cls(**kwargs)


_LOCAL_KEYS = ("hidden_dim", "ffn_dim", "num_heads", "num_layers", "kv_channels")


@attrs.frozen(kw_only=True)
class VoxCPM2Config:
    """Upstream `VoxCPMConfig` plus engine knobs (written under "mtp_fsm" in config.json)."""

    lm_config: MiniCPM4Config = attrs.field(factory=MiniCPM4Config)
    patch_size: int = 4
    feat_dim: int = 64
    residual_lm_num_layers: int = 8
    residual_lm_no_rope: bool = True
    scalar_quantization_latent_dim: int = 512
    scalar_quantization_scale: int = 9
    encoder_config: LocalConfig = attrs.field(factory=LocalConfig)
    dit_config: LocalConfig = attrs.field(factory=lambda: LocalConfig(
        cfm_config={"sigma_min": 1e-06, "solver": "euler", "t_scheduler": "log-norm", "inference_cfg_rate": 2.0}))
    audio_vae_config: dict[str, Any] | None = None  # the VAE is a separate model; kept for the round trip
    max_length: int = 8192
    dtype: str = "bfloat16"
    # Engine knobs (not upstream). Defaults are upstream's generate() arguments.
    max_context: int = 4096
    inference_timesteps: int = 10
    cfg_value: float = 2.0
    min_len: int = 2
    sway_sampling_coef: float = 1.0
    use_cfg_zero_star: bool = True
    text_tokenizer: str = "llama"  # "bytes": byte ids (tiny model); "llama": ids come from the HF tokenizer
    batch_invariant: bool = False
    init_std: float = 0.02

    def __attrs_post_init__(self) -> None:
        for name, cfg in (("base_lm", self.lm_config), ("residual_lm", self.residual_lm),
                          ("feat_encoder", self.encoder_lm), ("feat_decoder", self.dit_lm)):
            cfg.validate(name)
        if self.lm_config.vocab_size <= REF_AUDIO_END_TOKEN:
            raise ValueError(f"vocab_size {self.lm_config.vocab_size} must hold the audio special ids")
        if not 1 < self.max_context <= self.lm_config.max_position_embeddings:
            raise ValueError("max_context must be in (1, max_position_embeddings]")
        if 2 * self.patch_size + 3 > self.lm_config.max_position_embeddings:
            raise ValueError("the DiT sequence (2 mu + t + prefix patch + patch) exceeds the RoPE table")
        if (self.dit_config.cfm_config or {}).get("solver", "euler") != "euler":
            raise ValueError("only the Euler CFM solver exists upstream")
        if self.inference_timesteps < 1 or self.text_tokenizer not in ("llama", "bytes"):
            raise ValueError("inference_timesteps must be >= 1 and text_tokenizer 'llama' or 'bytes'")

    @property
    def hidden_size(self) -> int:
        return self.lm_config.hidden_size

    @property
    def residual_lm(self) -> MiniCPM4Config:
        return attrs.evolve(self.lm_config, num_hidden_layers=self.residual_lm_num_layers, vocab_size=0,
                            no_rope=self.residual_lm_no_rope)

    @property
    def encoder_lm(self) -> MiniCPM4Config:
        return self.encoder_config.minicpm(self.lm_config)

    @property
    def dit_lm(self) -> MiniCPM4Config:
        return self.dit_config.minicpm(self.lm_config)

    def to_hf_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"architecture": "voxcpm2", "lm_config": self.lm_config.to_hf_dict()}
        out.update({k: getattr(self, k) for k in _TOP_KEYS})
        out["encoder_config"] = self.encoder_config.to_hf_dict(dit=False)
        out["dit_config"] = self.dit_config.to_hf_dict(dit=True)
        if self.audio_vae_config is not None:
            out["audio_vae_config"] = dict(self.audio_vae_config)
        out["mtp_fsm"] = {k: getattr(self, k) for k in _ENGINE_KEYS}
        return out

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> VoxCPM2Config:
        kwargs: dict[str, Any] = {k: data[k] for k in _TOP_KEYS if k in data}
        kwargs["lm_config"] = MiniCPM4Config.from_hf_dict(data.get("lm_config") or {})
        kwargs["encoder_config"] = LocalConfig.from_hf_dict(data.get("encoder_config") or {})
        if "dit_config" in data:
            kwargs["dit_config"] = LocalConfig.from_hf_dict(data["dit_config"])
        if data.get("audio_vae_config") is not None:
            kwargs["audio_vae_config"] = dict(data["audio_vae_config"])
        kwargs.update({k: v for k, v in (data.get("mtp_fsm") or {}).items() if k in _ENGINE_KEYS})
        kwargs.setdefault("max_context", min(4096, kwargs["lm_config"].max_position_embeddings))
        return cls(**kwargs)


_TOP_KEYS = ("patch_size", "feat_dim", "residual_lm_num_layers", "residual_lm_no_rope",
             "scalar_quantization_latent_dim", "scalar_quantization_scale", "max_length", "dtype")
_ENGINE_KEYS = ("max_context", "inference_timesteps", "cfg_value", "min_len", "sway_sampling_coef",
                "use_cfg_zero_star", "text_tokenizer", "batch_invariant", "init_std")

# Byte tokenizer of the tiny model: byte b is id BYTE_OFFSET + b, clear of upstream's special ids.
BYTE_OFFSET = 128


def voxcpm2_config(**overrides: Any) -> VoxCPM2Config:
    """openbmb/VoxCPM2 as released (MiniCPM-4 2048 x 28, residual LM 8 layers, LocEnc/LocDiT 1024 x 12)."""
    return VoxCPM2Config(**overrides)


def tiny_config(**overrides: Any) -> VoxCPM2Config:
    """A small random model with every upstream feature on (LongRoPE factors != 1, GQA, kv_channels
    != hidden / heads, a no-RoPE residual LM): hidden 64, patch 4 x 8, 4 CFM steps."""
    lm = MiniCPM4Config(hidden_size=64, intermediate_size=128, max_position_embeddings=160,
                        original_max_position_embeddings=160, num_attention_heads=4, num_hidden_layers=2,
                        num_key_value_heads=2, kv_channels=16, vocab_size=BYTE_OFFSET + 256,
                        long_factor=tuple(1.0 + 0.5 * i for i in range(8)),
                        short_factor=tuple(1.0 + 0.25 * i for i in range(8)))
    base: dict[str, Any] = dict(
        lm_config=lm, patch_size=4, feat_dim=8, residual_lm_num_layers=1, scalar_quantization_latent_dim=16,
        encoder_config=LocalConfig(hidden_dim=32, ffn_dim=64, num_heads=4, num_layers=1, kv_channels=16),
        dit_config=LocalConfig(hidden_dim=32, ffn_dim=64, num_heads=4, num_layers=2, kv_channels=16,
                               cfm_config={"solver": "euler"}),
        max_length=160, dtype="float32", max_context=160, inference_timesteps=4, text_tokenizer="bytes",
        batch_invariant=True, init_std=0.1)
    base.update(overrides)
    return VoxCPM2Config(**base)
