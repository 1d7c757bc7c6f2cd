"""Tests for the Qwen3-TTS adapter: shapes, slot KV cache, isolation, invariance, checkpoints, sizes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.qwen3_tts import (
    CheckpointError,
    Qwen3TTSConfig,
    Qwen3TTSTalker,
    TTSInputs,
    config_0_6b,
    config_1_7b,
    load_checkpoint,
    save_checkpoint,
    tiny_config,
)


def greedy(logits: torch.Tensor, g: int) -> torch.Tensor:
    return logits.argmax(-1)


def make(dtype=torch.float32, slots=4, seed=0, **overrides) -> Qwen3TTSTalker:
    model = Qwen3TTSTalker(tiny_config(**overrides), seed=seed, dtype=dtype)
    model.bind_slots(slots, torch.device("cpu"))
    return model


def prefill(model, embeds, slot, start=0):
    n = embeds.shape[0]
    return model.forward(embeds, torch.arange(start, start + n), torch.full((n,), slot))


def columns_for(model, prepared: dict[int, object]):
    spec = model.slot_columns()
    # Like the engine's slot table: max_slots + 1 rows, the last one scratch for padding rows.
    cols = {k: torch.full((model.max_slots + 1, *c.shape), c.fill, dtype=c.dtype) for k, c in spec.items()}
    for slot, p in prepared.items():
        text = p.columns["trailing_text"]
        cols["trailing_text"][slot, : text.shape[0]] = text
        cols["trailing_len"][slot] = p.columns["trailing_len"]
    return cols


def test_shapes_and_spec():
    model = make()
    spec = model.spec
    assert (spec.name, spec.num_codebooks) == ("qwen3_tts", 16)
    assert (spec.backbone_vocab_size, spec.codebook_size) == (3072, 2048)
    assert spec.eos_token_id == 2150 and spec.has_mtp and spec.max_context == 512
    p = model.prepare(TTSInputs(text="hello"))
    assert p.prompt_embeds.shape == (8, 64)  # 3 role + 5 codec-prefix positions
    assert p.columns["trailing_text"].shape == (5, 64) and int(p.columns["trailing_len"]) == 5
    hidden = prefill(model, p.prompt_embeds, 1)
    assert hidden.shape == (8, 64)
    logits = model.cb0_logits(hidden[-1:])
    assert logits.shape == (1, 3072)
    cb0 = torch.tensor([7, 2150, -3, 2047, 99999])  # EOS / garbage rows must stay in bounds
    codes = model.mtp(hidden[-1:].expand(5, -1), cb0, greedy)
    assert codes.shape == (5, 16) and codes.dtype == torch.int64
    assert torch.equal(codes[:, 0], cb0)
    assert ((codes[:, 1:] >= 0) & (codes[:, 1:] < 2048)).all()
    assert model.frame_embed(codes).shape == (5, 64)
    assert torch.isfinite(model.frame_embed(codes)).all()


def test_prompt_layout_speaker_and_language():
    model = make()
    cfg = model.config
    base = model.prepare(TTSInputs(text_ids=[72, 105]))
    spk = model.prepare(TTSInputs(text_ids=[72, 105], speaker_id=3000))
    lang = model.prepare(TTSInputs(text_ids=[72, 105], speaker_id=3000, language_id=2200))
    assert [x.prompt_embeds.shape[0] for x in (base, spk, lang)] == [8, 9, 10]
    t = model.talker
    ids = torch.tensor([72, cfg.tts_eos_token_id, cfg.codec_bos_id])
    proj = t.project_text(ids[:2])
    # Last prompt position: first text token + codec bos; trailing: rest of text + tts_eos.
    expect_last = proj[0] + t.model.codec_embedding(ids[2:])[0]
    torch.testing.assert_close(base.prompt_embeds[-1], expect_last)
    torch.testing.assert_close(base.columns["trailing_text"][-1], proj[1])
    with pytest.raises(ValueError):
        TTSInputs(text="a", text_ids=[1])
    with pytest.raises(ValueError):
        model.prepare(TTSInputs(text="x" * 300))  # longer than max_trailing_text
    with pytest.raises(ValueError):
        model.prepare(TTSInputs(text_ids=[600]))  # outside the tiny text vocab


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_kv_cache_chunking(batch_invariant):
    model = make(torch.float64, batch_invariant=batch_invariant)
    prompt = model.prepare(TTSInputs(text="chunked prefill")).prompt_embeds
    n = prompt.shape[0]
    whole = prefill(model, prompt, 0)[-1]
    model.reset_slots(torch.tensor([0]))
    prefill(model, prompt[:3], 0)
    two = prefill(model, prompt[3:], 0, start=3)[-1]
    model.reset_slots(torch.tensor([0]))
    for i in range(n):
        one = prefill(model, prompt[i : i + 1], 0, start=i)[-1]
    torch.testing.assert_close(two, whole, rtol=0, atol=1e-10)
    torch.testing.assert_close(one, whole, rtol=0, atol=1e-10)
    if batch_invariant:
        assert torch.equal(two, whole) and torch.equal(one, whole)


def test_padding_tokens_touch_no_slot():
    model = make(torch.float64)
    for slot in range(4):
        prefill(model, torch.randn(6, 64, dtype=torch.float64), slot)
    before = [(k.clone(), v.clone()) for k, v in model.dense_kv()]
    pad = torch.randn(5, 64, dtype=torch.float64) * 100
    out = model.forward(pad, torch.tensor([0, 1, 2, 3, 700]), torch.full((5,), -1))
    assert torch.isfinite(out).all()
    for (k0, v0), (k1, v1) in zip(before, model.dense_kv()):
        assert torch.equal(k0[:4], k1[:4]) and torch.equal(v0[:4], v1[:4])
    # Padding mixed into a real chunk changes neither that request's result nor other slots.
    x = torch.randn(3, 64, dtype=torch.float64)
    alone = model.forward(x, torch.tensor([6, 7, 8]), torch.tensor([2, 2, 2]))
    # The mixed step rewrites positions 6-8 of slot 2 (the same values) before it reads them.
    mixed = model.forward(torch.cat([pad[:2], x]), torch.tensor([6, 7, 6, 7, 8]), torch.tensor([-1, -1, 2, 2, 2]))
    torch.testing.assert_close(mixed[2:], alone, rtol=0, atol=1e-12)
    for (k0, _), (k1, _) in zip(before, model.dense_kv()):
        assert torch.equal(k0[[0, 1, 3]], k1[[0, 1, 3]])


@pytest.mark.parametrize(("dtype", "batch_invariant"), [(torch.float64, False), (torch.float32, True)])
def test_batch_isolation(dtype, batch_invariant):
    model = make(dtype, batch_invariant=batch_invariant)
    a = model.prepare(TTSInputs(text="first request")).prompt_embeds
    b = model.prepare(TTSInputs(text="second, longer request")).prompt_embeds
    ha = prefill(model, a, 0)
    hb = prefill(model, b, 2)
    model.reset_slots(torch.tensor([0, 2]))
    x = torch.cat([b[:4], a, b[4:]])  # interleaved order, different slots
    pos = torch.cat([torch.arange(4), torch.arange(a.shape[0]), torch.arange(4, b.shape[0])])
    slots = torch.cat([torch.full((4,), 2), torch.full((a.shape[0],), 0), torch.full((b.shape[0] - 4,), 2)])
    h = model.forward(x, pos, slots)
    got_a, got_b = h[4 : 4 + a.shape[0]], torch.cat([h[:4], h[4 + a.shape[0] :]])
    if batch_invariant:
        assert torch.equal(got_a, ha) and torch.equal(got_b, hb)
        rows = torch.cat([ha[-1:], hb[-1:]])
        cb0 = torch.tensor([11, 1500])
        both = model.mtp(rows, cb0, greedy)
        assert torch.equal(both[0], model.mtp(rows[:1], cb0[:1], greedy)[0])
        assert torch.equal(both[1], model.mtp(rows[1:], cb0[1:], greedy)[0])
    else:
        torch.testing.assert_close(got_a, ha, rtol=0, atol=1e-10)
        torch.testing.assert_close(got_b, hb, rtol=0, atol=1e-10)


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_frame_embed_batch_invariant(batch_invariant):
    model = make(batch_invariant=batch_invariant)
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 2048, (5, 16), generator=gen)
    batched = model.frame_embed(codes)
    for i in range(5):
        assert torch.equal(model.frame_embed(codes[i : i + 1])[0], batched[i])


def test_text_step_trailing_then_pad():
    model = make()
    p0 = model.prepare(TTSInputs(text="abc"))
    p3 = model.prepare(TTSInputs(text="wxyz!"))
    cols = columns_for(model, {0: p0, 3: p3})
    pad = model.tts_pad_embed()
    slots = torch.tensor([0, 0, 0, 3, 3, -1, 0, 4])  # 4 = the scratch row padding rows use
    frames = torch.tensor([0, 2, 3, 4, 5, 0, 400, 0])
    out = model.text_step(cols, slots, frames)
    assert torch.equal(out[0], p0.columns["trailing_text"][0])
    assert torch.equal(out[1], p0.columns["trailing_text"][2])  # tts_eos
    assert torch.equal(out[2], pad) and torch.equal(out[4], pad) and torch.equal(out[6], pad)
    assert torch.equal(out[3], p3.columns["trailing_text"][4])
    assert torch.isfinite(out[5]).all() and torch.isfinite(out[7]).all()


def test_reset_slots_zeroes_rows():
    model = make()
    prefill(model, torch.randn(4, 64), 1)
    prefill(model, torch.randn(4, 64), 2)
    model.reset_slots(torch.tensor([1, -1]))
    k = model.dense_kv()[0][0]
    assert not k[1].any() and k[2].any()
    assert model.kv_pool.blocks_in_use == 1  # slot 1's block went back to the pool


def test_demo_eos_follows_text():
    model = make()
    text = "Hello, mtp_fsm."
    p = model.prepare(TTSInputs(text=text))
    cols = columns_for(model, {1: p})
    allowed = torch.zeros(3072, dtype=torch.bool)
    allowed[:2048] = True
    allowed[2150] = True
    last = prefill(model, p.prompt_embeds, 1)[-1:]
    pos, frames = p.prompt_embeds.shape[0], 0
    while frames < 100:
        cb0 = model.cb0_logits(last).masked_fill(~allowed, float("-inf")).argmax(-1)
        if int(cb0) == 2150:
            break
        codes = model.mtp(last, cb0, greedy)
        x = model.frame_embed(codes) + model.text_step(cols, torch.tensor([1]), torch.tensor([frames]))
        last = model.forward(x, torch.tensor([pos]), torch.tensor([1]))
        pos, frames = pos + 1, frames + 1
    assert frames == len(text) + 1


def test_checkpoint_round_trip(tmp_path):
    model = make(seed=5)
    save_checkpoint(model, tmp_path / "ckpt")
    data = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert data["talker_config"]["code_predictor_config"]["num_code_groups"] == 16
    assert Qwen3TTSConfig.from_hf_dict(data) == model.config
    keys = set(load_file(str(tmp_path / "ckpt" / "model.safetensors")))
    for key in ("talker.model.codec_embedding.weight", "talker.model.text_embedding.weight",
                "talker.model.layers.0.self_attn.q_proj.weight", "talker.model.layers.0.self_attn.q_norm.weight",
                "talker.model.layers.0.input_layernorm.weight", "talker.model.layers.0.mlp.gate_proj.weight",
                "talker.model.norm.weight", "talker.text_projection.linear_fc1.weight",
                "talker.text_projection.linear_fc2.bias", "talker.codec_head.weight",
                "talker.code_predictor.model.layers.0.self_attn.k_norm.weight",
                "talker.code_predictor.model.norm.weight", "talker.code_predictor.model.codec_embedding.14.weight",
                "talker.code_predictor.lm_head.0.weight", "talker.code_predictor.small_to_mtp_projection.weight"):
        assert key in keys, key
    loaded = load_checkpoint(tmp_path / "ckpt")
    loaded.bind_slots(4, torch.device("cpu"))
    p = model.prepare(TTSInputs(text="round trip"))
    assert torch.equal(loaded.prepare(TTSInputs(text="round trip")).prompt_embeds, p.prompt_embeds)
    h0, h1 = prefill(model, p.prompt_embeds, 1), prefill(loaded, p.prompt_embeds, 1)
    assert torch.equal(h0, h1)
    assert torch.equal(model.mtp(h0[-1:], torch.tensor([3]), greedy), loaded.mtp(h1[-1:], torch.tensor([3]), greedy))

    # Sharded layout with an index, plus an ignored speaker-encoder tensor.
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    (shard_dir / "config.json").write_text(json.dumps(data))
    tensors = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    halves["model-00002-of-00002.safetensors"].append("speaker_encoder.fc.weight")
    tensors["speaker_encoder.fc.weight"] = torch.zeros(2, 2)
    weight_map = {}
    for fname, keys_in in halves.items():
        save_file({k: tensors[k] for k in keys_in}, str(shard_dir / fname))
        weight_map.update({k: fname for k in keys_in})
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = load_checkpoint(shard_dir, dtype=torch.float64)
    assert torch.equal(sharded.talker.codec_head.weight, model.talker.codec_head.weight.double())


def test_checkpoint_errors_name_keys(tmp_path):
    model = make()
    save_checkpoint(model, tmp_path)
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    del tensors["talker.model.layers.1.mlp.up_proj.weight"]
    tensors["talker.model.bogus.weight"] = torch.zeros(3)
    tensors["talker.codec_head.weight"] = torch.zeros(3072, 65)
    save_file(tensors, path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path)
    message = str(err.value)
    assert "talker.model.layers.1.mlp.up_proj.weight" in message
    assert "talker.model.bogus.weight" in message
    assert "talker.codec_head.weight" in message and "(3072, 65)" in message


def test_real_sizes_on_meta():
    small = Qwen3TTSTalker(config_0_6b(), device="meta")
    large = Qwen3TTSTalker(config_1_7b(), device="meta", dtype=torch.bfloat16)
    n_small, n_large = small.num_parameters(), large.num_parameters()
    print(f"\nQwen3-TTS 0.6B config: {n_small:,} params; 1.7B config: {n_large:,} params")
    assert 0.7e9 < n_small < 1.1e9
    assert 1.5e9 < n_large < 2.2e9
    assert large.spec.hidden_size == 2048 and large.spec.dtype == torch.bfloat16
    names = {k for k, _ in small.module.named_parameters()}
    assert "talker.code_predictor.small_to_mtp_projection.weight" not in names  # Identity upstream
    assert Qwen3TTSConfig.from_hf_dict(config_1_7b().to_hf_dict()) == config_1_7b()


def test_stale_cache_entries_are_never_read():
    model = make(torch.float64)
    prompt = model.prepare(TTSInputs(text="stale")).prompt_embeds
    clean = prefill(model, prompt, 1)
    # Garbage in slot 1's blocks beyond the prompt and in every free block (a block is zeroed
    # when a slot takes it, but the reads must not depend on that).
    pool, n = model.kv_pool, prompt.shape[0]
    positions = torch.arange(n, pool.table.shape[1] * pool.block_size)
    blocks = pool.table[1, positions // pool.block_size]
    held = blocks != 0
    free = torch.tensor(pool.free, dtype=torch.long)
    for cache_k, cache_v in zip(pool.k, pool.v):
        cache_k[blocks[held], positions[held] % pool.block_size] = float("nan")
        cache_v[blocks[held], positions[held] % pool.block_size] = float("inf")
        cache_k[free], cache_v[free] = float("nan"), float("inf")
    assert held.any()
    again = prefill(model, prompt, 1)
    assert torch.equal(again, clean)


def test_engine_frames_independent_of_row_order_and_chunking():
    from mtp_fsm.engine.engine import LockstepEngine
    from mtp_fsm.engine.plan import NewRequest, StepPlan
    from mtp_fsm.sampling import SamplingParams

    texts = {"a": "Hello there, engine.", "b": "Second!", "c": "x"}

    def run(reverse: bool, chunk: int | None) -> dict[str, torch.Tensor]:
        model = Qwen3TTSTalker(tiny_config(), seed=0)
        engine = LockstepEngine(model, 4)
        sampling = SamplingParams(temperature=0.9, top_k=50)
        new = tuple(NewRequest(rid, TTSInputs(text=t), max_frames=100, seed=i, cb0_sampling=sampling,
                               mtp_sampling=sampling) for i, (rid, t) in enumerate(texts.items()))
        left = {r.request_id: model.prepare(r.inputs).prompt_embeds.shape[0] for r in new}
        frames: dict[str, list[torch.Tensor]] = {rid: [] for rid in texts}
        done: set[str] = set()
        while len(done) < len(texts):
            rows = {}
            for rid in sorted(set(texts) - done, reverse=reverse):
                rows[rid] = min(left[rid], chunk or left[rid]) if left[rid] else 1
                left[rid] -= rows[rid] if left[rid] else 0
            out = engine.step(StepPlan.of(rows, new_requests=new))
            new = ()
            for frame in out.frames:
                frames[frame.request_id].append(frame.codes)
            done.update(f.request_id for f in out.finished)
        return {rid: torch.stack(v) for rid, v in frames.items()}

    plain, shuffled = run(False, None), run(True, 3)
    assert {rid: len(v) for rid, v in plain.items()} == {rid: len(t) + 1 for rid, t in texts.items()}
    assert all(torch.equal(plain[rid], shuffled[rid]) for rid in texts)


def test_upstream_style_config_json():
    data = config_0_6b().to_hf_dict()
    del data["mtp_fsm"]  # released files have no engine block
    data["talker_config"]["spk_id"] = {"ryan": 3061}  # upstream extras are ignored
    del data["talker_config"]["code_predictor_config"]["rope_theta"]
    cfg = Qwen3TTSConfig.from_hf_dict(data)
    assert (cfg.hidden_size, cfg.text_hidden_size, cfg.max_context, cfg.text_tokenizer) == (1024, 2048, 4096, "qwen")
    assert cfg.code_predictor.rope_theta == 10000.0 and cfg.rope_theta == 1_000_000.0


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (8, 2), (4, 4), (4, 1)])
def test_batch_invariant_attention_equals_the_matmul_path(heads, kv_heads):
    """Grouped-query attention: the batch-invariant path (last-axis reductions) pairs each
    query group with its own KV head, exactly like the matmul path (it once paired group g
    with KV head g: wrong when G == KV, a shape error otherwise)."""
    from models.qwen3_tts.layers import Attention

    torch.manual_seed(0)
    hidden, head_dim = 32, 8
    plain = Attention(hidden, heads, kv_heads, head_dim, 1e-6, bi=False).double()
    bi = Attention(hidden, heads, kv_heads, head_dim, 1e-6, bi=True).double()
    for p in plain.parameters():
        torch.nn.init.normal_(p)
    bi.load_state_dict(plain.state_dict())
    q = torch.randn(3, heads, head_dim, dtype=torch.float64)
    keys = torch.randn(3, 7, kv_heads, head_dim, dtype=torch.float64)
    vals = torch.randn(3, 7, kv_heads, head_dim, dtype=torch.float64)
    mask = torch.rand(3, 7) < 0.8
    mask[:, 0] = True
    assert torch.allclose(plain._attend(q, keys, vals, mask), bi._attend(q, keys, vals, mask), rtol=1e-12, atol=1e-12)
