"""Tests for the Qwen3-Omni adapter: MoE routing, feed text step, prompt, KV cache, checkpoints, sizes, engine feed."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import mtp_fsm.engine.engine as engine_module
from models.qwen3_omni import (
    STAND_IN,
    CheckpointError,
    OmniInputs,
    Qwen3OmniConfig,
    Qwen3OmniTalker,
    config_30b_a3b,
    load_checkpoint,
    save_checkpoint,
    text_inputs,
    thinker_embed,
    thinker_rows,
    thinker_table,
    tiny_config,
    tiny_demo_talker,
)
from mtp_fsm.model_api import FEED_COUNT, FEED_DONE, FEED_ROWS, feed_columns

SLOTS = 4
EOS = 2150
HAS_FEED = hasattr(engine_module.LockstepEngine, "feed")


def greedy(logits: torch.Tensor, g: int) -> torch.Tensor:
    return logits.argmax(-1)


def make(dtype=torch.float32, seed=0, **overrides) -> Qwen3OmniTalker:
    model = Qwen3OmniTalker(tiny_config(**overrides), seed=seed, dtype=dtype)
    model.bind_slots(SLOTS, torch.device("cpu"))
    return model


@pytest.fixture(scope="module")
def model() -> Qwen3OmniTalker:
    return make()


def feed_cols(model: Qwen3OmniTalker) -> dict[str, torch.Tensor]:
    """The engine-owned feed columns as the slot table holds them: max_slots + 1 rows, last = scratch."""
    return {k: torch.full((model.max_slots + 1, *c.shape), c.fill, dtype=c.dtype)
            for k, c in feed_columns(model.spec).items()}


def put_feed(cols, slot: int, rows: torch.Tensor, done: bool) -> None:
    cols[FEED_ROWS][slot].zero_()
    cols[FEED_ROWS][slot, : rows.shape[0]] = rows
    cols[FEED_COUNT][slot] = rows.shape[0]
    cols[FEED_DONE][slot] = int(done)


def prefill(model, embeds, slot, start=0):
    n = embeds.shape[0]
    return model.forward(embeds, torch.arange(start, start + n), torch.full((n,), slot))


# ---------------------------------------------------------------- spec, shapes, prompt


def test_spec_and_shapes(model):
    spec = model.spec
    assert (spec.name, spec.variant, spec.lifecycle) == ("qwen3_omni", "conditioned", "conditioned")
    assert spec.num_codebooks == 16
    assert (spec.backbone_vocab_size, spec.codebook_size, spec.eos_token_id) == (3072, 2048, EOS)
    assert spec.has_mtp and spec.has_feed and spec.max_context == 256
    assert (spec.feed_capacity, spec.feed_width, spec.hidden_size) == (256, 48, 64)
    assert model.slot_columns() == {}
    p = model.prepare(text_inputs("hello"))
    assert p.prompt_embeds.shape == (9, 64) and p.columns == {}  # 3 role + 4 tts_pad + tts_bos + first text
    rows, done = model.initial_feed(text_inputs("hello"))
    assert done and torch.equal(rows, thinker_rows("ello", 48))
    hidden = prefill(model, p.prompt_embeds, 1)
    assert hidden.shape == (9, 64)
    assert model.cb0_logits(hidden[-1:]).shape == (1, 3072)
    cb0 = torch.tensor([7, EOS, -3, 2047, 99999])  # EOS / garbage rows must stay in bounds
    codes = model.mtp(hidden[-1:].expand(5, -1), cb0, greedy)
    assert codes.shape == (5, 16) and codes.dtype == torch.int64 and torch.equal(codes[:, 0], cb0)
    assert ((codes[:, 1:] >= 0) & (codes[:, 1:] < 2048)).all()
    assert torch.isfinite(model.frame_embed(codes)).all() and model.frame_embed(codes).shape == (5, 64)
    # Upstream layout: the code predictor hidden equals the talker's, so no small_to_mtp_projection.
    assert not any("small_to_mtp" in k for k in model.module.state_dict())


def test_prompt_layout_matches_upstream_assembly(model):
    cfg, t = model.config, model.talker
    user = thinker_embed([STAND_IN.im_start_id, STAND_IN.user_id, 72, 105, STAND_IN.im_end_id], 48)
    head = thinker_embed([STAND_IN.im_start_id, STAND_IN.assistant_id, STAND_IN.newline_id, 79], 48)
    rows = torch.cat([user, head])
    hidden = torch.randn(5, 48, generator=torch.Generator().manual_seed(1))
    mm = torch.tensor([False, False, True, True, False])
    p = model.prepare(OmniInputs(prompt_rows=rows, user_hidden=hidden, user_mm_mask=mm, speaker_id=2301))
    assert p.prompt_embeds.shape == (14, 64)
    tp, hp, codec = t.text_projection, t.hidden_projection, t.model.codec_embedding
    bos, eos, pad = (t.text_projection(model.thinker_special_rows[i:i + 1])[0] for i in range(3))
    ids = [cfg.codec_nothink_id, cfg.codec_think_bos_id, cfg.codec_think_eos_id, 2301, cfg.codec_pad_id,
           cfg.codec_bos_id]
    c = codec(torch.tensor(ids))
    expect = [tp(user[i:i + 1])[0] if not mm[i] else hp(hidden[i:i + 1])[0] for i in range(5)]
    expect += [tp(head[i:i + 1])[0] for i in range(3)]
    expect += [pad + c[0], pad + c[1], pad + c[2], pad + c[3], bos + c[4], tp(head[3:4])[0] + c[5]]
    torch.testing.assert_close(p.prompt_embeds, torch.stack(expect), rtol=0, atol=1e-6)
    # Text inputs = the same assistant prefix with no user turn and the default speaker (ethan).
    default = model.prepare(OmniInputs(prompt_rows=thinker_embed(
        [STAND_IN.im_start_id, STAND_IN.assistant_id, STAND_IN.newline_id, ord("h")], 48)))
    assert torch.equal(default.prompt_embeds, model.prepare(text_inputs("hi")).prompt_embeds)
    torch.testing.assert_close(default.prompt_embeds[6] - pad, codec(torch.tensor(2302)), rtol=0, atol=1e-6)
    for bad in (dict(text="a", prompt_rows=rows), dict(), dict(text=""),
                dict(prompt_rows=rows, user_hidden=hidden)):
        with pytest.raises(ValueError):
            OmniInputs(**bad)
    for bad in (OmniInputs(prompt_rows=rows[:3]), OmniInputs(prompt_rows=torch.zeros(5, 47)),
                OmniInputs(prompt_rows=rows, speaker_id=5000), OmniInputs(prompt_rows=rows * float("nan")),
                OmniInputs(prompt_rows=torch.zeros(300, 48))):
        with pytest.raises(ValueError):
            model.prepare(bad)
    assert torch.equal(thinker_table(48)[[104, 105]], thinker_rows("hi", 48))


# ---------------------------------------------------------------- MoE


def _moe_reference_row(block, x: torch.Tensor) -> torch.Tensor:
    """Upstream's sparse MoE block for one row, written plainly."""
    probs = torch.softmax(block.gate.weight @ x, dim=-1)
    top_w, top_i = torch.topk(probs, block.gate.top_k)
    top_w = top_w / top_w.sum()
    out = sum(w * block.experts[int(e)](x[None])[0] for w, e in zip(top_w, top_i))
    return out + torch.sigmoid(block.shared_expert_gate(x[None])[0]) * block.shared_expert(x[None])[0]


