"""Tests for the Higgs Audio v3 adapter: spec, prompt, heads, audio feedback, slot cache, config, checkpoints, sizes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.higgs_audio_v3 import (
    CheckpointError,
    HiggsAudioV3Config,
    HiggsAudioV3Talker,
    HiggsInputs,
    load_checkpoint,
    save_checkpoint,
    text_inputs,
    tiny_config,
    tiny_demo_talker,
    v3_config,
)
from models.qwen3_tts.config import UnsupportedConfigError

Q, V, BOC, EOC = 8, 1026, 1024, 1025
TTS, TEXT, AUDIO = 256, 257, 258  # the tiny byte tokenizer's prompt specials


def make(slots: int = 4, seed: int = 0, **overrides) -> HiggsAudioV3Talker:
    model = HiggsAudioV3Talker(tiny_config(**overrides), seed=seed)
    if slots:
        model.bind_slots(slots, torch.device("cpu"))
    return model


def prefill(model, embeds, slot, start=0):
    n = embeds.shape[0]
    return model.forward(embeds, torch.arange(start, start + n), torch.full((n,), slot))


class RecordingArgmax:
    """A fake engine sampler: argmax, recording each call's codebook and logits."""

    def __init__(self):
        self.calls: list[tuple[int, torch.Tensor]] = []

    def __call__(self, logits: torch.Tensor, q: int, *rest) -> torch.Tensor:
        self.calls.append((q, logits.clone()))
        return logits.argmax(-1)


