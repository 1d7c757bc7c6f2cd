"""Qwen3-Omni's code-to-waveform decoder (transformers' Qwen3OmniMoeCode2Wav) as a CodecDecoder."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from models.codec_support import audible_init, check_codes, load_module, pad_to, read_config, seeded

SAMPLE_RATE = 24_000  # the released Code2Wav's output rate
_CONV_LOOKBACK = 6  # every causal conv of the decoder has kernel 7 (dilated in the residual units)


def tiny_code2wav_config(num_quantizers: int = 16, codebook_size: int = 2048) -> Qwen3OmniMoeCode2WavConfig:
    """A few thousand weights besides the code table, the tiny talker's 16 x 2048 codes, and the
    released frame geometry (1920 samples a frame at 24 kHz, so its 555-sample tail)."""
    return Qwen3OmniMoeCode2WavConfig(
        codebook_size=codebook_size, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
        sliding_window=4, intermediate_size=64, num_hidden_layers=1, num_quantizers=num_quantizers,
        upsample_rates=(8, 5, 4, 3), upsampling_ratios=(2, 2), decoder_dim=32,
    )


def released_code2wav_config() -> Qwen3OmniMoeCode2WavConfig:
    """Qwen3-Omni-30B-A3B's Code2Wav: 16 x 2048 codes at 12.5 Hz, 1920 samples a frame, 24 kHz."""
    return Qwen3OmniMoeCode2WavConfig()


def output_length(config: Qwen3OmniMoeCode2WavConfig, frames: int) -> int:
    """Samples the module returns for `frames` frames: each decoder block's transposed conv
    trims one input step off the end (the samples that need the next frame)."""
    n = frames * math.prod(config.upsampling_ratios)
    for rate in config.upsample_rates:
        n = max(0, (n - 1) * rate)
    return n


def receptive_frames(config: Qwen3OmniMoeCode2WavConfig) -> int:
    """Frames back a sample depends on: the sliding-window transformer, then every causal conv
    at its own rate (a lookback of k-1 steps there is (k-1) / steps-per-frame frames)."""
    back = config.num_hidden_layers * (config.sliding_window - 1)
    rate = 1
    fractional = 0.0
    for ratio in config.upsampling_ratios:  # causal transposed conv (no lookback), ConvNeXt dwconv k7
        rate *= ratio
        fractional += _CONV_LOOKBACK / rate
    fractional += _CONV_LOOKBACK / rate  # the decoder's first conv
    for up in config.upsample_rates:  # transposed conv k = 2 x rate: one input step back
        fractional += 1 / rate
        rate *= up
        fractional += sum(_CONV_LOOKBACK * d for d in (1, 3, 9)) / rate
    fractional += _CONV_LOOKBACK / rate  # the output conv
    return back + math.ceil(fractional)


class Qwen3OmniCodec:
    """Code2Wav over windows of a request's frames: causal and front-aligned, so a window yields
    every sample it determines; its end lacks the samples that need the next frame (555 at
    the released size), which a final window fills with silence so a stream of N frames is
    N x samples_per_frame long. Windows of equal length batch (max_batch)."""

    lookahead_frames = 0

    def __init__(self, config: Qwen3OmniMoeCode2WavConfig, *, seed: int | None = 0, sample_rate: int = SAMPLE_RATE,
                 left_context_frames: int | None = None, max_batch: int = 16, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        self.config = config
        with seeded(0 if seed is None else seed):
            module = Qwen3OmniMoeCode2Wav(config)
        if seed is not None:
            audible_init(module, seed, gain=0.8)  # std ~0.04, no clipping at the tiny size
        self.module = module.to(dtype=dtype, device=device).eval().requires_grad_(False)
        self.sample_rate, self.max_batch, self.dtype = sample_rate, max_batch, dtype
        self.samples_per_frame = int(math.prod(config.upsampling_ratios) * math.prod(config.upsample_rates))
        self.tail_samples = self.samples_per_frame - output_length(config, 1)
        lag = math.ceil(self.tail_samples / self.samples_per_frame)
        # The exact default; a deployment may trade exactness for compute with a shorter context.
        self.left_context_frames = receptive_frames(config) + lag if left_context_frames is None else left_context_frames

    def decode(self, frames: torch.Tensor, final: bool) -> torch.Tensor:
        check_codes(frames, self.config.num_quantizers, self.config.codebook_size, "Qwen3-Omni Code2Wav")
        if frames.shape[1] == 0:
            return torch.zeros(frames.shape[0], 0)
        device = next(self.module.parameters()).device
        wav = self.module(frames.transpose(1, 2).to(device))[:, 0].to(torch.float32).cpu()
        return pad_to(wav, frames.shape[1] * self.samples_per_frame) if final else wav


def tiny_demo_decoder(seed: int = 0) -> Qwen3OmniCodec:
    """The tiny, seeded decoder for the tiny talker's codes (demo and tests)."""
    return Qwen3OmniCodec(tiny_code2wav_config(), seed=seed)


def load_decoder(directory: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 left_context_frames: int | None = None) -> Qwen3OmniCodec:
    """Code2Wav from a checkpoint directory: a full Qwen3-Omni one (config.json's code2wav_config,
    tensors under "code2wav.") or a decoder-only one."""
    directory = Path(directory)
    config = Qwen3OmniMoeCode2WavConfig.from_dict(read_config(directory, "code2wav_config"))
    codec = Qwen3OmniCodec(config, seed=None, dtype=dtype, device=device, left_context_frames=left_context_frames)
    load_module(codec.module, directory, prefixes=("code2wav.", ""), dtype=dtype)
    return codec
