"""Tests for the MTP LM adapter: spec, slot KV cache (MTP layer included), batch invariance, demo wiring, engine, checkpoints, sizes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.mtp_lm import (
    CheckpointError,
    MtpLMConfig,
    MtpLMInputs,
    MtpLMTalker,
    load_checkpoint,
    real_config,
    save_checkpoint,
    text_inputs,
    tiny_config,
    tiny_demo_talker,
)
from mtp_fsm.engine import LockstepEngine, NewRequest
from mtp_fsm.lifecycle import FinishReason
from mtp_fsm.testing.alone import RequestDef, run_alone, torch_threads

BOS, EOS, CODES, VOCAB, H = 256, 257, 256, 300, 64
TEXTS = ("hello world", "The quick brown fox.", "x", "speculative decoding!")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny tensors: thread hand-offs on a small shared machine cost far more than the arithmetic.
    with torch_threads(1):
        yield


def make(slots=4, **kw) -> MtpLMTalker:
    model = MtpLMTalker(tiny_config(), **kw)
    if slots:
        model.bind_slots(slots, torch.device("cpu"))
    return model


def prefill(model, embeds, slot, start=0):
    n = embeds.shape[0]
    return model.forward(embeds, torch.arange(start, start + n), torch.full((n,), slot))


def greedy_trace(model, text, slot=0):
    """Greedy decode alone (frame ids and EOS only) -> (token ids incl. the final one, hidden states [T, H])."""
    ids = [BOS, *text.encode()]
    hidden = [prefill(model, model.prepare(text_inputs(text)).prompt_embeds, slot)]
    allowed = torch.arange(VOCAB) < CODES
    allowed[EOS] = True  # what the engine lets CB0 sample
    while True:
        logits = model.lm_logits(hidden[-1][-1:]).masked_fill(~allowed, float("-inf"))
        ids.append(int(logits.argmax()))
        if ids[-1] == EOS or len(ids) == model.config.max_context:
            return ids, torch.cat(hidden)
        hidden.append(model.forward(model.embed(torch.tensor(ids[-1:])), torch.tensor([len(ids) - 1]),
                                    torch.tensor([slot])))


# ---------------------------------------------------------------- spec, prompt, hooks


def test_spec_prompt_and_hooks():
    model = make()
    spec = model.spec
    assert (spec.name, spec.num_codebooks, spec.lifecycle, spec.has_mtp) == ("mtp_lm", 1, "single_codebook", False)
    assert (spec.backbone_vocab_size, spec.codebook_size, spec.eos_token_id, spec.max_context) == (VOCAB, CODES, EOS, 160)
    assert model.kv_cache_layout().num_layers == 3  # 2 backbone layers + the MTP layer
    p = model.prepare(text_inputs("hi")).prompt_embeds
    emb = model.module.model.embed_tokens.weight
    assert torch.equal(p, emb[[BOS, 104, 105]])
    assert torch.equal(model.prepare(MtpLMInputs(token_ids=[104, 105])).prompt_embeds, p)
    codes = torch.tensor([[7], [255], [EOS], [-3], [99999]])
    fe = model.frame_embed(codes)
    assert torch.equal(fe[:3], emb[[7, 255, EOS]]) and torch.isfinite(fe).all()
    assert not model.text_step({}, torch.tensor([0, -1]), torch.tensor([0, 3])).any()
    hidden = prefill(model, p, 1)
    assert model.cb0_logits(hidden).shape == (3, VOCAB) and torch.equal(model.cb0_logits(hidden), model.lm_logits(hidden))
    for bad in (MtpLMInputs(token_ids=[300]), text_inputs("x" * 159)):
        with pytest.raises(ValueError):
            model.prepare(bad)
    with pytest.raises(ValueError):
        MtpLMInputs(text="a", token_ids=[1])
    with pytest.raises(ValueError, match="no built-in tokenizer"):
        MtpLMTalker(tiny_config(text_tokenizer="ids")).prepare(text_inputs("a"))
    assert hash(text_inputs("demo")) == hash(text_inputs("demo"))


# ---------------------------------------------------------------- slot KV cache and batching


def _mtp_pass(model, slot, ids, hidden):
    n = hidden.shape[0]
    return model.mtp_forward(hidden, torch.tensor(ids[1 : n + 1]), torch.arange(n), torch.full((n,), slot))


def test_rows_alone_and_batched_are_bit_identical():
    """Several requests' prompts in one flat batch (interleaved slots, plus padding) give each
    row exactly the bits it gets alone, for the backbone and the MTP layer."""
    texts = TEXTS[:3]
    alone = []
    for text in texts:
        model = make(slots=1)
        ids, hidden = greedy_trace(model, text)
        model.reset_slots(torch.tensor([0]))
        h = prefill(model, model.prepare(text_inputs(text)).prompt_embeds, 0)
        m = _mtp_pass(model, 0, ids, h)
        alone.append((ids, h, m))
    model = make(slots=4)
    embeds, pos, slots, nxt = [], [], [], []
    for s, (text, (ids, h, _)) in enumerate(zip(texts, alone)):
        n = h.shape[0]
        embeds.append(model.prepare(text_inputs(text)).prompt_embeds)
        pos.append(torch.arange(n)), slots.append(torch.full((n,), 3 - s)), nxt.append(torch.tensor(ids[1 : n + 1]))
    # Padding rows (slot -1) anywhere in the batch, with junk positions and inputs.
    embeds.append(torch.randn(2, H)), pos.append(torch.tensor([5, 999])), slots.append(torch.tensor([-1, -1]))
    nxt.append(torch.tensor([1, 2]))
    order = torch.randperm(sum(e.shape[0] for e in embeds), generator=torch.Generator().manual_seed(0))
    x, p, s, t = (torch.cat(v)[order] for v in (embeds, pos, slots, nxt))
    h = model.forward(x, p, s)
    m = model.mtp_forward(h, t, p, s)
    for k, (ids, h_alone, m_alone) in enumerate(alone):
        rows = order.argsort()[sum(a[1].shape[0] for a in alone[:k]) + torch.arange(h_alone.shape[0])]
        assert torch.equal(h[rows], h_alone) and torch.equal(m[rows], m_alone), k
        assert torch.equal(model.lm_logits(h[rows]), model.lm_logits(h_alone))
        assert torch.equal(model.mtp_logits(m[rows]), model.mtp_logits(m_alone))


def test_padding_touches_no_slot_and_reset_clears_the_mtp_layer():
    model = make(slots=2)
    p = model.prepare(text_inputs("pad")).prompt_embeds
    h = prefill(model, p, 0)
    model.mtp_forward(h, torch.tensor([112, 97, 100, 1]), torch.arange(4), torch.zeros(4, dtype=torch.long))
    before = [(k[:2].clone(), v[:2].clone()) for k, v in model.dense_kv()]
    assert all(k[0].any() for k, _ in before)  # every layer, the MTP's included, wrote slot 0
    junk = torch.full((3, H), float("nan"))
    for pos in (torch.tensor([0, 1, 2]), torch.tensor([4, 70, 159])):
        model.forward(junk, pos, torch.full((3,), -1))
        model.mtp_forward(junk, torch.tensor([1, 2, 3]), pos, torch.full((3,), -1))
    assert all(torch.equal(k[:2], bk) and torch.equal(v[:2], bv) for (k, v), (bk, bv) in zip(model.dense_kv(), before))
    # A NaN scratch row reaches no real row.
    again = model.forward(p[-1:], torch.tensor([3]), torch.tensor([0]))
    assert torch.equal(again, prefill(make(slots=1), p, 0)[-1:])
    model.reset_slots(torch.tensor([0]))
    assert all(not k[0].any() and not v[0].any() for k, v in model.dense_kv())


def test_chunked_prefill_equals_whole():
    model = make(slots=1)
    ids, hidden = greedy_trace(model, "chunks")
    model.reset_slots(torch.tensor([0]))
    p = model.prepare(text_inputs("chunks")).prompt_embeds
    whole_h = prefill(model, p, 0)
    whole_m = _mtp_pass(model, 0, ids, whole_h)
    model.reset_slots(torch.tensor([0]))
    h = torch.cat([prefill(model, p[:3], 0), prefill(model, p[3:], 0, start=3)])
    nxt = torch.tensor(ids[1 : p.shape[0] + 1])
    m = torch.cat([model.mtp_forward(h[:3], nxt[:3], torch.arange(3), torch.zeros(3, dtype=torch.long)),
                   model.mtp_forward(h[3:], nxt[3:], torch.arange(3, 7), torch.zeros(4, dtype=torch.long))])
    assert torch.equal(h, whole_h) and torch.equal(m, whole_m)


# ---------------------------------------------------------------- demo wiring: EOS and drafting


def _draft_agreement(model, texts):
    """Greedy MTP drafts vs the backbone's greedy next token, over generated positions."""
    hits = total = 0
    for text in texts:
        model.reset_slots(torch.tensor([0]))
        ids, hidden = greedy_trace(model, text)
        n = hidden.shape[0]
        m = _mtp_pass(model, 0, ids, hidden)
        keep = [*range(CODES), EOS]
        draft = model.mtp_logits(m[:-1])[:, keep].argmax(-1)  # row p predicts token p + 2
        target = torch.tensor([keep.index(t) for t in ids[2 : n + 1]])
        start = len(text)  # from the first generated token on
        hits += int((draft[start:] == target[start:]).sum())
        total += n - 1 - start
    return hits / total


