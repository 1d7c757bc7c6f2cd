"""The talkers' codec decoders: chunked == whole through the AudioStream for each, boundary arithmetic,
loading by name from a checkpoint directory, released sizes constructible, refusals by name."""

import json
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors.torch import save_file

from mtp_fsm.model_api import PayloadSpec
from mtp_fsm.serving.codec import CodecUnavailableError, DecoderTiming, load_decoder

from audio_util import joined, stream_codes, whole

# Float rounding: a conv stack run over windows of other lengths picks other kernels (measured up to
# 1.0e-6 on a peak of 1.3); an off-by-a-sample or a mixed-up window is off by the signal itself (>= 1e-2).
TOL = 1e-5  # on max |streamed - whole| / max(1, max |whole|)


def omni_frames(n, seed):
    return torch.randint(0, 2048, (n, 16), generator=torch.Generator().manual_seed(seed))


def higgs_frames(n_audio, seed, *, ended=True, boc=1024, eoc=1025, q=8):
    """Published delay-pattern rows of n_audio random audio frames (wind-down and the all-EOC row when ended)."""
    audio = torch.randint(0, 1024, (n_audio, q), generator=torch.Generator().manual_seed(seed))
    rows = n_audio + q if ended else n_audio
    out = torch.full((rows, q), boc, dtype=torch.int64)
    for f in range(rows):
        for c in range(q):
            t = f - c
            out[f, c] = boc if t < 0 else (audio[t, c] if t < n_audio else eoc)
    return out


def voxcpm_frames(n, seed, payload=PayloadSpec((4, 8), torch.float32)):
    patches = torch.randn(n, 4, 8, generator=torch.Generator().manual_seed(seed))
    return torch.cat((torch.zeros(n, 1, dtype=torch.int64), payload.encode(patches)), dim=1)


MAKERS = {"qwen3_tts": omni_frames, "qwen3_omni": omni_frames, "higgs_audio_v3": higgs_frames, "voxcpm2": voxcpm_frames}


@pytest.fixture(scope="module")
def decoders():
    out = {}
    for name in MAKERS:
        try:
            out[name] = load_decoder(name, seed=3)
        except CodecUnavailableError as exc:  # VoxCPM's upstream sources absent (CI without make install)
            out[name] = exc
    return out


def decoder_of(decoders, name):
    dec = decoders[name]
    if isinstance(dec, Exception):
        pytest.skip(str(dec))
    return dec


@pytest.mark.parametrize("name", sorted(MAKERS))
@settings(max_examples=8, deadline=None)
@given(n=st.integers(0, 30), first_chunk=st.integers(1, 4), chunk=st.integers(2, 12), per_step=st.integers(1, 2),
       seed=st.integers(0, 999), threaded=st.booleans())
def test_chunked_equals_whole(decoders, name, n, first_chunk, chunk, per_step, seed, threaded):
    """Two requests interleaved (different lengths, so never the same audio) on a random chunk schedule."""
    dec = decoder_of(decoders, name)
    reqs = {f"{name}-{i}": MAKERS[name](n + 3 * i, seed + i) for i in range(2)}
    out, stream = stream_codes(dec, reqs, first_chunk=first_chunk, chunk=chunk, frames_per_step=per_step,
                               threaded=threaded)
    for rid, frames in reqs.items():
        got, ref = joined(out[rid]), whole(dec, frames)
        assert len(got) == len(ref)
        if len(ref):
            assert float((got - ref).abs().max()) <= TOL * max(1.0, float(ref.abs().max())), rid
    assert stream.retained()["emitters"] == 0 and stream.retained()["streams"] == 0


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_streams_are_frames_times_samples_per_frame(decoders, name):
    dec = decoder_of(decoders, name)
    frames = MAKERS[name](17, 5)
    out, _ = stream_codes(dec, {"a": frames}, chunk=5)
    audio_frames = 17  # Higgs: 17 audio frames make 25 published rows
    got = joined(out["a"])
    assert len(got) == audio_frames * dec.samples_per_frame
    # Audible and driven by the codes: the equality checks compare a signal that differs from request
    # to request, not near-zeros (upstream inits give ~1e-8 here) or a bias pattern any codes share.
    assert 0.01 < float(got.std()) and float(got.abs().max()) > 0.05
    other = whole(dec, MAKERS[name](17, 6))
    assert float((other - got).std()) > 0.5 * float(got.std())