def test_moe_routing_matches_plain_reference():
    model = make(torch.float64, batch_invariant=False)
    block = model.talker.model.layers[1].mlp
    with torch.no_grad():  # a stronger router and gate than the init, so routing is far from uniform
        block.gate.weight.mul_(50)
        block.shared_expert_gate.weight.mul_(50)
    x = torch.randn(12, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    logits, top_w, top_i = block.gate(x)
    assert torch.equal(top_i, torch.topk(torch.softmax(x @ block.gate.weight.T, -1), 2).indices)
    torch.testing.assert_close(top_w.sum(-1), torch.ones(12, dtype=torch.float64))
    dense = block.routing(x)
    assert ((dense > 0).sum(-1) == 2).all() and len(set(map(tuple, top_i.tolist()))) > 1
    out = block(x)
    for i in range(12):
        torch.testing.assert_close(out[i], _moe_reference_row(block, x[i]), rtol=0, atol=1e-12)
    # The shared expert is gated by sigmoid(g . x): silence the routed experts and only it remains.
    with torch.no_grad():
        for expert in block.experts:
            expert.down_proj.weight.zero_()
    gate = torch.sigmoid(block.shared_expert_gate(x))
    assert gate.min() < 0.2 and gate.max() > 0.8
    torch.testing.assert_close(block(x), gate * block.shared_expert(x), rtol=0, atol=1e-12)


def test_moe_row_depends_only_on_its_row():
    model = make()  # batch_invariant: bitwise
    block = model.talker.model.layers[0].mlp
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 64, generator=gen)
    batched = block(x)
    for i in range(9):
        assert torch.equal(block(x[i:i + 1])[0], batched[i])
    other = x.clone()
    other[1:] = torch.randn(8, 64, generator=gen) * 100
    assert torch.equal(block(other)[0], batched[0])
    # An expert no row 0 selects cannot reach row 0, even when its weights are NaN.
    unused = sorted(set(range(4)) - set(block.gate(x[:1])[2][0].tolist()))[0]
    with torch.no_grad():
        block.experts[unused].up_proj.weight.fill_(float("nan"))
    poisoned = block(x)
    assert torch.equal(poisoned[0], batched[0])