def random_codes(batch: int, seed: int) -> torch.Tensor:
    return torch.randint(0, V, (batch, Q), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- spec and prompt


def test_spec():
    model = make(slots=0)
    spec = model.spec
    assert (spec.name, spec.num_codebooks, spec.backbone_vocab_size, spec.codebook_size) == ("higgs_audio_v3", Q, V, V)
    assert spec.eos_token_id is None and spec.lifecycle == "delay_pattern"
    assert (spec.delay_pattern.boc, spec.delay_pattern.eoc) == (BOC, EOC)
    assert (spec.hidden_size, spec.max_context) == (64, 160) and spec.has_mtp
    assert model.kv_cache_layout().bytes_per_position == 2 * 2 * 2 * 16 * 4


def test_prepare_layout_and_refusals():
    model = make(slots=0)
    prompt = model.prepare(text_inputs("hi")).prompt_embeds
    ids = torch.tensor([TTS, TEXT, ord("h"), ord("i"), AUDIO])
    assert torch.equal(prompt, model.module.text_embedding.weight[ids])
    assert torch.equal(model.prepare(HiggsInputs(text_ids=[104, 105])).prompt_embeds, prompt)
    with pytest.raises(ValueError, match="non-empty"):
        model.prepare(HiggsInputs(text="  "))
    with pytest.raises(ValueError, match="outside the text vocab"):
        model.prepare(HiggsInputs(text_ids=[999]))
    with pytest.raises(ValueError, match="max_context"):
        model.prepare(text_inputs("x" * 157))  # 157 + 3 specials = 160 positions
    model.prepare(text_inputs("x" * 156))
    with pytest.raises(ValueError, match="exactly one"):
        HiggsInputs(text="a", text_ids=[1])
    with pytest.raises(ValueError, match="HiggsInputs"):
        model.prepare("plain string")


def test_init_is_deterministic_from_the_seed():
    a, b, c = (tiny_demo_talker(seed=s).module.state_dict() for s in (0, 0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["body.layers.0.mlp.up_proj.weight"], c["body.layers.0.mlp.up_proj.weight"])


# ---------------------------------------------------------------- heads and audio feedback


def test_frame_embed_is_the_fixed_order_sum_and_batch_invariant():
    model = make(slots=0)
    codes = random_codes(5, seed=1)
    codes[0, :3] = torch.tensor([BOC, EOC, -7])  # fillers are real codes; garbage is clamped
    codes[1, 7] = 5000
    batch = model.frame_embed(codes)
    for row in range(5):
        alone = model.frame_embed(codes[row:row + 1])
        assert torch.equal(alone[0], batch[row])  # bit-identical alone vs in a batch of 5
    table = model.module.audio_table.weight.double()
    clamped = codes.clamp(0, V - 1)
    expected = sum(table[q * V + clamped[:, q]] for q in range(Q))
    torch.testing.assert_close(batch.double(), expected, rtol=0, atol=1e-5)


def test_mtp_samples_codebooks_1_to_7_from_the_fused_head():
    model = make()
    hidden = prefill(model, model.prepare(text_inputs("abc")).prompt_embeds, 0)
    hidden = torch.cat([hidden[-1:], torch.randn(2, 64, generator=torch.Generator().manual_seed(3))])
    cb0 = torch.tensor([7, BOC, EOC])
    sampler = RecordingArgmax()
    codes = model.mtp(hidden, cb0, sampler)
    assert [q for q, _ in sampler.calls] == list(range(1, Q))
    assert all(logits.shape == (3, V) for _, logits in sampler.calls)
    assert codes.shape == (3, Q) and codes.dtype == torch.long
    assert torch.equal(codes[:, 0], cb0)
    fused = (hidden.double() @ model.module.audio_table.weight.double().T).view(3, Q, V)
    for q, logits in sampler.calls:
        torch.testing.assert_close(logits.double(), fused[:, q], rtol=0, atol=1e-5)
        assert torch.equal(codes[:, q], logits.argmax(-1))
    cb0_logits = model.cb0_logits(hidden)
    assert cb0_logits.shape == (3, V)
    torch.testing.assert_close(cb0_logits.double(), fused[:, 0], rtol=0, atol=1e-5)
    text = model.text_step({}, torch.tensor([0, -1, 2]), torch.tensor(4))
    assert text.shape == (3, 64) and not text.any()


def test_padding_tokens_touch_no_slot():
    model = make(slots=2)
    prefill(model, model.prepare(text_inputs("ab")).prompt_embeds, 0)
    before = [(k[:2].clone(), v[:2].clone()) for k, v in model.dense_kv()]
    model.forward(torch.randn(3, 64), torch.tensor([0, 1, 999]), torch.full((3,), -1))
    assert all(torch.equal(k[:2], k0) and torch.equal(v[:2], v0)
               for (k, v), (k0, v0) in zip(model.dense_kv(), before))


def test_demo_wiring_reaches_eoc_on_codebook_0():
    """Greedy decode with the delay pattern's masks applied by hand (the engine's job):
    the tiny model's codebook 0 says EOC after about 2/3 of the prompt length."""
    model = make(slots=1)
    prompt = model.prepare(text_inputs("hello world")).prompt_embeds
    hidden, pos = prefill(model, prompt, 0)[-1:], prompt.shape[0]
    for frame in range(40):
        logits = model.cb0_logits(hidden)
        logits[:, BOC] = float("-inf")
        cb0 = logits.argmax(-1)
        if cb0.item() == EOC:
            break

        def sample(lg, q, frame=frame):
            lg = lg.clone()
            lg[:, [BOC, EOC]] = float("-inf")
            return torch.full_like(cb0, BOC) if q > frame else lg.argmax(-1)

        hidden = model.forward(model.frame_embed(model.mtp(hidden, cb0, sample)), torch.tensor([pos]),
                               torch.zeros(1, dtype=torch.long))
        pos += 1
    else:
        pytest.fail("no EOC within 40 frames")
    assert 4 <= frame <= 20, frame


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("cfg", [tiny_config(), v3_config(), tiny_config(max_context=96, init_std=0.05)])
def test_config_round_trip(cfg):
    data = json.loads(json.dumps(cfg.to_hf_dict()))
    assert HiggsAudioV3Config.from_hf_dict(data) == cfg
    assert data["model_type"] == "higgs_multimodal_qwen3"
    assert data["text_config"]["hidden_size"] == cfg.hidden_size
    assert data["audio_encoder_config"]["num_codebooks"] == Q and data["audio_encoder_config"]["vocab_size"] == V


def test_config_reads_upstream_layout_and_refuses_unsupported():
    upstream = {"model_type": "higgs_multimodal_qwen3",
                "audio_encoder_config": {"encoder_type": "discrete", "num_codebooks": 8, "vocab_size": 1026,
                                         "tie_word_embeddings": True},
                "text_config": {"model_type": "qwen3", "hidden_size": 2560, "num_hidden_layers": 36,
                                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                                "intermediate_size": 9728, "vocab_size": 151936, "rope_theta": None,
                                "max_position_embeddings": 40960, "tie_word_embeddings": True},
                "audio_stream_bos_id": 1024, "audio_stream_eos_id": 1025}
    assert HiggsAudioV3Config.from_hf_dict(upstream) == v3_config()
    untied = {**upstream, "audio_encoder_config": {**upstream["audio_encoder_config"], "tie_word_embeddings": False}}
    with pytest.raises(UnsupportedConfigError, match="tie_word_embeddings"):
        HiggsAudioV3Config.from_hf_dict(untied)
    biased = {**upstream, "text_config": {**upstream["text_config"], "attention_bias": True}}
    with pytest.raises(UnsupportedConfigError, match="attention_bias"):
        HiggsAudioV3Config.from_hf_dict(biased)
    with pytest.raises(ValueError, match="BOC/EOC"):
        tiny_config(audio_stream_eos_id=1024)


# ---------------------------------------------------------------- checkpoints


def test_checkpoint_round_trip(tmp_path):
    model = make()
    save_checkpoint(model, tmp_path)
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"tied.embedding.text_embedding.weight", "tied.embedding.modality_embeddings.0.embedding.weight",
            "body.norm.weight", "body.layers.1.self_attn.q_norm.weight", "body.layers.0.mlp.gate_proj.weight"} <= keys
    loaded = load_checkpoint(tmp_path)
    loaded.bind_slots(4, torch.device("cpu"))
    assert loaded.config == model.config
    a, b = model.module.state_dict(), loaded.module.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    prompt = model.prepare(text_inputs("round trip")).prompt_embeds
    assert torch.equal(loaded.prepare(text_inputs("round trip")).prompt_embeds, prompt)
    h1, h2 = prefill(model, prompt, 1), prefill(loaded, prompt, 1)
    assert torch.equal(h1, h2)
    assert torch.equal(model.cb0_logits(h1[-2:]), loaded.cb0_logits(h2[-2:]))
    cb0 = torch.tensor([3, 9])
    s1, s2 = RecordingArgmax(), RecordingArgmax()
    assert torch.equal(model.mtp(h1[-2:], cb0, s1), loaded.mtp(h2[-2:], cb0, s2))
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(s1.calls, s2.calls))


