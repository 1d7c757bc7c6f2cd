"""VoxCPM2's AudioVAE decoder (upstream voxcpm.modules.audiovae, from the unpacked wheel) as a CodecDecoder."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import types
import warnings
from pathlib import Path

import torch

from mtp_fsm.model_api import PayloadSpec
from mtp_fsm.serving.codec import CodecUnavailableError
from models.codec_support import load_module, pad_to, read_config, seeded

# `make install` unpacks the pinned voxcpm wheel here (Makefile: VOXCPM_DIR); VOXCPM_SRC overrides.
DEFAULT_SRC = Path(__file__).resolve().parents[2] / ".venv" / "upstream" / "voxcpm-src"
_MODULE = "voxcpm/modules/audiovae/audio_vae_v2.py"
_CONV_LOOKBACK = 6  # the decoder's causal convs have kernel 7 (dilated in the residual units)


def upstream_audio_vae() -> types.ModuleType:
    """upstream's audio_vae_v2 module, loaded from its file alone (it imports only torch, numpy and
    pydantic; the package __init__ files would pull in the whole TTS stack)."""
    name = "_mtp_fsm_upstream_voxcpm_audio_vae_v2"
    if name in sys.modules:
        return sys.modules[name]
    path = Path(os.environ.get("VOXCPM_SRC", DEFAULT_SRC)) / _MODULE
    if not path.exists():
        raise CodecUnavailableError("voxcpm2", f"upstream AudioVAE source not found at {path} (make install "
                                    "unpacks voxcpm 2.0.3 there; or set VOXCPM_SRC to an unpacked wheel)")
    if importlib.util.find_spec("pydantic") is None:
        raise CodecUnavailableError("voxcpm2", "upstream AudioVAE needs pydantic, which is not installed")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def tiny_vae_config(latent_dim: int = 8) -> dict:
    """A tiny AudioVAE for the tiny talker's 8-dim latents at the released decoder geometry:
    1920 samples a latent step at 48 kHz (7680 a 4-step patch)."""
    return dict(encoder_dim=4, encoder_rates=[2, 2], latent_dim=latent_dim, decoder_dim=64,
                decoder_rates=[8, 6, 5, 2, 2, 2], depthwise=True, sample_rate=16_000, out_sample_rate=48_000,
                sr_bin_boundaries=None)


def released_vae_config() -> dict:
    """upstream AudioVAEConfig's defaults (VoxCPM2's VAE: 64-dim latents, 48 kHz out)."""
    return dict(upstream_audio_vae().AudioVAEConfig())


def receptive_latent_steps(config: dict) -> int:
    """Latent steps back a sample depends on (the decoder is causal: it has no lookahead)."""
    rate, back = 1, 2 * _CONV_LOOKBACK / 1  # depthwise first conv (k7) and its pointwise, or one k7 conv
    for stride in config["decoder_rates"]:
        back += 1 / rate  # causal transposed conv, kernel 2 x stride: one input step back
        rate *= stride
        back += sum(_CONV_LOOKBACK * d for d in (1, 3, 9)) / rate
    return math.ceil(back + _CONV_LOOKBACK / rate)


class VoxCPMCodec:
    """AudioVAE.decode over windows of a request's frames: each frame's payload is a latent patch
    [patch_size, latent_dim] (carried bit-exactly as int64 words after CB0), a window's patches
    concatenate into [latent_dim, W x patch_size] steps. The decoder is causal with no trimmed
    tail, so every sample of a window is exact given the left context. Windows of equal length batch."""

    lookahead_frames = 0

    def __init__(self, vae_config: dict, payload: PayloadSpec, *, seed: int | None = 0, max_batch: int = 16,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        upstream = upstream_audio_vae()
        if len(payload.shape) != 2 or payload.shape[1] != vae_config["latent_dim"]:
            raise ValueError(f"VoxCPM codec: payload {payload.shape} is not [patch, latent_dim={vae_config['latent_dim']}]")
        self.vae_config, self.payload = dict(vae_config), payload
        with seeded(0 if seed is None else seed), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # upstream's weight_norm: deprecated, still exact
            self.module = upstream.AudioVAE(upstream.AudioVAEConfig(**vae_config))
        if seed is not None:
            _audible(self.module)
        self.module = self.module.to(dtype=dtype, device=device).eval().requires_grad_(False)
        self.patch = payload.shape[0]
        self.sample_rate = int(vae_config.get("out_sample_rate") or vae_config["sample_rate"])
        self.samples_per_frame = self.patch * math.prod(vae_config["decoder_rates"])
        self.left_context_frames = math.ceil(receptive_latent_steps(vae_config) / self.patch)
        self.max_batch, self.dtype = max_batch, dtype

    def decode(self, frames: torch.Tensor, final: bool) -> torch.Tensor:
        b, w, width = frames.shape
        if width != 1 + self.payload.numel:
            raise ValueError(f"VoxCPM codec: expected frame rows of 1 + {self.payload.numel} words, got {width}")
        if w == 0:
            return torch.zeros(b, 0)
        patches = self.payload.decode(frames[..., 1:].reshape(b * w, -1))  # [B*W, patch, D]
        if not bool(torch.isfinite(patches).all()):
            raise ValueError("VoxCPM codec: a latent patch holds NaN or inf")
        z = patches.reshape(b, w * self.patch, -1).transpose(1, 2)  # [B, D, steps]
        device = next(self.module.parameters()).device
        wav = self.module.decode(z.to(device=device, dtype=self.dtype))[:, 0].to(torch.float32).cpu()
        return pad_to(wav, w * self.samples_per_frame)


@torch.no_grad()
def _audible(vae: torch.nn.Module) -> None:
    """A tiny random decoder driven by its latents: biases 0 (they would dominate the waveform) and the
    weight-norm gains x1.2 (the default init fades the signal out over the blocks)."""
    for name, p in vae.decoder.named_parameters():
        if name.endswith("bias"):
            p.zero_()
        elif name.endswith("weight_g"):
            p.mul_(1.2)


def tiny_demo_decoder(seed: int = 0) -> VoxCPMCodec:
    """The tiny, seeded VAE decoder for the tiny talker's [4, 8] patches."""
    return VoxCPMCodec(tiny_vae_config(), PayloadSpec((4, 8), torch.float32), seed=seed)


def load_decoder(directory: str | Path, *, patch_size: int | None = None, dtype: torch.dtype = torch.float32,
                 device: str = "cpu") -> VoxCPMCodec:
    """The AudioVAE from a checkpoint directory: config.json's audio_vae_config (or a VAE-only
    config.json) and safetensors holding the VAE (under "audio_vae." or bare); the patch size is
    the talker config's patch_size unless given."""
    directory = Path(directory)
    data = read_config(directory)
    vae_config = data.get("audio_vae_config", data)
    patch = patch_size or int(data.get("patch_size", 0)) or None
    if patch is None:
        raise ValueError(f"VoxCPM codec: {directory}/config.json has no patch_size; pass patch_size")
    config = {**dict(upstream_audio_vae().AudioVAEConfig()), **vae_config}
    codec = VoxCPMCodec(config, PayloadSpec((patch, config["latent_dim"]), torch.float32), seed=None,
                        dtype=dtype, device=device)
    load_module(codec.module, directory, prefixes=("audio_vae.", ""), ignore=("encoder.",), dtype=dtype)
    return codec
