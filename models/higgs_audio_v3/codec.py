"""Higgs Audio's codec decoder (the decode path of transformers' HiggsAudioV2TokenizerModel) as a CodecDecoder."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn
from transformers import DacConfig, DacModel, HubertConfig
from transformers.models.higgs_audio_v2_tokenizer.configuration_higgs_audio_v2_tokenizer import (
    HiggsAudioV2TokenizerConfig,
)

from models.codec_support import audible_init, check_codes, load_module, pad_to, read_config, seeded

# What a checkpoint of the whole tokenizer holds that decoding never reads.
ENCODER_PREFIXES = ("acoustic_encoder.", "encoder_semantic.", "decoder_semantic.", "semantic_model.", "fc.", "fc1.")


def tiny_tokenizer_config(num_quantizers: int = 8, codebook_size: int = 1024) -> HiggsAudioV2TokenizerConfig:
    """A tiny tokenizer for the tiny talker's 8 x 1024 codes at the released frame geometry: 960
    samples a frame at 24 kHz (25 Hz; the bandwidth is what gives 8 quantizers at that rate)."""
    ratios = [8, 5, 4, 2, 3]
    rate = 24_000 / math.prod(ratios)
    return HiggsAudioV2TokenizerConfig(
        sample_rate=24_000, codebook_size=codebook_size, codebook_dim=8,
        target_bandwidths=(rate * math.ceil(math.log2(codebook_size)) * num_quantizers / 1000,),
        acoustic_model_config=dict(encoder_hidden_size=4, downsampling_ratios=ratios, decoder_hidden_size=32,
                                   upsampling_ratios=ratios, hidden_size=8),
        semantic_model_config=dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16),
    )


def released_tokenizer_config() -> HiggsAudioV2TokenizerConfig:
    """transformers' default Higgs Audio v2 tokenizer config (a checkpoint's config.json overrides it)."""
    return HiggsAudioV2TokenizerConfig()


class HiggsDecodePath(nn.Module):
    """The tokenizer's decode: residual codebook lookups (project_out of each), fc2, the DAC decoder.
    Parameter names are the tokenizer's, so its checkpoints load by name; the DAC decoder is
    transformers' own, adjusted as HiggsAudioV2TokenizerModel adjusts it (output padding, no tanh)."""

    def __init__(self, config: HiggsAudioV2TokenizerConfig) -> None:
        super().__init__()
        acoustic = config.acoustic_model_config
        self.quantizer = nn.Module()
        self.quantizer.quantizers = nn.ModuleList([_Codebook(config) for _ in range(config.num_quantizers)])
        self.fc2 = nn.Linear(config.hidden_size, acoustic.hidden_size)
        self.acoustic_decoder = DacModel(acoustic).decoder
        for module in self.acoustic_decoder.modules():
            if isinstance(module, nn.ConvTranspose1d):
                module.output_padding = (module.stride[0] % 2,)
        self.acoustic_decoder.tanh = nn.Identity()

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, Q, T] -> audio [B, T x hop]."""
        summed = sum(q(codes[:, i]) for i, q in enumerate(self.quantizer.quantizers))  # [B, T, hidden]
        return self.acoustic_decoder(self.fc2(summed).transpose(1, 2))[:, 0]


class _Codebook(nn.Module):
    def __init__(self, config: HiggsAudioV2TokenizerConfig) -> None:
        super().__init__()
        self.codebook = nn.Module()
        for name in ("inited", "cluster_size", "embed", "embed_avg"):  # the checkpoint's buffers
            shape = {"inited": (1,), "cluster_size": (config.codebook_size,)}.get(
                name, (config.codebook_size, config.codebook_dim))
            self.codebook.register_buffer(name, torch.zeros(shape))
        self.project_in = nn.Linear(config.hidden_size, config.codebook_dim)  # encode side; kept for the names
        self.project_out = nn.Linear(config.codebook_dim, config.hidden_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.project_out(nn.functional.embedding(ids, self.codebook.embed))


def dac_radius_frames(acoustic: DacConfig) -> int:
    """Frames on either side a DAC decoder sample depends on (its convs are centred): kernel-7
    convs, per block a transposed conv (about one input step) and residual units of dilation 1, 3, 9."""
    rate, radius = 1, 3.0  # conv1, at the frame rate
    for stride in acoustic.upsampling_ratios:
        radius += 1 / rate
        rate *= stride
        radius += 3 * (1 + 3 + 9) / rate
    return math.ceil(radius + 3 / rate) + 1


class HiggsCodec:
    """The published frames of a Higgs request are in delay-pattern layout (codebook q of audio
    frame t is published in frame t + q, BOC before, EOC after). A window is un-delayed into the
    audio frames it holds whole; non-final, the last frames within the DAC decoder's radius are
    held back (its convs see both sides). Audio ends at the first frame whose codebook 0 is EOC
    (or, ended by length, at the last whole frame). Windows of equal length batch."""

    def __init__(self, config: HiggsAudioV2TokenizerConfig, *, boc: int | None = None, eoc: int | None = None,
                 seed: int | None = 0, max_batch: int = 16, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        self.config = config
        with seeded(0 if seed is None else seed):
            module = HiggsDecodePath(config)
            if seed is not None:  # the codebooks are zero buffers until a checkpoint fills them
                for q in module.quantizer.quantizers:
                    q.codebook.embed.normal_()
        if seed is not None:
            audible_init(module, seed, gain=0.7)  # std ~0.06 at the tiny size
        self.module = module.to(dtype=dtype, device=device).eval().requires_grad_(False)
        self.boc = config.codebook_size if boc is None else boc
        self.eoc = config.codebook_size + 1 if eoc is None else eoc
        self.num_codebooks = config.num_quantizers
        self.sample_rate, self.max_batch = config.sample_rate, max_batch
        self.samples_per_frame = int(math.prod(config.acoustic_model_config.upsampling_ratios))
        self.radius = dac_radius_frames(config.acoustic_model_config)
        self.delay = self.num_codebooks - 1
        self.lookahead_frames = self.delay + self.radius
        self.left_context_frames = self.radius + self.lookahead_frames

    def undelay(self, frames: torch.Tensor) -> torch.Tensor:
        """[B, W, Q] published rows -> [B, W - (Q - 1), Q] audio frames (codebook q read q rows later)."""
        n = frames.shape[1] - self.delay
        if n <= 0:
            return frames[:, :0]
        return torch.stack([frames[:, q:q + n, q] for q in range(self.num_codebooks)], dim=2)

    def decode(self, frames: torch.Tensor, final: bool) -> torch.Tensor | list[torch.Tensor]:
        if frames.dim() != 3 or frames.shape[2] != self.num_codebooks:
            raise ValueError(f"Higgs codec: expected frames [B, W, {self.num_codebooks}], got {tuple(frames.shape)}")
        audio = self.undelay(frames)
        # Audio ends at the first EOC (ended by length: at the last whole frame); past it the
        # window holds wind-down filler, never decoder input.
        ends = [int(e[0]) if len(e) else audio.shape[1] for e in ((row[:, 0] == self.eoc).nonzero()[:, 0] for row in audio)]
        out: list[torch.Tensor | None] = [None] * len(ends)
        for end in sorted(set(ends)):
            rows = [i for i, e in enumerate(ends) if e == end]
            # An ended stream's last samples are whole; otherwise the radius before the end waits.
            keep = end if final or end < audio.shape[1] else max(0, end - self.radius)
            pcm = self._decode(audio[rows, :end], keep)
            for j, i in enumerate(rows):
                out[i] = pcm[j]
        return torch.stack(out) if len(set(ends)) == 1 else out

    def _decode(self, audio: torch.Tensor, keep: int) -> torch.Tensor:
        check_codes(audio, self.num_codebooks, self.config.codebook_size, "Higgs codec (un-delayed audio frames)")
        if keep == 0:
            return torch.zeros(audio.shape[0], 0)
        device = next(self.module.parameters()).device
        wav = self.module(audio.transpose(1, 2).to(device)).to(torch.float32).cpu()
        return pad_to(wav, keep * self.samples_per_frame)


def tiny_demo_decoder(seed: int = 0) -> HiggsCodec:
    """The tiny, seeded decoder for the tiny talker's codes (BOC 1024, EOC 1025)."""
    return HiggsCodec(tiny_tokenizer_config(), seed=seed, max_batch=16)


def load_decoder(directory: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu") -> HiggsCodec:
    """The decode path of a Higgs Audio tokenizer checkpoint (config.json + safetensors), by name."""
    directory = Path(directory)
    config = HiggsAudioV2TokenizerConfig.from_dict(read_config(directory))
    codec = HiggsCodec(config, seed=None, dtype=dtype, device=device)
    load_module(codec.module, directory, prefixes=("", "audio_tokenizer."), ignore=ENCODER_PREFIXES, dtype=dtype)
    return codec