def test_qwen3_omni_window_arithmetic(decoders):
    from models.qwen3_omni.codec import output_length, released_code2wav_config, tiny_code2wav_config

    released = released_code2wav_config()
    assert output_length(released, 10) == 10 * 1920 - 555  # the 555 samples a window cannot know yet
    dec = decoder_of(decoders, "qwen3_omni")
    assert (dec.samples_per_frame, dec.tail_samples) == (1920, 555) == (1920, 1920 - output_length(tiny_code2wav_config(), 1))
    frames = omni_frames(12, 1).unsqueeze(0)
    assert dec.decode(frames, False).shape == (1, 12 * 1920 - 555)
    assert dec.decode(frames, True).shape == (1, 12 * 1920)
    # Slicing the context off the front (upstream's chunked_decode rule) would lose the tail at each boundary.
    ctx, new = 6, 6
    front_sliced = dec.decode(frames, False)[0, ctx * 1920:]
    assert len(front_sliced) == new * 1920 - 555


def test_qwen3_tts_window_arithmetic(decoders):
    from models.qwen3_tts.codec import released_decoder_config
    from models.qwen3_tts.tokenizer_decoder import receptive_frames

    dec = decoder_of(decoders, "qwen3_tts")
    frames = omni_frames(12, 1).unsqueeze(0)
    # Causal, no trimmed tail: every sample of a window is exact, none waits for the next frame.
    assert dec.samples_per_frame == 1920 and dec.lookahead_frames == 0
    assert dec.decode(frames, False).shape == dec.decode(frames, True).shape == (1, 12 * 1920)
    assert receptive_frames(released_decoder_config()) >= 2 + 8 * 71


def test_higgs_window_arithmetic(decoders):
    dec = decoder_of(decoders, "higgs_audio_v3")
    rows = higgs_frames(20, 2)  # 28 published rows
    assert dec.undelay(rows.unsqueeze(0)).shape == (1, 21, 8)
    assert dec.decode(rows.unsqueeze(0), True).shape == (1, 20 * dec.samples_per_frame)  # up to the first EOC
    assert dec.decode(rows[:18].unsqueeze(0), False).shape == (1, max(0, 18 - 7 - dec.radius) * dec.samples_per_frame)
    length_ended = higgs_frames(20, 2, ended=False)  # max_frames hit mid-stream: the last 7 rows are partial
    assert dec.decode(length_ended.unsqueeze(0), True).shape == (1, 13 * dec.samples_per_frame)
    assert dec.lookahead_frames == 7 + dec.radius
    assert DecoderTiming.of(dec).first_chunk_frames == dec.lookahead_frames + 1


def test_higgs_refuses_codes_out_of_range(decoders):
    dec = decoder_of(decoders, "higgs_audio_v3")
    rows = higgs_frames(10, 2)
    rows[9, 2] = 1024  # BOC where an audio code belongs
    with pytest.raises(ValueError, match=r"code ids must be in \[0, 1024\)"):
        dec.decode(rows.unsqueeze(0), True)


def test_voxcpm_window_arithmetic(decoders):
    dec = decoder_of(decoders, "voxcpm2")
    assert dec.samples_per_frame == 4 * 1920 and dec.lookahead_frames == 0
    assert dec.decode(voxcpm_frames(5, 1).unsqueeze(0), False).shape == (1, 5 * 4 * 1920)
    bad = voxcpm_frames(3, 1)
    bad[1, 1:] = PayloadSpec((4, 8), torch.float32).encode(torch.full((1, 4, 8), float("nan")))[0]
    with pytest.raises(ValueError, match="NaN"):
        dec.decode(bad.unsqueeze(0), True)


def test_omni_codes_out_of_range_are_refused(decoders):
    dec = decoder_of(decoders, "qwen3_omni")
    with pytest.raises(ValueError, match="Qwen3-Omni"):
        dec.decode(torch.full((1, 3, 16), 2048), True)


def _save(tmp_path, config: dict, module, prefix=""):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {f"{prefix}{k}": v.contiguous().clone() for k, v in module.state_dict().items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))