# ---------------------------------------------------------------- text step


def _text_step_reference(model, cols, slot: int, frame: int) -> torch.Tensor:
    slot = model.max_slots if slot < 0 else slot
    count, done = int(cols[FEED_COUNT][slot]), bool(cols[FEED_DONE][slot])
    if 0 <= frame < count:
        return model.talker.text_projection(cols[FEED_ROWS][slot, frame][None])[0]
    if done and frame == count:
        return model.tts_eos_embed()
    return model.tts_pad_embed()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    feeds=st.lists(st.tuples(st.integers(0, 12), st.booleans()), min_size=SLOTS, max_size=SLOTS),
    queries=st.lists(st.tuples(st.integers(-1, SLOTS), st.integers(-2, 16)), min_size=1, max_size=10),
    seed=st.integers(0, 2**16),
)
def test_text_step_matches_per_row_reference(model, feeds, queries, seed):
    cols = feed_cols(model)
    gen = torch.Generator().manual_seed(seed)
    for slot, (count, done) in enumerate(feeds):
        put_feed(cols, slot, torch.randn(count, 48, generator=gen), done)
    slots = torch.tensor([s for s, _ in queries])
    frames = torch.tensor([f for _, f in queries])
    out = model.text_step(cols, slots, frames)
    assert out.shape == (len(queries), 64) and out.dtype == torch.float32
    for i, (slot, frame) in enumerate(queries):
        assert torch.equal(out[i], _text_step_reference(model, cols, slot, frame)), (slot, frame)