def test_demo_eos_and_drafter():
    model = make(slots=1)
    stop = model.config.demo_stop_position
    ends = []
    for text in TEXTS:
        model.reset_slots(torch.tensor([0]))
        ids, _ = greedy_trace(model, text)
        ends.append(len(ids) - 2)  # the position whose logits chose EOS
    assert all(stop <= e <= stop + 3 for e in ends), ends  # greedy EOS just past the wired position
    wired = _draft_agreement(model, TEXTS)
    plain = MtpLMTalker(tiny_config(), seed=0)  # same backbone bits, random (unwired) MTP layer
    plain.module.load_state_dict(model.module.state_dict())
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in plain.module.mtp_layer.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    plain.bind_slots(1, torch.device("cpu"))
    random_mtp = _draft_agreement(plain, TEXTS)
    print(f"\ngreedy draft agreement: wired MTP {wired:.3f}, random MTP {random_mtp:.3f} (chance {1 / 257:.4f}); "
          f"greedy EOS at positions {ends}")
    assert wired > 0.15 and wired > 5 * max(random_mtp, 1 / 257)


# ---------------------------------------------------------------- engine


def factory():
    return tiny_demo_talker()


def requests():
    return [NewRequest(f"r{i}", text_inputs(t), max_frames=(100, 100, 12, 100)[i], seed=3 + i)
            for i, t in enumerate(TEXTS)]