def test_checkpoint_mismatch_names_every_tensor(tmp_path):
    save_checkpoint(make(slots=0), tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["body.norm.weight"]
    tensors["body.layers.0.extra.weight"] = torch.zeros(2)
    tensors["body.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 64)
    # Upstream's codec and tied heads are skipped, not unexpected.
    tensors["tied.embedding.modality_embeddings.0.model.decoder.weight"] = torch.zeros(2)
    tensors["tied.head.text_head.weight"] = torch.zeros(2)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path)
    message = str(err.value)
    assert "missing tensors: ['body.norm.weight']" in message
    assert "unexpected tensors: ['body.layers.0.extra.weight']" in message
    assert "body.layers.1.mlp.up_proj.weight: checkpoint (3, 64) vs model (128, 64)" in message
    assert "model.decoder" not in message and "text_head" not in message


# ---------------------------------------------------------------- sizes


def test_real_config_on_meta_parameter_count():
    cfg = v3_config()
    model = HiggsAudioV3Talker(cfg, device="meta")
    count = model.num_parameters()
    h, kv_dim, q_dim = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, cfg.num_attention_heads * cfg.head_dim
    per_layer = (2 * h * q_dim + 2 * h * kv_dim  # q, o; k, v
                 + 3 * h * cfg.intermediate_size  # gate, up, down
                 + 2 * cfg.head_dim + 2 * h)  # q_norm, k_norm, two layer norms
    expected = cfg.vocab_size * h + cfg.num_hidden_layers * per_layer + h + Q * V * h
    print(f"Higgs Audio v3 parameters: {count:,} (expected {expected:,})")
    assert expected == 4_043_480_576
    assert abs(count - expected) <= 0.1 * expected
    assert count == expected
    assert all(p.device.type == "meta" for p in model.module.parameters())
    assert tiny_demo_talker().num_parameters() == 616_000