def test_tts_eos_exactly_once_then_pad(model):
    cols = feed_cols(model)
    rows = thinker_rows("abcde", 48)
    put_feed(cols, 0, rows, done=True)
    put_feed(cols, 2, rows, done=False)
    frames = torch.arange(10)
    eos, pad = model.tts_eos_embed(), model.tts_pad_embed()
    done_out = model.text_step(cols, torch.zeros(10, dtype=torch.long), frames)
    open_out = model.text_step(cols, torch.full((10,), 2), frames)
    is_eos = [bool(torch.equal(r, eos)) for r in done_out]
    assert is_eos == [f == 5 for f in range(10)]
    assert all(torch.equal(done_out[f], pad) for f in range(6, 10))
    assert not any(torch.equal(r, eos) for r in open_out)
    for f in range(5):
        expect = model.talker.text_projection(rows[f:f + 1])[0]
        assert torch.equal(done_out[f], expect) and torch.equal(open_out[f], expect)
    assert not torch.equal(eos, pad)
    # A feed that ends empty: tts_eos at frame 0.
    put_feed(cols, 1, torch.zeros(0, 48), done=True)
    assert torch.equal(model.text_step(cols, torch.tensor([1]), torch.tensor([0]))[0], eos)


def test_text_step_padding_rows_finite_and_isolated(model):
    cols = feed_cols(model)
    put_feed(cols, 3, thinker_rows("xyz", 48), done=True)
    scratch = model.max_slots
    cols[FEED_COUNT][scratch] = 10**9  # garbage in the scratch row must not escape the gathers
    cols[FEED_DONE][scratch] = 7
    slots = torch.tensor([3, -1, scratch, 3, -5, 3])
    frames = torch.tensor([1, 0, 10**6, -4, 3, 3])
    out = model.text_step(cols, slots, frames)
    assert torch.isfinite(out).all()
    alone = model.text_step(cols, torch.tensor([3, 3, 3]), torch.tensor([1, -4, 3]))
    assert torch.equal(out[[0, 3, 5]], alone)
    assert torch.equal(out[5], model.tts_eos_embed())


# ---------------------------------------------------------------- backbone cache and isolation


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_kv_cache_chunking(batch_invariant):
    model = make(torch.float64, batch_invariant=batch_invariant)
    prompt = model.prepare(OmniInputs(prompt_rows=thinker_rows("user says hi", 48).double())).prompt_embeds
    whole = prefill(model, prompt, 0)[-1]
    model.reset_slots(torch.tensor([0]))
    prefill(model, prompt[:4], 0)
    two = prefill(model, prompt[4:], 0, start=4)[-1]
    model.reset_slots(torch.tensor([0]))
    for i in range(prompt.shape[0]):
        one = prefill(model, prompt[i:i + 1], 0, start=i)[-1]
    torch.testing.assert_close(two, whole, rtol=0, atol=1e-10)
    torch.testing.assert_close(one, whole, rtol=0, atol=1e-10)
    if batch_invariant:
        assert torch.equal(two, whole) and torch.equal(one, whole)


def test_padding_tokens_touch_no_slot_and_batch_isolation():
    model = make()
    a = model.prepare(text_inputs("first request")).prompt_embeds
    b = model.prepare(OmniInputs(prompt_rows=thinker_rows("a user turn, then", 48))).prompt_embeds
    ha, hb = prefill(model, a, 0), prefill(model, b, 2)
    before = [(k.clone(), v.clone()) for k, v in model.dense_kv()]
    pad = torch.randn(3, 64) * 100
    out = model.forward(pad, torch.tensor([0, 5, 700]), torch.full((3,), -1))
    assert torch.isfinite(out).all()
    for (k0, v0), (k1, v1) in zip(before, model.dense_kv()):
        assert torch.equal(k0[:SLOTS], k1[:SLOTS]) and torch.equal(v0[:SLOTS], v1[:SLOTS])
    model.reset_slots(torch.tensor([0, 2]))
    x = torch.cat([pad[:1], b[:4], a, b[4:]])  # interleaved, with a padding token
    pos = torch.cat([torch.tensor([3]), torch.arange(4), torch.arange(a.shape[0]), torch.arange(4, b.shape[0])])
    slots = torch.cat([torch.tensor([-1]), torch.full((4,), 2), torch.zeros(a.shape[0], dtype=torch.long),
                       torch.full((b.shape[0] - 4,), 2)])
    h = model.forward(x, pos, slots)
    assert torch.equal(h[5:5 + a.shape[0]], ha)
    assert torch.equal(torch.cat([h[1:5], h[5 + a.shape[0]:]]), hb)
    rows, cb0 = torch.cat([ha[-1:], hb[-1:]]), torch.tensor([11, 1500])
    both = model.mtp(rows, cb0, greedy)
    assert torch.equal(both[0], model.mtp(rows[:1], cb0[:1], greedy)[0])
    assert torch.equal(both[1], model.mtp(rows[1:], cb0[1:], greedy)[0])