def test_engine_ends_every_request_and_batched_equals_alone():
    out = LockstepEngine(factory(), 4, kernels="torch").generate(requests())
    reasons = {rid: g.finished.reason for rid, g in out.items()}
    assert set(reasons.values()) <= {FinishReason.EOS, FinishReason.LENGTH} and len(reasons) == 4
    assert FinishReason.EOS in set(reasons.values())
    codes = torch.cat([g.codes() for g in out.values()])
    assert ((codes >= 0) & (codes < CODES)).all()
    for r in requests():
        alone = run_alone(factory, RequestDef.of(r), kernels="torch")
        assert tuple(tuple(int(c) for c in f.codes) for f in out[r.request_id].frames) == alone.frames, r.request_id
        assert reasons[r.request_id] is alone.reason


# ---------------------------------------------------------------- checkpoints and sizes


def test_checkpoint_round_trip(tmp_path):
    model = make(slots=1, seed=5)
    save_checkpoint(model, tmp_path / "ckpt")
    data = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert data["model_type"] == "qwen3" and data["num_nextn_predict_layers"] == 1 and data["num_hidden_layers"] == 2
    assert MtpLMConfig.from_hf_dict(data) == model.config
    tensors = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    shapes = {"model.embed_tokens.weight": (VOCAB, H), "lm_head.weight": (VOCAB, H), "model.norm.weight": (H,),
              "model.layers.1.self_attn.q_norm.weight": (16,), "model.layers.0.self_attn.k_proj.weight": (32, H),
              "model.layers.2.enorm.weight": (H,), "model.layers.2.hnorm.weight": (H,),
              "model.layers.2.eh_proj.weight": (H, 2 * H), "model.layers.2.shared_head.norm.weight": (H,),
              "model.layers.2.self_attn.o_proj.weight": (H, H), "model.layers.2.mlp.down_proj.weight": (H, 128),
              "model.layers.2.post_attention_layernorm.weight": (H,),
              "model.layers.2.shared_head.head.weight": (VOCAB, H), "model.layers.2.embed_tokens.weight": (VOCAB, H)}
    for key, shape in shapes.items():
        assert tuple(tensors[key].shape) == shape, key
    assert len(tensors) == 3 + 11 * 3 + 4 + 2  # embed/norm/head, 3 decoder layers, MTP extras, 2 copies
    loaded = load_checkpoint(tmp_path / "ckpt")
    loaded.bind_slots(1, torch.device("cpu"))
    for m in (model, loaded):
        m.reset_slots(torch.tensor([0]))
    a, b = greedy_trace(model, "round trip"), greedy_trace(loaded, "round trip")
    assert a[0] == b[0] and torch.equal(a[1], b[1])
    nxt = torch.tensor(a[0][1 : a[1].shape[0] + 1])
    pos, slot = torch.arange(a[1].shape[0]), torch.zeros(a[1].shape[0], dtype=torch.long)
    assert torch.equal(model.mtp_logits(model.mtp_forward(a[1], nxt, pos, slot)),
                       loaded.mtp_logits(loaded.mtp_forward(b[1], nxt, pos, slot)))
    save_checkpoint(model, tmp_path / "bare", with_shared_copies=False)
    assert torch.equal(load_checkpoint(tmp_path / "bare", dtype=torch.float64).module.model.layers[2].eh_proj.weight,
                       model.module.mtp_layer.eh_proj.weight.double())