def test_checkpoints_load_by_name(decoders, tmp_path):
    from models.higgs_audio_v3 import codec as higgs
    from models.qwen3_omni import codec as omni

    dec = decoder_of(decoders, "qwen3_omni")
    _save(tmp_path / "omni", {"code2wav_config": dec.config.to_dict()}, dec.module, prefix="code2wav.")
    loaded = omni.load_decoder(tmp_path / "omni")
    frames = omni_frames(9, 4).unsqueeze(0)
    assert torch.equal(loaded.decode(frames, True), dec.decode(frames, True))

    from models.qwen3_tts import codec as tts

    dec = decoder_of(decoders, "qwen3_tts")
    _save(tmp_path / "tts", {"decoder_config": dec.config.to_hf_dict()}, dec.module, prefix="decoder.")
    loaded = tts.load_decoder(tmp_path / "tts")
    assert torch.equal(loaded.decode(frames, True), dec.decode(frames, True))

    dec = decoder_of(decoders, "higgs_audio_v3")
    _save(tmp_path / "higgs", dec.config.to_dict(), dec.module)
    loaded = higgs.load_decoder(tmp_path / "higgs")
    rows = higgs_frames(9, 4).unsqueeze(0)
    assert torch.equal(loaded.decode(rows, True), dec.decode(rows, True))


def test_voxcpm_checkpoint_loads_by_name(decoders, tmp_path):
    from models.voxcpm2 import codec as vox

    dec = decoder_of(decoders, "voxcpm2")
    _save(tmp_path, {"patch_size": 4, "audio_vae_config": dec.vae_config}, dec.module, prefix="audio_vae.")
    loaded = vox.load_decoder(tmp_path)
    frames = voxcpm_frames(6, 4).unsqueeze(0)
    assert torch.equal(loaded.decode(frames, True), dec.decode(frames, True))


def test_a_checkpoint_missing_a_tensor_is_named(decoders, tmp_path):
    from models.qwen3_omni import codec as omni
    from models.safetensors_files import CheckpointError

    dec = decoder_of(decoders, "qwen3_omni")
    (tmp_path / "config.json").write_text(json.dumps(dec.config.to_dict()))
    tensors = {k: v.contiguous().clone() for k, v in dec.module.state_dict().items() if k != "code_embedding.weight"}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="code_embedding.weight"):
        omni.load_decoder(tmp_path)


def test_released_sizes_are_constructible_on_meta():
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    from models.higgs_audio_v3.codec import HiggsDecodePath, released_tokenizer_config
    from models.qwen3_omni.codec import receptive_frames, released_code2wav_config

    from models.qwen3_tts.codec import released_decoder_config
    from models.qwen3_tts.tokenizer_decoder import TokenizerDecoder

    with torch.device("meta"):
        omni = Qwen3OmniMoeCode2Wav(released_code2wav_config())
        higgs = HiggsDecodePath(released_tokenizer_config())
        tts = TokenizerDecoder(released_decoder_config())
    assert sum(p.numel() for p in omni.parameters()) > 100e6
    assert sum(p.numel() for p in tts.parameters()) > 100e6
    assert sum(p.numel() for p in higgs.parameters()) > 10e6
    assert receptive_frames(released_code2wav_config()) >= 8 * 71  # eight sliding-window layers of 72


@pytest.mark.parametrize("talker", ["chatterbox", "moss_tts_local"])
def test_talkers_without_a_decoder_refuse_by_name(talker):
    with pytest.raises(CodecUnavailableError, match=f"talker '{talker}' has no audio output: .*codes only"):
        load_decoder(talker)


def test_a_talker_declaring_no_decoder_says_so():
    with pytest.raises(CodecUnavailableError, match="declares no CODEC_DECODER"):
        load_decoder("mtp_lm")


def test_seeded_decoders_are_reproducible(decoders):
    dec = decoder_of(decoders, "qwen3_omni")
    again = load_decoder("qwen3_omni", seed=3)
    frames = omni_frames(5, 0).unsqueeze(0)
    assert torch.equal(again.decode(frames, True), dec.decode(frames, True))
    assert math.isfinite(float(dec.decode(frames, True).abs().sum()))


@pytest.mark.parametrize("name", ["qwen3_tts", "qwen3_omni", "voxcpm2"])
def test_too_short_a_context_breaks_chunked_equals_whole(decoders, name):
    """The property can fail on a real decoder: one frame of context, far short of its receptive field."""
    dec = decoder_of(decoders, name)
    frames = MAKERS[name](20, 8)
    declared, dec.left_context_frames = dec.left_context_frames, 1
    try:
        out, _ = stream_codes(dec, {"a": frames}, first_chunk=2, chunk=4)
    finally:
        dec.left_context_frames = declared
    got, ref = joined(out["a"]), whole(dec, frames)
    assert float((got - ref).abs().max()) > 100 * TOL * max(1.0, float(ref.abs().max()))