# ---------------------------------------------------------------- demo EOS wiring


def _decode(model, text: str, steps: int):
    """Greedy CB0 (EOS excluded) for `steps` frames; P(EOS) at each CB0 sample (temperature 0.9)."""
    cols = feed_cols(model)
    rows, done = model.initial_feed(text_inputs(text))
    put_feed(cols, 1, rows, done)
    prompt = model.prepare(text_inputs(text)).prompt_embeds
    model.reset_slots(torch.tensor([1]))
    last = prefill(model, prompt, 1)[-1:]
    allowed = torch.zeros(3072, dtype=torch.bool)
    allowed[:2048] = True
    allowed[EOS] = True
    p_eos, greedy_eos = [], []
    for f in range(steps):
        logits = model.cb0_logits(last).masked_fill(~allowed, float("-inf"))
        p_eos.append(float(torch.softmax(logits / 0.9, -1)[0, EOS]))
        greedy_eos.append(int(logits.argmax(-1)) == EOS)
        cb0 = logits.masked_fill(torch.arange(3072) == EOS, float("-inf")).argmax(-1)
        text = model.text_step(cols, torch.tensor([1]), torch.tensor([f]))
        x = model.frame_embed(model.mtp(last, cb0, greedy)) + text
        last = model.forward(x, torch.tensor([prompt.shape[0] + f]), torch.tensor([1]))
    return p_eos, greedy_eos


def test_demo_eos_follows_the_end_of_the_feed(model):
    text = "Hi, omni"  # 7 fed rows: frames 0..6 carry them, frame 7 tts_eos, frame 8 tts_pad
    n = len(text) - 1
    p_eos, greedy_eos = _decode(model, text, n + 3)
    assert max(p_eos[: n + 1]) < 1e-3  # CB0 of frames 0..n: the feed is still being read
    assert 0.1 < p_eos[n + 1] < 0.9  # after the tts_eos step: sometimes
    assert p_eos[n + 2] > 0.99  # after a tts_pad step: almost surely
    assert greedy_eos.index(True) in (n + 1, n + 2) and not any(greedy_eos[: n + 1])


# ---------------------------------------------------------------- checkpoints


UPSTREAM_KEYS = (
    "talker.model.codec_embedding.weight", "talker.model.norm.weight",
    "talker.model.layers.0.input_layernorm.weight", "talker.model.layers.0.post_attention_layernorm.weight",
    "talker.model.layers.0.self_attn.q_proj.weight", "talker.model.layers.0.self_attn.k_proj.weight",
    "talker.model.layers.0.self_attn.v_proj.weight", "talker.model.layers.0.self_attn.o_proj.weight",
    "talker.model.layers.0.self_attn.q_norm.weight", "talker.model.layers.0.self_attn.k_norm.weight",
    "talker.model.layers.1.mlp.gate.weight", "talker.model.layers.1.mlp.experts.3.gate_proj.weight",
    "talker.model.layers.1.mlp.experts.3.up_proj.weight", "talker.model.layers.1.mlp.experts.3.down_proj.weight",
    "talker.model.layers.1.mlp.shared_expert.gate_proj.weight",
    "talker.model.layers.1.mlp.shared_expert.down_proj.weight",
    "talker.model.layers.1.mlp.shared_expert_gate.weight",
    "talker.text_projection.linear_fc1.weight", "talker.text_projection.linear_fc1.bias",
    "talker.text_projection.linear_fc2.weight", "talker.hidden_projection.linear_fc2.bias", "talker.codec_head.weight",
    "talker.code_predictor.model.layers.0.self_attn.q_norm.weight",
    "talker.code_predictor.model.layers.0.mlp.up_proj.weight",
    "talker.code_predictor.model.norm.weight", "talker.code_predictor.model.codec_embedding.14.weight",
    "talker.code_predictor.lm_head.14.weight", "thinker.model.embed_tokens.weight",
)


