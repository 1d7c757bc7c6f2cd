"""Fast tests for models/voxcpm2: config round trip, sizes on meta, checkpoints, batch invariance, slot isolation."""

from __future__ import annotations

import json

import attrs
import pytest
import torch
from safetensors.torch import load_file, save_file

from models.voxcpm2 import (
    CheckpointError,
    LocalConfig,
    VoxCPM2Config,
    VoxCPM2Core,
    load_checkpoint,
    save_checkpoint,
    tiny_config,
    voxcpm2_config,
)
from mtp_fsm._util.threads import torch_threads

SLOTS = 4
PROMPTS = ["hello", "a longer prompt here", "x", "voxcpm two"]


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):  # tiny tensors: thread hand-offs cost more than the arithmetic
        yield


def make(seed: int = 0, **overrides) -> VoxCPM2Core:
    core = VoxCPM2Core(tiny_config(**overrides), seed=seed)
    core.bind_slots(SLOTS, torch.device("cpu"))
    return core


def pack(core: VoxCPM2Core, requests: list[tuple[int, str]]):
    """Flat prefill batch of (slot, text) requests: embeds, positions, slots, is_audio, last-row index each."""
    embeds, positions, slots, last = [], [], [], []
    for slot, text in requests:
        ids = torch.tensor(core.tokenize(text))
        embeds.append(core.prompt_embeds(ids))
        positions.append(torch.arange(len(ids)))
        slots.append(torch.full((len(ids),), slot))
        last.append(sum(len(p) for p in positions) - 1)
    n = sum(len(p) for p in positions)
    return torch.cat(embeds), torch.cat(positions), torch.cat(slots), torch.zeros(n, dtype=torch.bool), last


def decode_inputs(core: VoxCPM2Core, hidden: torch.Tensor, seeds: list[int]):
    """One decode step's row math for a batch: stop logits, patch (per-row noise) and next input."""
    p, d = core.config.patch_size, core.config.feat_dim
    noise = torch.stack([torch.randn(p, d, generator=torch.Generator().manual_seed(s)) for s in seeds])
    prefix = torch.stack([torch.full((p, d), 0.1 * s) for s in seeds])
    patch = core.patch(hidden, prefix, noise)
    return core.stop_logits(hidden), patch, core.next_embed(patch)


def test_config_round_trip():
    for cfg in (tiny_config(), voxcpm2_config(), tiny_config(lm_config=attrs.evolve(
            tiny_config().lm_config, use_mup=True, kv_channels=None, short_factor=(1.0,)))):
        data = json.loads(json.dumps(cfg.to_hf_dict()))
        assert VoxCPM2Config.from_hf_dict(data) == cfg
    # A release-style file: extra upstream keys, "mean_mode" (ignored upstream too), no engine section.
    release = voxcpm2_config().to_hf_dict()
    release.pop("mtp_fsm")
    release["dit_config"].pop("dit_mean_mode")
    release["dit_config"]["mean_mode"] = False
    release.update(device="cuda", audio_vae_config={"latent_dim": 64, "out_sample_rate": 48000})
    cfg = VoxCPM2Config.from_hf_dict(release)
    assert attrs.evolve(cfg, audio_vae_config=None) == voxcpm2_config()
    assert cfg.residual_lm.no_rope and cfg.residual_lm.vocab_size == 0 and cfg.encoder_lm.num_key_value_heads == 2
    with pytest.raises(ValueError, match="rope factors"):
        tiny_config(encoder_config=LocalConfig(hidden_dim=32, ffn_dim=64, num_heads=4, num_layers=1, kv_channels=8))