def test_checkpoint_errors_name_tensors(tmp_path):
    save_checkpoint(make(slots=0), tmp_path)
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.2.hnorm.weight"]
    tensors["model.layers.3.enorm.weight"] = torch.zeros(H)
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(H, H)
    save_file(tensors, path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path)
    message = str(err.value)
    assert "model.layers.2.hnorm.weight" in message and "model.layers.3.enorm.weight" in message
    assert "model.layers.2.eh_proj.weight" in message and "(64, 64)" in message
    tensors = load_file(str(save_checkpoint(make(slots=0), tmp_path / "ok") / "model.safetensors"))
    tensors["model.layers.2.shared_head.head.weight"] += 1
    save_file(tensors, str(tmp_path / "ok" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="shared_head.head.weight != lm_head.weight"):
        load_checkpoint(tmp_path / "ok")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_checkpoint(tmp_path)


def test_real_config_on_meta():
    cfg = real_config()
    real = MtpLMTalker(cfg, device="meta", dtype=torch.bfloat16)
    assert (real.spec.hidden_size, real.spec.backbone_vocab_size, real.spec.eos_token_id) == (4096, 151680, 151643)
    assert real.kv_cache_layout().num_layers == 37
    h, v, i, q, kv, d = 4096, 151680, 11008, 32, 8, 128
    layer = h * q * d + 2 * h * kv * d + q * d * h + 2 * d + 3 * h * i + 2 * h  # attn, q/k norms, SwiGLU, 2 norms
    backbone = 36 * layer + 2 * v * h + h  # embed_tokens, lm_head, final norm
    mtp = layer + 2 * h + 2 * h * h + h  # its decoder layer, enorm + hnorm, eh_proj, shared_head.norm
    assert real.num_parameters() == backbone + mtp == 7_833_191_680
    mtp_params = sum(p.numel() for k, p in real.module.named_parameters() if k.startswith("model.layers.36."))
    assert mtp_params == mtp
    print(f"\nreal_config (MiMo-7B sizes, Qwen3 layers): {real.num_parameters():,} params "
          f"(backbone {backbone:,}, MTP layer {mtp:,})")
    assert MtpLMConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    for bad in (dict(num_nextn_predict_layers=2), dict(tie_word_embeddings=True), dict(codebook_size=151644)):
        with pytest.raises(ValueError):
            real_config(**bad)