def _same_behaviour(a: Qwen3OmniTalker, b: Qwen3OmniTalker) -> None:
    p = a.prepare(text_inputs("round trip"))
    assert torch.equal(b.prepare(text_inputs("round trip")).prompt_embeds, p.prompt_embeds)
    b.bind_slots(SLOTS, torch.device("cpu"))
    a.reset_slots(torch.tensor([1]))
    h0, h1 = prefill(a, p.prompt_embeds, 1), prefill(b, p.prompt_embeds, 1)
    assert torch.equal(h0, h1)
    assert torch.equal(a.mtp(h0[-1:], torch.tensor([3]), greedy), b.mtp(h1[-1:], torch.tensor([3]), greedy))
    assert torch.equal(a.tts_specials(), b.tts_specials())


def test_checkpoint_round_trip_sharded_and_fused(tmp_path):
    model = make(seed=5)
    save_checkpoint(model, tmp_path / "ckpt")
    data = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert data["talker_config"]["text_config"]["num_experts"] == 4
    assert data["talker_config"]["code_predictor_config"]["num_code_groups"] == 16
    assert Qwen3OmniConfig.from_hf_dict(data) == model.config
    tensors = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    for key in UPSTREAM_KEYS:
        assert key in tensors, key
    loaded = load_checkpoint(tmp_path / "ckpt")
    _same_behaviour(model, loaded)

    # Sharded with an index, plus thinker / code2wav tensors the talker ignores.
    shard = tmp_path / "sharded"
    shard.mkdir()
    (shard / "config.json").write_text(json.dumps(data))
    extra = {"thinker.model.layers.0.mlp.gate.weight": torch.zeros(2, 2),
             "code2wav.pre_transformer.norm.weight": torch.ones(3)}
    names = sorted(tensors) + sorted(extra)
    everything = {**tensors, **extra}
    weight_map = {}
    halves = (("model-00001-of-00002.safetensors", names[::2]), ("model-00002-of-00002.safetensors", names[1::2]))
    for fname, keys in halves:
        save_file({k: everything[k] for k in keys}, str(shard / fname))
        weight_map.update({k: fname for k in keys})
    (shard / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = load_checkpoint(shard, dtype=torch.float64)
    assert torch.equal(sharded.talker.codec_head.weight, model.talker.codec_head.weight.double())

    # transformers >= 5 layout: experts fused into gate_up_proj [E, 2I, H] and down_proj [E, H, I].
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    (fused_dir / "config.json").write_text(json.dumps(data))
    fused = dict(tensors)
    for layer in range(2):
        base = f"talker.model.layers.{layer}.mlp.experts"
        gate = [fused.pop(f"{base}.{e}.gate_proj.weight") for e in range(4)]
        up = [fused.pop(f"{base}.{e}.up_proj.weight") for e in range(4)]
        fused[f"{base}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        fused[f"{base}.down_proj"] = torch.stack([fused.pop(f"{base}.{e}.down_proj.weight") for e in range(4)])
    save_file(fused, str(fused_dir / "model.safetensors"))
    _same_behaviour(model, load_checkpoint(fused_dir))


def test_checkpoint_errors_name_keys(tmp_path):
    model = make()
    save_checkpoint(model, tmp_path)
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    del tensors["talker.model.layers.1.mlp.experts.2.up_proj.weight"]
    del tensors["thinker.model.embed_tokens.weight"]
    tensors["talker.model.bogus.weight"] = torch.zeros(3)
    tensors["talker.model.layers.0.mlp.gate.weight"] = torch.zeros(5, 64)
    tensors["talker.model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(4, 64, 65)
    save_file(tensors, path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path)
    message = str(err.value)
    for part in ("talker.model.layers.1.mlp.experts.2.up_proj.weight", "talker.model.bogus.weight",
                 "thinker.model.embed_tokens.weight", "talker.model.layers.0.mlp.gate.weight", "(5, 64)",
                 "talker.model.layers.0.mlp.experts.gate_up_proj", "(4, 64, 65)"):
        assert part in message, part
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_checkpoint(tmp_path)
    real = Qwen3OmniTalker(tiny_config(thinker_stand_in=False), init_weights=True)
    with pytest.raises(ValueError, match="thinker_embed_tokens"):
        save_checkpoint(real, tmp_path / "x")
    with pytest.raises(ValueError, match="differ"):
        save_checkpoint(real, tmp_path / "x", thinker_embed_tokens=torch.ones(512, 48))


# ---------------------------------------------------------------- real size


def _talker_params(c: Qwen3OmniConfig) -> int:
    """Closed form from the upstream module shapes (per-layer attention + router + experts + shared)."""
    h, hd, cp = c.hidden_size, c.head_dim, c.code_predictor
    attn = h * hd * 2 * (c.num_attention_heads + c.num_key_value_heads) + 2 * hd
    experts = c.num_experts * (h + 3 * h * c.moe_intermediate_size)  # router row + SwiGLU expert
    layer = attn + 2 * h + experts + 3 * h * c.shared_expert_intermediate_size + h
    proj = 2 * (c.thinker_hidden_size * c.intermediate_size + c.intermediate_size + c.intermediate_size * h + h)
    cp_attn = cp.hidden_size * cp.head_dim * 2 * (cp.num_attention_heads + cp.num_key_value_heads) + 2 * cp.head_dim
    cp_layer = cp_attn + 3 * cp.hidden_size * cp.intermediate_size + 2 * cp.hidden_size
    groups = cp.num_code_groups - 1
    cp_total = cp.num_hidden_layers * cp_layer + cp.hidden_size + 2 * groups * cp.vocab_size * h
    return c.num_hidden_layers * layer + h + 2 * c.vocab_size * h + proj + cp_total


def test_real_config_on_meta():
    cfg = config_30b_a3b()
    real = Qwen3OmniTalker(cfg, device="meta", dtype=torch.bfloat16)
    n = real.num_parameters()
    print(f"\nQwen3-Omni-30B-A3B talker: {n:,} params; tiny: {tiny_demo_talker().num_parameters():,}")
    assert n == _talker_params(cfg) == 3_324_596_480  # the tech report's "3B" MoE talker
    h = cfg.hidden_size
    active = n - cfg.num_hidden_layers * (cfg.num_experts - cfg.num_experts_per_tok) * 3 * h * cfg.moe_intermediate_size
    assert 0.4e9 < active < 0.5e9  # ~0.29B in the backbone ("A0.3B") + the dense code predictor and heads
    spec = real.spec
    assert (spec.feed_width, spec.feed_capacity, spec.dtype) == (2048, 4096, torch.bfloat16)
    assert Qwen3OmniConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    assert _talker_params(tiny_config()) == make().num_parameters()


def test_upstream_style_config_json():
    data = config_30b_a3b().to_hf_dict()
    del data["mtp_fsm"]  # released files have no engine block
    text = data["talker_config"]["text_config"]
    text["num_local_experts"] = text.pop("num_experts")  # transformers >= 5 spelling
    text["rope_parameters"] = {"rope_theta": 1_000_000, "mrope_section": [24, 20, 20]}
    del text["rope_theta"]
    data["talker_config"]["position_id_per_seconds"] = 13  # upstream extras are ignored
    cfg = Qwen3OmniConfig.from_hf_dict(data)
    assert (cfg.num_experts, cfg.rope_theta, cfg.max_context, cfg.thinker_stand_in) == (128, 1_000_000, 4096, False)
    assert cfg == config_30b_a3b()
    with pytest.raises(ValueError, match="code predictor hidden"):
        tiny_config(hidden_size=96)


# ---------------------------------------------------------------- engine with a feed


@pytest.mark.skipif(not HAS_FEED, reason="LockstepEngine.feed not available yet")
def test_engine_feed_timing_does_not_change_frames():
    from mtp_fsm.engine.plan import NewRequest
    from mtp_fsm.sampling import SamplingParams

    from models.qwen3_omni.prompt import stand_in_prompt_rows

    texts = {"a": "Hello, omni.", "b": "xyz", "c": "q"}
    sampling = SamplingParams(temperature=0.9, top_k=50)

    def run(trickle: bool):
        model = tiny_demo_talker()
        engine = engine_module.LockstepEngine(model, 2)  # 3 requests, 2 slots: one waits for a slot
        pending = {}
        for i, (rid, text) in enumerate(texts.items()):
            inputs = text_inputs(text)  # the whole feed at admission
            if trickle:  # the same prompt, its feed to come row by row
                pending[rid] = model.initial_feed(inputs)[0]
                inputs = OmniInputs(prompt_rows=stand_in_prompt_rows(text, model.config.thinker_hidden_size)[0])
            engine.add_request(NewRequest(rid, inputs, max_frames=40, seed=i, cb0_sampling=sampling,
                                          mtp_sampling=sampling))
        frames = {rid: [] for rid in texts}
        finished, starved, step = {}, set(), 0
        while len(finished) < len(texts):
            if trickle and step % 3 == 0:
                for rid in list(pending):  # one row per request every third step; done with the last
                    rows = pending[rid]
                    engine.feed(rid, rows[:1], done=rows.shape[0] <= 1)
                    pending[rid] = rows[1:]
                    if rows.shape[0] <= 1:
                        del pending[rid]
            out = engine.step()
            step += 1
            assert step < 400
            if out is None:
                assert trickle and pending
                continue
            starved |= {rid for rid, state in engine.requests().items() if state == "starved"}
            for frame in out.frames:
                frames[frame.request_id].append(frame.codes)
            finished.update({f.request_id: f for f in out.finished})
        return {rid: torch.stack(v) for rid, v in frames.items()}, finished, starved

    plain, plain_end, _ = run(trickle=False)
    slow, slow_end, starved = run(trickle=True)
    assert starved  # the trickled run really waited for rows
    for rid, text in texts.items():
        assert plain_end[rid].reason.name == "EOS" and slow_end[rid].reason.name == "EOS"
        assert len(text) <= plain[rid].shape[0] <= len(text) + 1
        assert torch.equal(plain[rid], slow[rid])


def test_our_config_json_builds_the_official_talker_class():
    """Issue 31, mismatch 3: upstream's talker reads talker_config.spatial_merge_size in
    __init__ (no default), so a config.json without it cannot build the official class."""
    pytest.importorskip("transformers")
    try:
        from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as upstream_config
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as upstream_modeling
    except ImportError as exc:
        pytest.skip(f"transformers has no usable qwen3_omni_moe: {exc}")
    data = json.loads(json.dumps(tiny_config().to_hf_dict()))  # exactly what config.json holds
    talker = upstream_config.Qwen3OmniMoeTalkerConfig(**data["talker_config"])
    with torch.device("meta"):
        model = upstream_modeling.Qwen3OmniMoeTalkerForConditionalGeneration(talker)
    assert model.spatial_merge_size == 2
    assert model.config.text_config.hidden_size == tiny_config().hidden_size
