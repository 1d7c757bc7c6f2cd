"""Tests for the MOSS-TTS Local adapter: spec, pad, local MTP + stop, isolation, prompts, checkpoints, sizes, engine."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.moss_tts_local.adapter import STOP_SAMPLING
from models.moss_tts_local import (
    MOSS_AUDIO_SAMPLING,
    CheckpointError,
    LocalTransformerConfig,
    MossByteTokenizer,
    MossInputs,
    MossTTSLocalConfig,
    MossTTSLocalTalker,
    build_prompt_rows,
    config_v1_5,
    load_checkpoint,
    save_checkpoint,
    text_inputs,
    tiny_config,
    tiny_demo_talker,
)
from mtp_fsm._util.threads import torch_threads
from mtp_fsm.model_api import MtpResult

PAD = 1024
SLOTS = 4


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):  # tiny tensors: thread hand-offs cost more than the arithmetic
        yield


def greedy(logits: torch.Tensor, g: int, params=None) -> torch.Tensor:
    return logits.argmax(-1)


def make(dtype=torch.float32, seed=0, **overrides) -> MossTTSLocalTalker:
    model = MossTTSLocalTalker(tiny_config(**overrides), seed=seed, dtype=dtype)
    model.bind_slots(SLOTS, torch.device("cpu"))
    return model


def prefill(model, embeds, slot, start=0):
    n = embeds.shape[0]
    return model.forward(embeds, torch.arange(start, start + n), torch.full((n,), slot))


def run_direct(model, text: str, slot: int = 1, limit: int = 120, sample=greedy):
    """Drive one request by hand: (frames [N, 12], hidden rows each frame was sampled from)."""
    p = model.prepare(MossInputs(text=text))
    model.reset_slots(torch.tensor([slot]))
    last = prefill(model, p.prompt_embeds, slot)[-1:]
    pos, frames, hiddens = p.prompt_embeds.shape[0], [], [last]
    while len(frames) < limit:
        cb0 = sample(model.cb0_logits(last), 0)
        result = model.mtp(last, cb0, sample)
        if bool(result.stop[0]):
            break
        frames.append(result.codes[0])
        x = model.frame_embed(result.codes) + model.text_step({}, torch.tensor([slot]), torch.tensor([len(frames)]))
        last = model.forward(x, torch.tensor([pos]), torch.tensor([slot]))
        hiddens.append(last)
        pos += 1
    return torch.stack(frames) if frames else torch.zeros(0, 12, dtype=torch.long), torch.cat(hiddens)


def test_spec_and_shapes():
    model = make()
    spec = model.spec
    assert (spec.name, spec.variant, spec.lifecycle) == ("moss_tts_local", "mtp_stop", "mtp_stop")
    assert spec.num_codebooks == 12
    assert (spec.backbone_vocab_size, spec.codebook_size, spec.eos_token_id) == (1024, 1024, None)
    assert spec.has_mtp and spec.max_context == 256 and spec.hidden_size == 64
    assert spec.cb0_sampling == spec.mtp_sampling == MOSS_AUDIO_SAMPLING
    assert (MOSS_AUDIO_SAMPLING.temperature, MOSS_AUDIO_SAMPLING.top_k, MOSS_AUDIO_SAMPLING.top_p) == (1.7, 25, 0.8)
    assert model.slot_columns() == {}
    p = model.prepare(MossInputs(text="hello"))
    # im_start "user\n" hello im_end "\n" im_start "assistant\n" audio_start
    assert p.prompt_embeds.shape == (25, 64) and p.columns == {}
    hidden = prefill(model, p.prompt_embeds, 1)
    assert hidden.shape == (25, 64)
    assert model.cb0_logits(hidden[-1:]).shape == (1, 1024)
    cb0 = torch.tensor([7, 1023, -3, 1024, 99999])  # garbage rows must stay in bounds
    result = model.mtp(hidden[-1:].expand(5, -1), cb0, greedy)
    assert isinstance(result, MtpResult)
    assert result.codes.shape == (5, 12) and result.codes.dtype == torch.int64
    assert torch.equal(result.codes[:, 0], cb0)
    assert ((result.codes[:, 1:] >= 0) & (result.codes[:, 1:] < 1024)).all()
    assert result.stop.shape == (5,) and result.stop.dtype == torch.bool
    emb = model.frame_embed(result.codes)
    assert emb.shape == (5, 64) and torch.isfinite(emb).all()
    step = model.text_step({}, torch.tensor([0, 3, -1, 4]), torch.tensor([0, 9, 0, 300]))
    slot_row = model.module.transformer.embed_tokens.weight[model.config.audio_assistant_slot_token_id]
    assert step.shape == (4, 64) and all(torch.equal(row, slot_row) for row in step)


def test_pad_id_contributes_zero():
    model = make()
    tables = model.module.audio_embeddings
    assert all(t.num_embeddings == 1024 for t in tables)  # the pad id has no row
    assert not model.frame_embed(torch.full((2, 12), PAD)).any()
    codes = torch.randint(0, 1024, (3, 12), generator=torch.Generator().manual_seed(1))
    padded = codes.clone()
    padded[:, 5:] = PAD
    expect = sum(tables[q](codes[:, q]) for q in range(5))
    torch.testing.assert_close(model.frame_embed(padded), expect, rtol=0, atol=1e-6)
    # In a prompt, rows whose codes are all pad are exactly the text embedding.
    ids, rows = build_prompt_rows(model.config, MossInputs(text="hi"), model.tokenizer)
    assert (rows == PAD).all()
    p = model.prepare(MossInputs(text="hi"))
    assert torch.equal(p.prompt_embeds, model.module.transformer.embed_tokens(torch.tensor(ids)))


def test_mtp_samples_codebooks_1_to_11_in_order():
    model = make()
    hidden = prefill(model, model.prepare(MossInputs(text="order")).prompt_embeds, 0)[-1:].expand(3, -1)
    seen: list[tuple[int, tuple[int, ...]]] = []
    logits_at: dict[int, torch.Tensor] = {}

    stop_draws = []

    def recording(logits: torch.Tensor, g: int, params=None) -> torch.Tensor:
        if g == 12:  # the stop head: sampled with the model's own parameters, as codebook index n_vq
            stop_draws.append((tuple(logits.shape), params))
            return torch.zeros(logits.shape[0], dtype=torch.long)  # continue
        seen.append((g, tuple(logits.shape)))
        logits_at[g] = logits.clone()
        return torch.full((logits.shape[0],), 10 * g, dtype=torch.long)

    cb0 = torch.tensor([1, 2, 3])
    result = model.mtp(hidden, cb0, recording)
    assert seen == [(g, (3, 1024)) for g in range(1, 12)]
    assert stop_draws == [((3, 2), STOP_SAMPLING)] and not result.stop.any()
    assert torch.equal(result.codes[:, 0], cb0)
    assert torch.equal(result.codes[:, 1:], torch.arange(10, 120, 10).expand(3, -1))
    # Each position reads the previous codebook's code: the rows differ only in CB0, so
    # codebook 1's logits differ, and so do codebook 2's when codebook 1's code changes.
    assert not torch.equal(logits_at[1][0], logits_at[1][1])
    first1, first2 = logits_at[1].clone(), logits_at[2].clone()
    changed = model.mtp(hidden, cb0, lambda lg, g, params=None: recording(lg, g, params) + (g == 1))
    assert torch.equal(changed.codes[:, 1], torch.full((3,), 11))
    assert torch.equal(logits_at[1], first1) and not torch.equal(logits_at[2], first2)


def test_stop_of_a_row_depends_only_on_that_row():
    model = make()
    _, h_short = run_direct(model, "Hi", slot=0)
    _, h_long = run_direct(model, "A longer line of text to read aloud.", slot=2)
    # The last hidden of each run says stop; earlier ones continue; plus random rows.
    rows = torch.cat([h_short[-1:], h_long[:3], h_long[-1:], h_short[:2], torch.randn(2, 64)])
    cb0 = model.cb0_logits(rows).argmax(-1)
    both = model.mtp(rows, cb0, greedy)
    assert both.stop[0] and both.stop[4] and not both.stop[1:4].any()
    assert torch.equal(both.stop, model.stop_logits(rows).argmax(-1) == 1)
    for i in range(rows.shape[0]):
        alone = model.mtp(rows[i : i + 1], cb0[i : i + 1], greedy)
        assert torch.equal(alone.stop[0], both.stop[i]) and torch.equal(alone.codes[0], both.codes[i])
        assert torch.equal(model.cb0_logits(rows[i : i + 1])[0], model.cb0_logits(rows)[i])


def test_demo_requests_stop_on_their_own():
    model = make()
    counts = {}
    for text in ("Hi", "Hello, mtp_fsm.", "A somewhat longer sentence for the demo talker to read."):
        frames, _ = run_direct(model, text)
        counts[text] = frames.shape[0]
    gen = torch.Generator().manual_seed(0)

    def sampled(logits, g, params=None):
        probs = torch.softmax(logits / (1.0 if params is not None else 1.7), -1)
        return torch.multinomial(probs, 1, generator=gen)[:, 0]

    frames, _ = run_direct(model, "Hello, mtp_fsm.", sample=sampled)
    assert all(3 <= n <= 40 for n in counts.values()), counts
    assert list(counts.values()) == sorted(counts.values())  # longer text, longer audio
    assert 3 <= frames.shape[0] <= 40
    assert ((frames >= 0) & (frames < 1024)).all()


def test_padding_tokens_touch_no_slot():
    model = make(torch.float64)
    for slot in range(SLOTS):
        prefill(model, torch.randn(6, 64, dtype=torch.float64), slot)
    before = [(k.clone(), v.clone()) for k, v in model.dense_kv()]
    pad = torch.randn(5, 64, dtype=torch.float64) * 100
    out = model.forward(pad, torch.tensor([0, 1, 2, 3, 700]), torch.full((5,), -1))
    assert torch.isfinite(out).all()
    for (k0, v0), (k1, v1) in zip(before, model.dense_kv()):
        assert torch.equal(k0[:SLOTS], k1[:SLOTS]) and torch.equal(v0[:SLOTS], v1[:SLOTS])
    x = torch.randn(3, 64, dtype=torch.float64)
    alone = model.forward(x, torch.tensor([6, 7, 8]), torch.tensor([2, 2, 2]))
    # The mixed step rewrites positions 6-8 of slot 2 (the same values) before it reads them.
    mixed = model.forward(torch.cat([pad[:2], x]), torch.tensor([6, 7, 6, 7, 8]), torch.tensor([-1, -1, 2, 2, 2]))
    assert torch.equal(mixed[2:], alone)
    for (k0, _), (k1, _) in zip(before, model.dense_kv()):
        assert torch.equal(k0[[0, 1, 3]], k1[[0, 1, 3]])


def test_chunked_and_interleaved_prefill_match():
    model = make()
    a = model.prepare(MossInputs(text="first request")).prompt_embeds
    b = model.prepare(MossInputs(text="second, longer request")).prompt_embeds
    ha, hb = prefill(model, a, 0), prefill(model, b, 2)
    model.reset_slots(torch.tensor([0, 2]))
    prefill(model, a[:3], 0)
    assert torch.equal(prefill(model, a[3:], 0, start=3), ha[3:])
    model.reset_slots(torch.tensor([0]))
    x = torch.cat([b[:4], a, b[4:]])  # interleaved order, different slots
    pos = torch.cat([torch.arange(4), torch.arange(a.shape[0]), torch.arange(4, b.shape[0])])
    slots = torch.cat([torch.full((4,), 2), torch.full((a.shape[0],), 0), torch.full((b.shape[0] - 4,), 2)])
    h = model.forward(x, pos, slots)
    assert torch.equal(h[4 : 4 + a.shape[0]], ha)
    assert torch.equal(torch.cat([h[:4], h[4 + a.shape[0] :]]), hb)


def test_frame_embed_batch_invariant():
    model = make()
    codes = torch.randint(0, 1025, (6, 12), generator=torch.Generator().manual_seed(3))
    batched = model.frame_embed(codes)
    for i in range(6):
        assert torch.equal(model.frame_embed(codes[i : i + 1])[0], batched[i])


def test_reference_codes_and_prompt_layouts():
    model = make()
    cfg, tok = model.config, model.tokenizer
    ref = torch.randint(0, 1024, (5, 12), generator=torch.Generator().manual_seed(4))
    ref[1, 7:] = PAD
    ids, rows = build_prompt_rows(cfg, MossInputs(text="hi", reference_codes=ref), tok)
    plain_ids, _ = build_prompt_rows(cfg, MossInputs(text="hi"), tok)
    assert len(ids) == len(plain_ids) + 7  # audio_start + 5 slot rows + audio_end
    start = ids.index(cfg.audio_start_token_id)
    assert ids[start + 1 : start + 6] == [cfg.audio_user_slot_token_id] * 5
    assert ids[start + 6] == cfg.audio_end_token_id and ids[-1] == cfg.audio_start_token_id
    assert torch.equal(rows[start + 1 : start + 6], ref) and (rows[: start + 1] == PAD).all()
    p = model.prepare(MossInputs(text="hi", reference_codes=ref))
    slot_emb = model.module.transformer.embed_tokens.weight[cfg.audio_user_slot_token_id]
    torch.testing.assert_close(p.prompt_embeds[start + 2], slot_emb + model.frame_embed(ref[1:2])[0])
    # The upstream-processor form (prompt_ids + aligned code grid) gives the same embeddings.
    same = model.prepare(MossInputs(prompt_ids=ids, prompt_codes=rows))
    assert torch.equal(same.prompt_embeds, p.prompt_embeds)
    assert torch.equal(model.prepare(MossInputs(text_ids=tok.encode("hi"))).prompt_embeds,
                       model.prepare(text_inputs("hi")).prompt_embeds)
    for bad in (dict(text="a", text_ids=[1]), dict(prompt_ids=[1], reference_codes=ref),
                dict(text="a", prompt_codes=rows), dict()):
        with pytest.raises(ValueError):
            MossInputs(**bad)
    bad_ref = ref.clone()
    bad_ref[0, 0] = 1025
    for inputs in (MossInputs(text="hi", reference_codes=bad_ref), MossInputs(text="hi", reference_codes=ref[:, :11]),
                   MossInputs(prompt_ids=ids, prompt_codes=rows[:-1]), MossInputs(text_ids=[600]),
                   MossInputs(text="x" * 300), MossInputs(text="")):
        with pytest.raises(ValueError):
            model.prepare(inputs)


def test_full_template_matches_upstream_processor_layout():
    cfg = tiny_config(prompt_template="full", max_context=256)
    tok = MossByteTokenizer()
    ids, _ = build_prompt_rows(cfg, MossInputs(text="Hi", language="English"), tok)
    text = tok.decode(ids)
    assert ids[0] == cfg.im_start_token_id and ids[-1] == cfg.audio_start_token_id
    assert text.startswith("user\n<user_inst>\n- Reference(s):\nNone\n- Instruction:\nNone\n- Tokens:\nNone")
    assert text.endswith("- Language:\nEnglish\n- Text:\nHi\n</user_inst>\nassistant\n")
    tail = [cfg.im_end_token_id, 10, cfg.im_start_token_id, *tok.encode("assistant\n"), cfg.audio_start_token_id]
    assert ids[-len(tail) :] == tail
    ref_ids, _ = build_prompt_rows(cfg, MossInputs(text="Hi", reference_codes=torch.zeros(2, 12)), tok)
    assert "None\n- Instruction" not in tok.decode(ref_ids) and cfg.audio_user_slot_token_id in ref_ids
    with pytest.raises(ValueError):
        MossTTSLocalTalker(config_v1_5(), device="meta").prepare(MossInputs(text="no tokenizer"))


def test_checkpoint_round_trip(tmp_path):
    model = make(seed=5)
    save_checkpoint(model, tmp_path / "ckpt")
    data = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert data["model_type"] == "moss_tts_local" and data["gpt2_config"]["n_inner"] == 128
    assert data["qwen3_config"]["hidden_size"] == 64 and data["n_vq"] == 12 and data["audio_pad_token_id"] == PAD
    assert MossTTSLocalConfig.from_hf_dict(data) == model.config
    keys = set(load_file(str(tmp_path / "ckpt" / "model.safetensors")))
    for key in ("transformer.embed_tokens.weight", "transformer.layers.1.self_attn.q_proj.weight",
                "transformer.layers.0.self_attn.k_norm.weight", "transformer.layers.0.mlp.down_proj.weight",
                "transformer.layers.0.post_attention_layernorm.weight", "transformer.norm.weight",
                "audio_embeddings.11.weight", "audio_lm_heads.0.weight", "local_text_lm_head.weight",
                "local_transformer.h.0.ln_1.bias", "local_transformer.h.0.attn.c_attn.weight",
                "local_transformer.h.0.attn.c_attn.bias", "local_transformer.h.0.attn.c_proj.weight",
                "local_transformer.h.0.mlp.fc_in.bias", "local_transformer.h.0.mlp.fc_out.weight",
                "local_transformer.ln_f.weight"):
        assert key in keys, key
    loaded = load_checkpoint(tmp_path / "ckpt")
    loaded.bind_slots(SLOTS, torch.device("cpu"))
    p = model.prepare(MossInputs(text="round trip"))
    assert torch.equal(loaded.prepare(MossInputs(text="round trip")).prompt_embeds, p.prompt_embeds)
    h0, h1 = prefill(model, p.prompt_embeds, 1)[-1:], prefill(loaded, p.prompt_embeds, 1)[-1:]
    assert torch.equal(h0, h1)
    r0, r1 = model.mtp(h0, torch.tensor([3]), greedy), loaded.mtp(h1, torch.tensor([3]), greedy)
    assert torch.equal(r0.codes, r1.codes) and torch.equal(r0.stop, r1.stop)

    # Sharded layout with an index, plus the unused upstream text head (ignored).
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    (shard_dir / "config.json").write_text(json.dumps(data))
    tensors = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    tensors["text_lm_head.weight"] = torch.zeros(512, 64)
    names = sorted(tensors)
    weight_map = {}
    for i, fname in enumerate(("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")):
        save_file({k: tensors[k] for k in names[i::2]}, str(shard_dir / fname))
        weight_map.update({k: fname for k in names[i::2]})
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = load_checkpoint(shard_dir, dtype=torch.float64)
    assert torch.equal(sharded.module.audio_lm_heads[3].weight, model.module.audio_lm_heads[3].weight.double())


def test_checkpoint_carries_the_tied_text_lm_head(tmp_path):
    """Upstream's MossTTSLocalModel declares text_lm_head [vocab, hidden] tied to the text
    embedding; a checkpoint without it is refused by its loader (issue 31, mismatch 4)."""
    model = make(seed=5)
    save_checkpoint(model, tmp_path / "ckpt")
    tensors = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    head = tensors["text_lm_head.weight"]
    assert tuple(head.shape) == (model.config.vocab_size, model.config.hidden_size)
    assert torch.equal(head, tensors["transformer.embed_tokens.weight"])
    load_checkpoint(tmp_path / "ckpt")  # still loads (the head is tied, never read)


def test_checkpoint_errors_name_keys(tmp_path):
    model = make()
    save_checkpoint(model, tmp_path)
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    del tensors["local_transformer.h.0.mlp.fc_in.bias"]
    tensors["local_transformer.h.1.ln_1.weight"] = torch.zeros(64)
    tensors["audio_lm_heads.2.weight"] = torch.zeros(1025, 64)
    save_file(tensors, path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path)
    message = str(err.value)
    assert "missing keys" in message and "local_transformer.h.0.mlp.fc_in.bias" in message
    assert "unexpected keys" in message and "local_transformer.h.1.ln_1.weight" in message
    assert "audio_lm_heads.2.weight" in message and "(1025, 64)" in message
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="safetensors"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
        load_checkpoint(tmp_path / "empty")


def expected_parameters(cfg: MossTTSLocalConfig) -> int:
    """Count from the upstream config: Qwen3 backbone (no text_lm_head), audio tables and
    heads, the 2-way head and the GPT2-style local blocks (all projections with bias)."""
    h, kv, hd, heads = cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads
    attn = h * heads * hd * 2 + h * kv * hd * 2 + 2 * hd
    layer = attn + 3 * h * cfg.intermediate_size + 2 * h
    backbone = cfg.vocab_size * h + cfg.num_hidden_layers * layer + h
    audio = 2 * cfg.n_vq * cfg.audio_vocab_size * h + 2 * h
    inner = cfg.local.intermediate_size
    block = 2 * 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * inner + inner) + (inner * h + h)
    return backbone + audio + cfg.local.num_hidden_layers * block + 2 * h


def test_real_config_on_meta():
    model = MossTTSLocalTalker(config_v1_5(), device="meta", dtype=torch.bfloat16)
    n = model.num_parameters()
    print(f"\nMOSS-TTS-Local-Transformer-v1.5 config: {n:,} params (+ unused text_lm_head 388,956,160)")
    assert n == expected_parameters(model.config) == 4_161_447_424
    # The released checkpoint holds 438 tensors (vllm-omni load_weights); we build all but text_lm_head.
    assert len(model.module.state_dict()) == 437
    assert model.spec.hidden_size == 2560 and model.spec.dtype == torch.bfloat16 and model.spec.max_context == 4096
    assert model.config.local.head_dim == 80
    tiny = tiny_demo_talker()
    assert tiny.num_parameters() == expected_parameters(tiny.config) == 1_713_472


def test_upstream_style_config_json():
    data = config_v1_5().to_hf_dict()
    del data["mtp_fsm"]  # released files have no engine block
    data["qwen3_config"]["rope_parameters"] = {"rope_theta": 1_000_000.0}
    del data["qwen3_config"]["rope_theta"]
    data["some_upstream_extra"] = {"ignored": True}
    del data["local_transformer_layers"]
    cfg = MossTTSLocalConfig.from_hf_dict(data)
    assert cfg == config_v1_5() and cfg.text_tokenizer == "qwen" and cfg.prompt_template == "full"
    data["local_transformer_layers"] = 2
    assert MossTTSLocalConfig.from_hf_dict(data).local.num_hidden_layers == 2
    data["local_text_head_mode"] = "full_vocab"
    with pytest.raises(ValueError, match="binary"):
        MossTTSLocalConfig.from_hf_dict(data)
    with pytest.raises(ValueError):
        tiny_config(local=LocalTransformerConfig(hidden_size=32, num_attention_heads=4))
    two = make(local=LocalTransformerConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                            intermediate_size=64))
    h = prefill(two, two.prepare(MossInputs(text="two local layers")).prompt_embeds, 0)[-1:]
    assert two.mtp(h, torch.tensor([5]), greedy).codes.shape == (1, 12)


# ------------------------------------------------------------------ engine level

def _has_mtp_stop() -> bool:
    from mtp_fsm.lifecycle import VARIANTS

    return "mtp_stop" in VARIANTS


needs_mtp_stop = pytest.mark.skipif(not _has_mtp_stop(), reason="engine lifecycle variant 'mtp_stop' not there yet")


def _generate(texts: dict[str, str], *, sampling=None, seeds=None, slots=SLOTS):
    from mtp_fsm.engine.engine import LockstepEngine
    from mtp_fsm.engine.plan import NewRequest
    from mtp_fsm.sampling import SamplingParams

    model = tiny_demo_talker()
    engine = LockstepEngine(model, slots)
    requests = []
    for i, (rid, text) in enumerate(texts.items()):
        params = (sampling or {}).get(rid, SamplingParams())
        requests.append(NewRequest(rid, MossInputs(text=text), max_frames=100, seed=(seeds or {}).get(rid, i),
                                   cb0_sampling=params, mtp_sampling=params))
    return model, engine.generate(requests)


@needs_mtp_stop
def test_engine_stop_ends_with_eos_and_publishes_nothing_more():
    from mtp_fsm.lifecycle import FinishReason

    model, out = _generate({"a": "Hello, mtp_fsm.", "b": "Hi"})
    for rid, gen in out.items():
        assert gen.finished is not None and gen.finished.reason == FinishReason.EOS, gen.finished
        n = len(gen.frames)
        assert 1 <= n < 100 and gen.finished.num_frames == n
        assert [f.index for f in gen.frames] == list(range(n))
    # Replay the published frames: the binary head continued after each and stopped after the last.
    model.bind_slots(SLOTS, torch.device("cpu"))
    text = {"a": "Hello, mtp_fsm.", "b": "Hi"}
    for rid, gen in out.items():
        p = model.prepare(MossInputs(text=text[rid]))
        last = prefill(model, p.prompt_embeds, 0)[-1:]
        for i, frame in enumerate(gen.frames):
            assert not model.mtp(last, frame.codes[:1], greedy).stop[0]
            x = model.frame_embed(frame.codes[None]) + model.text_step({}, torch.tensor([0]), torch.tensor([i + 1]))
            last = model.forward(x, torch.tensor([p.prompt_embeds.shape[0] + i]), torch.tensor([0]))
        assert model.mtp(last, torch.tensor([0]), greedy).stop[0]
        model.reset_slots(torch.tensor([0]))


@needs_mtp_stop
def test_engine_batched_equals_alone():
    texts = {"a": "Hello there, engine.", "b": "Second!", "c": "x"}
    _, batched = _generate(texts)
    for i, (rid, text) in enumerate(texts.items()):
        _, alone = _generate({rid: text}, seeds={rid: i}, slots=1)
        assert torch.equal(alone[rid].codes(), batched[rid].codes())
        assert alone[rid].finished.reason == batched[rid].finished.reason


@needs_mtp_stop
def test_engine_ignores_request_sampling_for_fixed_audio_sampling():
    from mtp_fsm.sampling import GREEDY, SamplingParams

    texts = {"hot": "Same text.", "greedy": "Same text.", "odd": "Same text."}
    sampling = {"hot": SamplingParams(temperature=3.0, top_k=2), "greedy": GREEDY,
                "odd": SamplingParams(temperature=0.5, top_k=0, top_p=0.3)}
    _, out = _generate(texts, sampling=sampling, seeds={rid: 7 for rid in texts})
    frames = [out[rid].codes() for rid in texts]
    assert frames[0].shape[0] > 0
    assert all(torch.equal(frames[0], f) for f in frames[1:])


def test_deferred_schedule_publishes_the_same_frames_one_step_later():
    from mtp_fsm.engine import LockstepEngine, NewRequest
    from models.moss_tts_local import text_inputs, tiny_demo_talker

    def run(schedule):
        engine = LockstepEngine(tiny_demo_talker(schedule=schedule), 3, kernels="torch")
        for i, text in enumerate(("Hi", "Hello, mtp_fsm.", "abc")):
            engine.add_request(NewRequest(f"r{i}", text_inputs(text), 40, i))
        log, step = [], 0
        while (out := engine.step()) is not None:
            log += [(step, f.request_id, f.index, tuple(f.codes.tolist())) for f in out.frames]
            log += [(step, f.request_id, f.reason.label) for f in out.finished]
            step += 1
        return sorted(log)

    current, deferred = run("current"), run("deferred")
    assert deferred == sorted((s + 1, *rest) for s, *rest in current)
    assert {e[2] for e in current if len(e) == 3} == {"eos"}
    with pytest.raises(ValueError, match="schedule must be one of"):
        tiny_demo_talker(schedule="eager")
