"""Qwen3-TTS's 12 Hz speech-tokenizer decoder (codes -> 24 kHz waveform), our own torch module with upstream's parameter names."""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

_DILATIONS = (1, 3, 9)


@attrs.frozen(kw_only=True)
class TokenizerDecoderConfig:
    """Upstream Qwen3TTSTokenizerV2DecoderConfig's fields; defaults are the released 12 Hz decoder."""

    codebook_size: int = 2048
    codebook_dim: int = 512
    hidden_size: int = 1024
    latent_dim: int = 1024
    max_position_embeddings: int = 8000
    rope_theta: float = 10000.0
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int | None = None
    attention_bias: bool = False
    sliding_window: int = 72
    intermediate_size: int = 3072
    hidden_act: str = "silu"
    layer_scale_initial_scale: float = 0.01
    rms_norm_eps: float = 1e-5
    num_hidden_layers: int = 8
    num_quantizers: int = 16
    upsample_rates: tuple[int, ...] = attrs.field(default=(8, 5, 4, 3), converter=tuple)
    upsampling_ratios: tuple[int, ...] = attrs.field(default=(2, 2), converter=tuple)
    decoder_dim: int = 1536

    def __attrs_post_init__(self) -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r}: only silu is implemented")
        if self.decoder_dim % 2 ** len(self.upsample_rates):
            raise ValueError(f"decoder_dim {self.decoder_dim} must halve {len(self.upsample_rates)} times")

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsample_rates) * math.prod(self.upsampling_ratios)

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> "TokenizerDecoderConfig":
        """The decoder_config section of a speech tokenizer's config.json (unknown keys ignored)."""
        names = {f.name for f in attrs.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def to_hf_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in attrs.asdict(self).items()}


class CausalConv(nn.Module):
    """Conv1d padded on the left only (stride 1): output t sees inputs t - (k - 1) * d .. t."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, groups=groups)
        self.left = (kernel - 1) * dilation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (self.left, 0)))


class CausalUpConv(nn.Module):
    """ConvTranspose1d with the right overhang cut: L steps in, L x stride out, causal."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.cut = kernel - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y[..., : y.shape[-1] - self.cut] if self.cut else y


class ConvNeXt(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.dwconv(x).transpose(1, 2))
        h = self.gamma * self.pwconv2(F.gelu(self.pwconv1(h)))
        return x + h.transpose(1, 2)


