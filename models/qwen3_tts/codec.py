"""Qwen3-TTS's 12 Hz tokenizer decoder (models.qwen3_tts.tokenizer_decoder) as a CodecDecoder: tiny, released, by name."""

from __future__ import annotations

from pathlib import Path

import torch

from models.codec_support import audible_init, check_codes, load_module, pad_to, read_config, seeded
from models.module_init import seeded_normal

from .tokenizer_decoder import TokenizerDecoder, TokenizerDecoderConfig, receptive_frames

SAMPLE_RATE = 24_000
# A speech tokenizer checkpoint holds the encoder too; the decoder's tensors sit under "decoder.".
ENCODER_PREFIX = "encoder."


def tiny_decoder_config(num_quantizers: int = 16, codebook_size: int = 2048) -> TokenizerDecoderConfig:
    """The tiny talker's 16 x 2048 codes, a few thousand weights besides the codebooks, and the
    released frame geometry (1920 samples a frame at 24 kHz)."""
    return TokenizerDecoderConfig(
        codebook_size=codebook_size, codebook_dim=16, hidden_size=32, latent_dim=32, num_attention_heads=2,
        num_key_value_heads=2, sliding_window=4, intermediate_size=64, num_hidden_layers=1,
        num_quantizers=num_quantizers, decoder_dim=32,
    )


def released_decoder_config() -> TokenizerDecoderConfig:
    """Qwen3-TTS-Tokenizer-12Hz's decoder: 16 x 2048 codes at 12.5 Hz, 8 sliding-window layers of 72."""
    return TokenizerDecoderConfig()


@torch.no_grad()
def _seeded_init(module: TokenizerDecoder, seed: int) -> None:
    """Audible and driven by the codes: convs and linears N(0, 0.85^2 / fan-in), biases 0, codebook
    entries N(0, 1) (upstream's zeros would decode every code to silence; default inits give a
    waveform the biases dominate, near the same for any codes)."""
    audible_init(module, seed, gain=0.85)
    gen = torch.Generator().manual_seed(seed + 1)
    for rvq in (module.quantizer.rvq_first, module.quantizer.rvq_rest):
        for layer in rvq.vq.layers:
            layer._codebook.embedding_sum.copy_(seeded_normal(layer._codebook.embedding_sum.shape, gen))


class Qwen3TTSCodec:
    """The decoder over windows of a request's frames. It is causal with no trimmed tail (its
    transposed convs cut only their right overhang), so a window of W frames gives W x 1920
    exact samples given the left context; windows of equal length batch."""

    lookahead_frames = 0

    def __init__(self, config: TokenizerDecoderConfig, *, seed: int | None = 0, sample_rate: int = SAMPLE_RATE,
                 left_context_frames: int | None = None, max_batch: int = 16, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        self.config = config
        with seeded(0 if seed is None else seed):
            module = TokenizerDecoder(config)
            if seed is not None:
                _seeded_init(module, seed)
        self.module = module.to(dtype=dtype, device=device).eval().requires_grad_(False)
        self.sample_rate, self.max_batch, self.dtype = sample_rate, max_batch, dtype
        self.samples_per_frame = config.samples_per_frame
        # The exact default; a deployment may trade exactness for compute (vllm-omni runs 72 frames).
        self.left_context_frames = receptive_frames(config) if left_context_frames is None else left_context_frames

    def decode(self, frames: torch.Tensor, final: bool) -> torch.Tensor:
        check_codes(frames, self.config.num_quantizers, self.config.codebook_size, "Qwen3-TTS tokenizer decoder")
        if frames.shape[1] == 0:
            return torch.zeros(frames.shape[0], 0)
        device = next(self.module.parameters()).device
        wav = self.module(frames.transpose(1, 2).to(device))[:, 0].to(torch.float32).cpu()
        return pad_to(wav, frames.shape[1] * self.samples_per_frame)


def tiny_demo_decoder(seed: int = 0) -> Qwen3TTSCodec:
    """The tiny, seeded decoder for the tiny talker's codes (demo and tests)."""
    return Qwen3TTSCodec(tiny_decoder_config(), seed=seed)


def load_decoder(directory: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 left_context_frames: int | None = None) -> Qwen3TTSCodec:
    """The decoder of a speech tokenizer checkpoint (Qwen3-TTS-Tokenizer-12Hz, or the speech_tokenizer
    folder of a Qwen3-TTS one): config.json's decoder_config and the tensors under "decoder."."""
    directory = Path(directory)
    config = TokenizerDecoderConfig.from_hf_dict(read_config(directory, "decoder_config"))
    codec = Qwen3TTSCodec(config, seed=None, dtype=dtype, device=device, left_context_frames=left_context_frames)
    load_module(codec.module, directory, prefixes=("decoder.", ""), dtype=dtype)
    return codec
