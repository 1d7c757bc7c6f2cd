"""Our Qwen3-TTS 12 Hz tokenizer decoder (models/qwen3_tts/tokenizer_decoder.py) vs the official
Qwen3TTSTokenizerV2Decoder (qwen-tts 0.1.1), numerically: the same weights loaded by name (strict: every
parameter name and shape is upstream's), the same codes, max abs difference of the waveforms; and our
streamed audio (AudioStream, random chunk schedules) against the official whole decode.

Run in the parity venv: .venv-parity/bin/python -m pytest tests/parity/test_qwen3_tts_codec_parity.py -s
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("qwen_tts")

from parity_support import record  # noqa: E402
from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import (  # noqa: E402
    Qwen3TTSTokenizerV2DecoderConfig,
)
from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Decoder  # noqa: E402

from models.qwen3_tts.codec import Qwen3TTSCodec, released_decoder_config, tiny_decoder_config  # noqa: E402
from models.qwen3_tts.tokenizer_decoder import TokenizerDecoderConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from audio_util import joined, stream_codes  # noqa: E402

TOL = 1e-5  # on max |ours - official| / max(1, |official|); the waveform is clamped to [-1, 1]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def official(cfg: TokenizerDecoderConfig) -> Qwen3TTSTokenizerV2Decoder:
    data = cfg.to_hf_dict()
    head_dim = data.pop("head_dim")
    config = Qwen3TTSTokenizerV2DecoderConfig(**data, **({} if head_dim is None else {"head_dim": head_dim}))
    config._attn_implementation = "eager"
    return Qwen3TTSTokenizerV2Decoder(config).eval()


@torch.no_grad()
def redraw(codec: Qwen3TTSCodec, seed: int) -> None:
    """Every parameter off its init (SnakeBeta, layer scales, ConvNeXt gamma, codebook usage included), so
    no path is a no-op."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in codec.module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        noise = torch.randn(p.shape, generator=gen)
        if leaf in ("alpha", "beta"):
            p.copy_(0.3 * noise)
        elif leaf == "embedding_sum":
            p.copy_(2.0 * noise)  # code vectors large enough that the waveform follows the codes
        elif leaf == "cluster_usage":
            p.copy_(0.5 + torch.rand(p.shape, generator=gen))
        elif leaf in ("scale", "gamma"):
            p.copy_(0.3 + 0.1 * noise)
        elif "norm" in name and leaf == "weight":
            p.copy_(1.0 + 0.1 * noise)
        elif leaf == "bias":
            p.copy_(0.005 * noise)  # small: the output must follow the codes, not the biases
        else:
            p.copy_(0.8 * noise / max(1, p[0].numel()) ** 0.5)  # output std ~0.15: O(1), code-driven, rarely clamped


def pair(cfg: TokenizerDecoderConfig, seed: int = 0):
    ours = Qwen3TTSCodec(cfg, seed=seed)
    redraw(ours, seed)
    theirs = official(cfg)
    missing, unexpected = theirs.load_state_dict(ours.module.state_dict(), strict=True)
    assert not missing and not unexpected
    return ours, theirs


def compare(ours: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    diff = float((ours - ref).abs().max()) if ours.numel() else 0.0
    scaled = diff / max(1.0, float(ref.abs().max()) if ref.numel() else 0.0)
    record(what, diff, scaled, TOL, talker="Qwen3-TTS codec")
    print(f"PARITY {what}: max abs diff {diff:.3e} (official max |x| {float(ref.abs().max()):.3g})")
    assert scaled <= TOL, what
    return diff


@pytest.mark.parametrize("frames", [1, 5, 40, 120])
def test_tiny_decoder_matches_official(frames):
    ours, theirs = pair(tiny_decoder_config())
    codes = torch.randint(0, 2048, (2, 16, frames), generator=torch.Generator().manual_seed(frames))
    with torch.no_grad():
        ref = theirs(codes)[:, 0]
    assert float((ref[0] - ref[1]).abs().max()) > 0.05  # the waveform follows the codes, not the biases
    compare(ours.decode(codes.transpose(1, 2), True), ref, f"codec decoder tiny, {frames} frames, batch 2")


def test_tiny_decoder_with_grouped_kv_heads_matches_official():
    cfg = TokenizerDecoderConfig(**{**tiny_decoder_config().to_hf_dict(), "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "num_hidden_layers": 2, "sliding_window": 6})
    ours, theirs = pair(cfg, seed=1)
    codes = torch.randint(0, 2048, (1, 16, 30), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = theirs(codes)[:, 0]
    compare(ours.decode(codes.transpose(1, 2), True), ref, "codec decoder tiny GQA, 30 frames")


def test_streamed_audio_matches_official_whole_decode():
    ours, theirs = pair(tiny_decoder_config(), seed=2)
    codes = torch.randint(0, 2048, (33, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = theirs(codes.T.unsqueeze(0))[0, 0]
    for first, chunk in ((1, 4), (2, 25), (3, 7)):
        out, _ = stream_codes(ours, {"a": codes}, first_chunk=first, chunk=chunk)
        compare(joined(out["a"]), ref, f"codec streamed (first {first}, chunk {chunk}) vs official whole")


def test_released_size_matches_official():
    ours, theirs = pair(released_decoder_config(), seed=4)
    codes = torch.randint(0, 2048, (1, 16, 3), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = theirs(codes)[:, 0]
    compare(ours.decode(codes.transpose(1, 2), True), ref, "codec decoder released size, 3 frames")