class SnakeBeta(nn.Module):
    """x + sin^2(x e^alpha) / e^beta, per channel (log-scale parameters)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(dim))
        self.beta = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha, beta = self.alpha.exp()[None, :, None], self.beta.exp()[None, :, None]
        # The reciprocal first, then the product: upstream's order of rounding (parity to the bit).
        return x + (1.0 / (beta + 1e-9)) * torch.sin(x * alpha).pow(2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class Attention(nn.Module):
    def __init__(self, cfg: TokenizerDecoderConfig) -> None:
        super().__init__()
        d, h, kv = cfg.attention_head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.heads, self.kv_heads, self.head_dim = h, kv, d
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        # Plain softmax attention (windows are short): the rounding of upstream's eager path.
        scores = torch.matmul(q, k.transpose(2, 3)) * self.head_dim ** -0.5
        weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(weights, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Mlp(nn.Module):
    def __init__(self, cfg: TokenizerDecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: TokenizerDecoderConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = Mlp(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class Transformer(nn.Module):
    """Causal sliding-window attention over the frames (each frame sees the last `sliding_window`, itself included)."""

    def __init__(self, cfg: TokenizerDecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        pos = torch.arange(t, device=x.device)
        d = self.cfg.attention_head_dim
        # RoPE in float32 (its angles lose precision in half types), relative: window starts do not matter.
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
        angles = pos.float()[:, None] * inv[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        rel = pos[:, None] - pos[None, :]
        mask = (rel >= 0) & (rel < self.cfg.sliding_window)
        h = self.input_proj(x)
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.output_proj(self.norm(h))


class _Codebook(nn.Module):
    def __init__(self, dim: int, size: int) -> None:
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return F.embedding(codes, self.embedding_sum / self.cluster_usage.clamp(min=1e-5)[:, None])


class _VQ(nn.Module):
    def __init__(self, dim: int, size: int) -> None:
        super().__init__()
        self._codebook = _Codebook(dim, size)


class _RVQ(nn.Module):
    """Residual codebooks summed, then a 1x1 conv out (input_proj serves the encoder; kept for the names)."""

    def __init__(self, n: int, dim: int, io_dim: int, size: int) -> None:
        super().__init__()
        self.vq = nn.Module()
        self.vq.layers = nn.ModuleList(_VQ(dim, size) for _ in range(n))
        self.input_proj = nn.Conv1d(io_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, io_dim, 1, bias=False)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:  # [B, n, T] -> [B, io_dim, T]
        summed = sum(layer._codebook(codes[:, i]) for i, layer in enumerate(self.vq.layers))
        return self.output_proj(summed.transpose(1, 2))


class SplitRVQ(nn.Module):
    """Codebook 0 (semantic) and codebooks 1.. (acoustic) through their own quantizers, summed."""

    def __init__(self, cfg: TokenizerDecoderConfig) -> None:
        super().__init__()
        half = cfg.codebook_dim // 2
        self.rvq_first = _RVQ(1, half, cfg.codebook_dim, cfg.codebook_size)
        self.rvq_rest = _RVQ(cfg.num_quantizers - 1, half, cfg.codebook_dim, cfg.codebook_size)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return self.rvq_first(codes[:, :1]) + self.rvq_rest(codes[:, 1:])


class _UpsampleBlock(nn.Module):
    def __init__(self, cin: int, cout: int, rate: int) -> None:
        super().__init__()
        units: list[nn.Module] = [SnakeBeta(cin), CausalUpConv(cin, cout, 2 * rate, rate)]
        units += [_Residual(cout, d) for d in _DILATIONS]
        self.block = nn.ModuleList(units)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.block:
            x = unit(x)
        return x


class _Residual(nn.Module):
    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1, self.conv1 = SnakeBeta(dim), CausalConv(dim, dim, 7, dilation=dilation)
        self.act2, self.conv2 = SnakeBeta(dim), CausalConv(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))


class TokenizerDecoder(nn.Module):
    """codes [B, Q, T] -> waveform [B, 1, T x samples_per_frame] in [-1, 1]; causal throughout."""

    def __init__(self, cfg: TokenizerDecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.quantizer = SplitRVQ(cfg)
        self.pre_conv = CausalConv(cfg.codebook_dim, cfg.latent_dim, 3)
        self.pre_transformer = Transformer(cfg)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalUpConv(cfg.latent_dim, cfg.latent_dim, r, r), ConvNeXt(cfg.latent_dim)])
            for r in cfg.upsampling_ratios
        )
        n = len(cfg.upsample_rates)
        dims = [cfg.decoder_dim // 2 ** i for i in range(n + 1)]
        self.decoder = nn.ModuleList(
            [CausalConv(cfg.latent_dim, cfg.decoder_dim, 7)]
            + [_UpsampleBlock(dims[i], dims[i + 1], r) for i, r in enumerate(cfg.upsample_rates)]
            + [SnakeBeta(dims[-1]), CausalConv(dims[-1], 1, 7)]
        )

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        h = self.pre_conv(self.quantizer(codes))
        h = self.pre_transformer(h.transpose(1, 2)).transpose(1, 2)
        for up, convnext in self.upsample:
            h = convnext(up(h))
        for block in self.decoder:
            h = block(h)
        return h.clamp(-1.0, 1.0)


def receptive_frames(cfg: TokenizerDecoderConfig) -> int:
    """Frames back one output sample depends on: pre_conv (2), the sliding-window layers, then each
    causal conv's lookback at its own rate ((k - 1) x dilation steps there, over steps per frame)."""
    back, rate = 2.0 + cfg.num_hidden_layers * (cfg.sliding_window - 1), 1
    for ratio in cfg.upsampling_ratios:  # the transposed conv (k = stride) reaches no further back
        rate *= ratio
        back += 6 / rate  # ConvNeXt's depthwise k7
    back += 6 / rate  # the decoder's first conv
    for up in cfg.upsample_rates:
        back += 1 / rate  # transposed conv, k = 2 x stride: one input step back
        rate *= up
        back += sum(6 * d for d in _DILATIONS) / rate
    return math.ceil(back + 6 / rate)