def _expected_parameters(cfg: VoxCPM2Config) -> tuple[int, int]:
    """Independent count from the config: (total, base LM + residual LM)."""
    lm = cfg.lm_config

    def stack(hidden, heads, kv, head_dim, ffn, layers):
        attn = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim
        return layers * (attn + 3 * hidden * ffn + 2 * hidden) + hidden

    def linear(i, o, bias=True):
        return i * o + (o if bias else 0)

    h, kv, hd = lm.hidden_size, lm.num_key_value_heads, lm.head_dim
    base = lm.vocab_size * h + stack(h, lm.num_attention_heads, kv, hd, lm.intermediate_size, lm.num_hidden_layers)
    residual = stack(h, lm.num_attention_heads, kv, hd, lm.intermediate_size, cfg.residual_lm_num_layers)
    e, d, f = cfg.encoder_config, cfg.dit_config, cfg.feat_dim
    enc = e.hidden_dim + linear(f, e.hidden_dim) + stack(
        e.hidden_dim, e.num_heads, kv, e.kv_channels or e.hidden_dim // e.num_heads, e.ffn_dim, e.num_layers)
    dit = (2 * linear(f, d.hidden_dim) + linear(d.hidden_dim, f) + 4 * linear(d.hidden_dim, d.hidden_dim)
           + stack(d.hidden_dim, d.num_heads, kv, d.kv_channels or d.hidden_dim // d.num_heads, d.ffn_dim,
                   d.num_layers))
    heads = (linear(h, cfg.scalar_quantization_latent_dim) + linear(cfg.scalar_quantization_latent_dim, h)
             + linear(e.hidden_dim, h) + 2 * linear(h, d.hidden_dim) + linear(2 * h, h) + linear(h, h)
             + linear(h, 2, bias=False))
    return base + residual + enc + dit + heads, base + residual


def test_real_config_on_meta():
    core = VoxCPM2Core(voxcpm2_config(), device="meta", dtype=torch.bfloat16)
    total, lm_part = _expected_parameters(core.config)
    counted = core.num_parameters()
    counted_lm = sum(p.numel() for n, p in core.module.named_parameters() if n.startswith(("base_lm.", "residual_lm.")))
    print(f"\nVoxCPM2 on meta: {counted:,} parameters ({counted_lm:,} in base + residual LM), "
          f"{len(core.module.state_dict())} tensors")
    assert (counted, counted_lm) == (total, lm_part)
    assert len(core.module.state_dict()) == 577  # tensor count of the released model.safetensors
    assert 1.8e9 < counted_lm < 1.9e9 and 2.2e9 < counted < 2.4e9
    layout = core._kv_layout()
    assert layout == (36, 4096, 2, 128)
    tiny = VoxCPM2Core(tiny_config(), device="meta")
    assert tiny.num_parameters() == _expected_parameters(tiny.config)[0]


def test_checkpoint_round_trip(tmp_path):
    core = make(seed=3)
    save_checkpoint(core, tmp_path / "ck")
    loaded = load_checkpoint(tmp_path / "ck")
    assert loaded.config == core.config
    a, b = core.module.state_dict(), loaded.module.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    loaded.bind_slots(SLOTS, torch.device("cpu"))
    batch = pack(core, [(0, "round trip")])[:4]
    assert torch.equal(core.forward(*batch), loaded.forward(*batch))

    tensors = load_file(str(tmp_path / "ck" / "model.safetensors"))
    tensors.pop("stop_head.weight")
    tensors["feat_decoder.estimator.extra.weight"] = torch.zeros(2)
    tensors["fsq_layer.in_proj.weight"] = torch.zeros(3, 3)
    tensors["audio_vae.decoder.bias"] = torch.zeros(1)  # upstream's merged VAE: ignored
    save_file(tensors, str(tmp_path / "ck" / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path / "ck")
    message = str(err.value)
    for name in ("stop_head.weight", "feat_decoder.estimator.extra.weight", "fsq_layer.in_proj.weight"):
        assert name in message
    assert "audio_vae" not in message


def test_batch_invariance_of_every_step_function():
    alone, batched = make(), make()
    # Prefill: the request in slot 2 alone vs packed between three others.
    one = pack(alone, [(2, PROMPTS[1])])
    many = pack(batched, [(0, PROMPTS[0]), (2, PROMPTS[1]), (3, PROMPTS[2]), (1, PROMPTS[3])])
    h_alone = alone.forward(*one[:4])
    h_many = batched.forward(*many[:4])
    start = many[-1][0] + 1
    assert torch.equal(h_alone, h_many[start:start + len(h_alone)])

    # Row math of a decode step: the slot-2 row alone vs second of four rows.
    rows = torch.stack([h_many[i] for i in many[-1]])
    s_alone, p_alone, e_alone = decode_inputs(alone, h_alone[-1:], [7])
    s_many, p_many, e_many = decode_inputs(batched, rows, [5, 7, 9, 11])
    assert torch.equal(s_alone[0], s_many[1]) and torch.equal(p_alone[0], p_many[1])
    assert torch.equal(e_alone[0], e_many[1])

    # Decode forward: one token alone vs four tokens of four slots (in a different order).
    n = one[1].shape[0]
    d_alone = alone.forward(e_alone, torch.tensor([n]), torch.tensor([2]), torch.tensor([True]))
    lengths = [len(alone.tokenize(p)) for p in PROMPTS]
    order = [3, 1, 0, 2]  # row indices into e_many; row 1 is the slot-2 request
    slot_of, pos_of = [0, 2, 3, 1], lengths
    d_many = batched.forward(e_many[order], torch.tensor([pos_of[i] for i in order]),
                             torch.tensor([slot_of[i] for i in order]), torch.ones(4, dtype=torch.bool))
    assert torch.equal(d_alone[0], d_many[order.index(1)])


def test_padding_tokens_touch_no_slot():
    core = make()
    embeds, positions, slots, is_audio, _ = pack(core, [(0, PROMPTS[0]), (1, PROMPTS[1])])
    clean = core.forward(embeds, positions, slots, is_audio)
    snapshot = [(k[:SLOTS].clone(), v[:SLOTS].clone()) for k, v in core.dense_kv()]

    # Padding rows only (slot -1, any position, even past the context): no real slot changes.
    pad = torch.randn(6, core.config.hidden_size) * 100
    core.forward(pad, torch.tensor([0, 3, 5, 159, 400, -2]), torch.full((6,), -1),
                 torch.tensor([True, False, True, False, True, False]))
    for (k, v), (k0, v0) in zip(core.dense_kv(), snapshot):
        assert torch.equal(k[:SLOTS], k0) and torch.equal(v[:SLOTS], v0)

    # Interleaved with real tokens: the real rows' outputs are unchanged, bit for bit.
    fresh = make()
    mixed = torch.cat((pad[:2], embeds[:3], pad[2:4], embeds[3:], pad[4:]))
    mpos = torch.cat((torch.tensor([7, 0]), positions[:3], torch.tensor([1, 2]), positions[3:], torch.tensor([9, 9])))
    mslot = torch.cat((torch.tensor([-1, -1]), slots[:3], torch.tensor([-1, -1]), slots[3:], torch.tensor([-1, -1])))
    out = fresh.forward(mixed, mpos, mslot, torch.zeros(len(mixed), dtype=torch.bool))
    real = mslot >= 0
    assert torch.equal(out[real], clean)


def test_decode_loop_and_stop_rule():
    core = make(seed=1)
    cfg = core.config
    embeds, positions, slots, is_audio, last = pack(core, [(0, "short test")])
    hidden = core.forward(embeds, positions, slots, is_audio)[last]
    prefix = torch.zeros(1, cfg.patch_size, cfg.feat_dim)
    n = len(positions)
    for step in range(6):
        stop = core.stop_logits(hidden)
        patch = core.patch(hidden, prefix, torch.randn(1, cfg.patch_size, cfg.feat_dim))
        assert stop.shape == (1, 2) and patch.shape == (1, cfg.patch_size, cfg.feat_dim)
        assert torch.isfinite(patch).all() and torch.isfinite(stop).all()
        prefix = patch
        hidden = core.forward(core.next_embed(patch), torch.tensor([n + step]), torch.tensor([0]),
                              torch.tensor([True]))
    logits = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.5, 0.5], [0.0, 1.0]])
    steps = torch.tensor([3, 3, 3, 2])  # stop needs argmax 1 (ties -> 0) and step > min_len (2)
    assert core.stop_mask(logits, steps).tolist() == [True, False, False, False]
