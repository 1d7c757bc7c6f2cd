"""Tests for the Chatterbox Turbo T3 adapter: spec, prompt, slot KV cache, engine runs, checkpoints, sizes, upstream parity."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.chatterbox import (
    UPSTREAM_FILE,
    ChatterboxConfig,
    ChatterboxInputs,
    ChatterboxTalker,
    CheckpointError,
    demo_conditioning,
    load_checkpoint,
    save_checkpoint,
    text_inputs,
    tiny_config,
    tiny_demo_talker,
    turbo_config,
)
from mtp_fsm.engine import LockstepEngine, NewRequest
from mtp_fsm.engine.scheduler import SchedulingPolicy
from mtp_fsm.lifecycle import FinishReason, State
from mtp_fsm.sampling import SamplingParams
from mtp_fsm.testing.alone import RequestDef, run_alone
from mtp_fsm.testing.runs import frames_alone, run_to_completion

START, STOP, CODES = 128, 129, 128  # tiny config: 128 speech codes, then start and stop
SPEAKER, COND = demo_conditioning(tiny_config())


def inputs(text: str, **kw) -> ChatterboxInputs:
    return ChatterboxInputs(text=text, speaker_emb=kw.pop("speaker_emb", SPEAKER),
                            cond_tokens=kw.pop("cond_tokens", COND), **kw)


def make(dtype=torch.float32, slots=4, seed=0, stop_bias=None, **overrides) -> ChatterboxTalker:
    model = ChatterboxTalker(tiny_config(**overrides), seed=seed, dtype=dtype)
    if stop_bias is not None:
        # Random weights make stop one of 129 near-equal logits; a bias gives requests
        # a realistic spread of lengths that end by EOS.
        model.module.speech_head.bias[STOP] = stop_bias
    if slots:
        model.bind_slots(slots, torch.device("cpu"))
    return model


def prefill(model, embeds, slot, start=0):
    n = embeds.shape[0]
    return model.forward(embeds, torch.arange(start, start + n), torch.full((n,), slot))


# ---------------------------------------------------------------- spec and prompt


def test_shapes_and_spec():
    model = make()
    spec = model.spec
    assert (spec.name, spec.num_codebooks, spec.lifecycle, spec.has_mtp) == ("chatterbox_turbo", 1, "single_codebook", False)
    assert (spec.backbone_vocab_size, spec.codebook_size, spec.eos_token_id, spec.max_context) == (130, 128, 129, 256)
    p = model.prepare(inputs("hello"))
    assert p.prompt_embeds.shape == (1 + 8 + 5 + 1, 64) and p.columns == {}
    hidden = prefill(model, p.prompt_embeds, 1)
    assert hidden.shape == (15, 64)
    logits = model.cb0_logits(hidden[-3:])
    assert logits.shape == (3, 130)
    assert (logits[:, START] == float("-inf")).all() and torch.isfinite(logits[:, [*range(CODES), STOP]]).all()
    codes = torch.tensor([[7], [127], [STOP], [-3], [99999]])  # EOS / garbage rows stay in bounds
    emb = model.frame_embed(codes)
    assert emb.shape == (5, 64) and torch.isfinite(emb).all()
    assert torch.equal(emb[:2], model.module.speech_emb.weight[[7, 127]])
    zeros = model.text_step({}, torch.tensor([0, 3, -1]), torch.tensor([0, 5, 9]))
    assert zeros.shape == (3, 64) and not zeros.any()


def test_prompt_layout_and_validation():
    model = make()
    m = model.module
    p = model.prepare(inputs("Hi")).prompt_embeds
    speaker = m.cond_enc.spkr_enc(torch.tensor(SPEAKER)[None])
    expect = torch.cat([speaker, m.speech_emb(torch.tensor(COND)), m.text_emb(torch.tensor([72, 105])),
                        m.speech_emb(torch.tensor([START]))])
    torch.testing.assert_close(p, expect, rtol=0, atol=1e-6)
    assert model.prepare(inputs("Hi", cond_tokens=())).prompt_embeds.shape[0] == 4  # no reference tokens
    assert torch.equal(model.prepare(ChatterboxInputs(text_ids=[72, 105], speaker_emb=SPEAKER, cond_tokens=COND))
                       .prompt_embeds, p)
    with pytest.raises(ValueError):
        ChatterboxInputs(text="a", text_ids=[1], speaker_emb=SPEAKER)
    bad = [inputs(""), inputs("x", speaker_emb=SPEAKER[:-1]), inputs("x", speaker_emb=(float("nan"),) * 16),
           inputs("x", cond_tokens=COND + (1,)), inputs("x", cond_tokens=(START,)), inputs("x" * 250),
           ChatterboxInputs(text_ids=[256], speaker_emb=SPEAKER)]
    for req in bad:
        with pytest.raises(ValueError):
            model.prepare(req)
    assert hash(text_inputs("demo")) == hash(text_inputs("demo"))  # hashable, deterministic


# ---------------------------------------------------------------- slot KV cache


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_kv_cache_chunking(batch_invariant):
    model = make(torch.float64, batch_invariant=batch_invariant)
    prompt = model.prepare(inputs("chunked prefill")).prompt_embeds
    whole = prefill(model, prompt, 0)[-1]
    model.reset_slots(torch.tensor([0]))
    prefill(model, prompt[:3], 0)
    two = prefill(model, prompt[3:], 0, start=3)[-1]
    model.reset_slots(torch.tensor([0]))
    for i in range(prompt.shape[0]):
        one = prefill(model, prompt[i : i + 1], 0, start=i)[-1]
    torch.testing.assert_close(two, whole, rtol=0, atol=1e-10)
    torch.testing.assert_close(one, whole, rtol=0, atol=1e-10)
    if batch_invariant:
        assert torch.equal(two, whole) and torch.equal(one, whole)


def test_padding_tokens_touch_no_slot():
    model = make(torch.float64)
    for slot in range(4):
        prefill(model, torch.randn(6, 64, dtype=torch.float64), slot)
    before = [(k.clone(), v.clone()) for k, v in model._cache]
    pad = torch.randn(5, 64, dtype=torch.float64) * 100
    out = model.forward(pad, torch.tensor([0, 1, 2, 3, 700]), torch.full((5,), -1))
    assert torch.isfinite(out).all()
    for (k0, v0), (k1, v1) in zip(before, model._cache):
        assert torch.equal(k0[:4], k1[:4]) and torch.equal(v0[:4], v1[:4])
    # Padding mixed into a real chunk changes neither that request's result nor other slots.
    x = torch.randn(3, 64, dtype=torch.float64)
    alone = model.forward(x, torch.tensor([6, 7, 8]), torch.tensor([2, 2, 2]))
    for slot_cache, (k0, v0) in zip(model._cache, before):
        slot_cache[0][2].copy_(k0[2])
        slot_cache[1][2].copy_(v0[2])
    mixed = model.forward(torch.cat([pad[:2], x]), torch.tensor([6, 7, 6, 7, 8]), torch.tensor([-1, -1, 2, 2, 2]))
    assert torch.equal(mixed[2:], alone)
    for (k0, _), (k1, _) in zip(before, model._cache):
        assert torch.equal(k0[[0, 1, 3]], k1[[0, 1, 3]])


@pytest.mark.parametrize(("dtype", "batch_invariant"), [(torch.float64, False), (torch.float32, True)])
def test_batch_isolation(dtype, batch_invariant):
    model = make(dtype, batch_invariant=batch_invariant)
    a = model.prepare(inputs("first request")).prompt_embeds
    b = model.prepare(inputs("second, longer request", cond_tokens=(3, 4))).prompt_embeds
    ha, hb = prefill(model, a, 0), prefill(model, b, 2)
    model.reset_slots(torch.tensor([0, 2]))
    x = torch.cat([b[:4], a, b[4:]])  # interleaved order, different slots
    pos = torch.cat([torch.arange(4), torch.arange(a.shape[0]), torch.arange(4, b.shape[0])])
    slots = torch.cat([torch.full((4,), 2), torch.full((a.shape[0],), 0), torch.full((b.shape[0] - 4,), 2)])
    h = model.forward(x, pos, slots)
    got_a, got_b = h[4 : 4 + a.shape[0]], torch.cat([h[:4], h[4 + a.shape[0] :]])
    if batch_invariant:
        assert torch.equal(got_a, ha) and torch.equal(got_b, hb)
        rows = torch.cat([ha[-1:], hb[-1:]])
        assert torch.equal(model.cb0_logits(rows)[1], model.cb0_logits(rows[1:])[0])
    else:
        torch.testing.assert_close(got_a, ha, rtol=0, atol=1e-10)
        torch.testing.assert_close(got_b, hb, rtol=0, atol=1e-10)


def test_stale_cache_entries_are_never_read_and_reset_zeroes():
    model = make(torch.float64)
    prompt = model.prepare(inputs("stale")).prompt_embeds
    clean = prefill(model, prompt, 1)
    for cache_k, cache_v in model._cache:  # garbage beyond the prompt, as a previous occupant might leave
        cache_k[1, prompt.shape[0]:] = float("nan")
        cache_v[1, prompt.shape[0]:] = float("inf")
    assert torch.equal(prefill(model, prompt, 1), clean)
    prefill(model, prompt, 2)
    model.reset_slots(torch.tensor([1, -1]))
    assert not model._cache[0][0][1].any() and model._cache[0][0][2].any()


# ---------------------------------------------------------------- engine runs

TEXTS = ("Hello there, engine.", "Second!", "x", "A fourth, somewhat longer request.")
SAMPLING = SamplingParams(temperature=0.9, top_k=50)


def factory():
    return make(slots=0, stop_bias=0.2)


def requests(n=4) -> list[NewRequest]:
    return [NewRequest(f"r{i}", inputs(TEXTS[i % 4]), max_frames=60, seed=10 + i, cb0_sampling=SAMPLING)
            for i in range(n)]


def test_start_of_speech_never_sampled_and_stop_ends_requests():
    model = make(slots=0)
    model.module.speech_head.bias[START] = 1e4  # would win every draw if it were not masked
    hot = SamplingParams(temperature=2.0, top_k=0)
    reqs = [NewRequest(f"r{i}", inputs(t), max_frames=40, seed=i, cb0_sampling=hot) for i, t in enumerate(TEXTS)]
    out = LockstepEngine(model, 4).generate(reqs)
    assert all(g.finished.reason in (FinishReason.EOS, FinishReason.LENGTH) for g in out.values())
    codes = torch.cat([g.codes() for g in out.values()])
    assert codes.shape[0] > 40 and (codes < CODES).all()
    # Stop is the EOS guard: a dominant stop logit ends each request before its first frame.
    model = make(slots=0, stop_bias=1e4)
    out = LockstepEngine(model, 2).generate(requests())
    assert all(g.finished.reason is FinishReason.EOS and not g.frames for g in out.values())


def test_batched_and_chunked_runs_equal_alone_runs():
    alone = {r.request_id: run_alone(factory, RequestDef.of(r)) for r in requests()}
    # Requests end at different steps, some by EOS, some by the frame budget.
    assert {a.reason for a in alone.values()} == {FinishReason.EOS, FinishReason.LENGTH}
    assert len({len(a.frames) for a in alone.values()}) > 2
    for slots, budget, chunk in ((4, 512, 256), (4, 9, 4), (2, 16, 3)):
        engine = LockstepEngine(factory(), slots, policy=SchedulingPolicy(token_budget=budget, prefill_chunk=chunk))
        got = engine.generate(requests())
        for rid, run in alone.items():
            assert tuple(tuple(int(c) for c in f.codes) for f in got[rid].frames) == run.frames, (slots, chunk, rid)
            assert got[rid].finished.reason is run.reason


def test_preempt_and_resume_do_not_change_frames():
    reqs = requests(3)
    model = factory()
    alone = {r.request_id: frames_alone(model, r) for r in reqs}
    plan = {1: "r0", 6: "r1", 15: "r2", 30: "r1", 45: "r2"}  # mid-prefill and mid-decode

    def events(step, engine):
        rid = plan.get(step)
        record = engine.ledger.records.get(rid)
        live = record is not None and record.slot is not None and record.state in (
            State.WAITING, State.PREFILLING, State.DECODING)
        return {"preempts": [rid] if live else []}

    engine = LockstepEngine(factory(), 2)
    frames, reasons = run_to_completion(engine, reqs, chunk=4, events=events)
    assert engine.scheduler.num_preemptions == 5  # r1 and r2 twice each after frames were published
    assert frames == alone
    assert reasons == {"r0": FinishReason.EOS, "r1": FinishReason.LENGTH, "r2": FinishReason.EOS}


def test_demo_talker_runs_in_the_engine():
    engine = LockstepEngine(tiny_demo_talker(seed=1), 2)
    out = engine.generate([NewRequest(f"d{i}", text_inputs(t), max_frames=12, seed=i) for i, t in enumerate(TEXTS)])
    assert all(g.finished.reason in (FinishReason.EOS, FinishReason.LENGTH) for g in out.values())
    assert all(len(g.frames) <= 12 for g in out.values())


# ---------------------------------------------------------------- checkpoints and sizes


def test_checkpoint_round_trip(tmp_path):
    model = make(seed=5)
    save_checkpoint(model, tmp_path / "ckpt")
    data = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert data["tfmr_config"]["n_embd"] == 64 and data["t3_hp"]["stop_speech_token"] == STOP
    assert ChatterboxConfig.from_hf_dict(data) == model.config
    tensors = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    shapes = {"tfmr.wpe.weight": (256, 64), "tfmr.h.0.ln_1.weight": (64,), "tfmr.h.0.attn.c_attn.weight": (64, 192),
              "tfmr.h.0.attn.c_attn.bias": (192,), "tfmr.h.1.attn.c_proj.weight": (64, 64),
              "tfmr.h.1.ln_2.bias": (64,), "tfmr.h.1.mlp.c_fc.weight": (64, 256), "tfmr.h.1.mlp.c_proj.weight": (256, 64),
              "tfmr.ln_f.weight": (64,), "cond_enc.spkr_enc.weight": (64, 16), "cond_enc.spkr_enc.bias": (64,),
              "text_emb.weight": (256, 64), "speech_emb.weight": (130, 64), "speech_head.weight": (130, 64),
              "speech_head.bias": (130,)}
    for key, shape in shapes.items():
        assert tuple(tensors[key].shape) == shape, key
    assert "tfmr.wte.weight" not in tensors and "text_head.weight" not in tensors
    loaded = load_checkpoint(tmp_path / "ckpt")
    loaded.bind_slots(4, torch.device("cpu"))
    p = model.prepare(inputs("round trip")).prompt_embeds
    assert torch.equal(loaded.prepare(inputs("round trip")).prompt_embeds, p)
    assert torch.equal(prefill(model, p, 1), prefill(loaded, p, 1))

    # The released layout: upstream's file name, the unused wte/text_head tensors (upstream-strict
    # save), no T3 config.json of its own, and other Turbo weights that must not be read.
    up = tmp_path / "turbo"
    save_checkpoint(model, up, upstream_strict=True)
    (up / "model.safetensors").rename(up / UPSTREAM_FILE)
    (up / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 1024}))  # a tokenizer's
    save_file({"lstm.weight": torch.zeros(2)}, str(up / "ve.safetensors"))
    assert {"tfmr.wte.weight", "text_head.weight"} <= set(load_file(str(up / UPSTREAM_FILE)))
    again = load_checkpoint(up, config=tiny_config(), dtype=torch.float64)
    assert torch.equal(again.module.speech_head.bias, model.module.speech_head.bias.double())


def test_checkpoint_errors_name_tensors(tmp_path):
    save_checkpoint(make(), tmp_path)
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    del tensors["tfmr.h.1.mlp.c_fc.bias"]
    tensors["tfmr.h.0.attn.q_proj.weight"] = torch.zeros(3)
    tensors["speech_head.weight"] = torch.zeros(130, 65)
    save_file(tensors, path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path)
    message = str(err.value)
    assert "tfmr.h.1.mlp.c_fc.bias" in message and "tfmr.h.0.attn.q_proj.weight" in message
    assert "speech_head.weight" in message and "(130, 65)" in message
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_checkpoint(tmp_path)


def test_real_turbo_config_on_meta():
    real = ChatterboxTalker(turbo_config(), device="meta", dtype=torch.bfloat16)
    spec = real.spec
    assert (spec.backbone_vocab_size, spec.codebook_size, spec.eos_token_id) == (6563, 6561, 6562)
    assert (spec.hidden_size, spec.max_context, spec.dtype) == (1024, 2048, torch.bfloat16)
    params = dict(real.module.named_parameters())
    n_all, n_tfmr = real.num_parameters(), sum(p.numel() for k, p in params.items() if k.startswith("tfmr."))
    # HF gpt2-medium has 354,823,168 parameters (wte 50257 x 1024, wpe 1024 x 1024); Turbo's
    # tfmr differs only in table sizes (wte 50276 rows, wpe 8196 rows) and drops wte.
    assert n_tfmr + 50276 * 1024 == 354_823_168 + (50276 - 50257) * 1024 + (8196 - 1024) * 1024
    heads = 50276 * 1024 + 2 * 6563 * 1024 + 6563 + 256 * 1024 + 1024  # text_emb, speech_emb/head, spkr_enc
    assert n_all == n_tfmr + heads == 375_897_507
    # The released t3_turbo_v1 file also holds wte and text_head (2 x 50276 x 1024): ~479M in all.
    print(f"\nChatterbox Turbo T3: {n_all:,} adapter params ({n_tfmr:,} GPT-2), "
          f"{n_all + 2 * 50276 * 1024:,} in the upstream file")
    assert ChatterboxConfig.from_hf_dict(turbo_config().to_hf_dict()) == turbo_config()
    bare = {"model_type": "gpt2", "n_embd": 1024, "n_layer": 24, "n_head": 16, "n_positions": 8196,
            "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "vocab_size": 50276}
    assert ChatterboxConfig.from_hf_dict(bare) == turbo_config()
    with pytest.raises(ValueError):
        turbo_config(max_context=9000)  # beyond the learned position table


# ---------------------------------------------------------------- upstream parity (optional)


def _upstream_tiny_t3():
    """A random upstream T3 built with Turbo's switches and the tiny config's sizes."""
    from chatterbox.models.t3.llama_configs import LLAMA_CONFIGS
    from chatterbox.models.t3.modules.t3_config import T3Config
    from chatterbox.models.t3.t3 import T3

    cfg = tiny_config()
    LLAMA_CONFIGS["mtp_fsm_tiny_gpt2"] = {
        "model_type": "gpt2", "activation_function": "gelu_new", "n_embd": 64, "hidden_size": 64, "n_layer": 2,
        "n_head": 4, "n_inner": None, "n_positions": 256, "n_ctx": 256, "vocab_size": cfg.gpt_vocab_size,
        "layer_norm_epsilon": 1e-5, "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0,
    }
    hp = T3Config(text_tokens_dict_size=cfg.text_tokens_dict_size)
    hp.llama_config_name = "mtp_fsm_tiny_gpt2"
    hp.speech_tokens_dict_size, hp.start_speech_token, hp.stop_speech_token = 130, START, STOP
    hp.input_pos_emb, hp.speech_cond_prompt_len = None, cfg.speech_cond_prompt_len
    hp.use_perceiver_resampler, hp.emotion_adv, hp.speaker_embed_size = False, False, cfg.speaker_embed_size
    t3 = T3(hp).double().eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # every tensor random, LayerNorm gains near 1, so a mis-mapped name shows
        for name, p in t3.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.copy_(1 + 0.2 * noise if ".ln_" in name and name.endswith("weight") else 0.1 * noise)
    return t3


def test_upstream_parity(tmp_path):
    pytest.importorskip("chatterbox")
    from chatterbox.models.t3.modules.cond_enc import T3Cond

    t3 = _upstream_tiny_t3()
    save_file({k: v.contiguous() for k, v in t3.state_dict().items()}, str(tmp_path / UPSTREAM_FILE))
    ours = load_checkpoint(tmp_path, config=tiny_config(), dtype=torch.float64)
    ours.bind_slots(1, torch.device("cpu"))
    text = "Parity, please."
    cond = T3Cond(speaker_emb=torch.tensor(SPEAKER, dtype=torch.float64)[None],
                  cond_prompt_speech_tokens=torch.tensor(COND)[None])
    with torch.no_grad():
        embeds, _ = t3.prepare_input_embeds(t3_cond=cond, text_tokens=torch.tensor([list(text.encode())]),
                                            speech_tokens=torch.tensor([[START]]), cfg_weight=0.0)
        prompt = ours.prepare(inputs(text)).prompt_embeds
        diffs = [(prompt - embeds[0]).abs().max().item()]
        out = t3.tfmr(inputs_embeds=embeds, use_cache=True)
        past, theirs = out.past_key_values, t3.speech_head(out[0][0, -1:])
        mine = ours.cb0_logits(prefill(ours, prompt, 0)[-1:])
        keep = [*range(CODES), STOP]
        greedy, pos = [], prompt.shape[0]
        for _ in range(12):  # greedy decode on both
            diffs.append((mine[:, keep] - theirs[:, keep]).abs().max().item())
            # Speech codes only: past a stop the two would diverge by design (frame_embed clamps it).
            token = int(theirs[:, :CODES].argmax(-1))
            assert token == int(mine[:, :CODES].argmax(-1))
            greedy.append(token)
            out = t3.tfmr(inputs_embeds=t3.speech_emb(torch.tensor([[token]])), past_key_values=past, use_cache=True)
            past, theirs = out.past_key_values, t3.speech_head(out[0][0, -1:])
            step = ours.forward(ours.frame_embed(torch.tensor([[token]])), torch.tensor([pos]), torch.tensor([0]))
            mine, pos = ours.cb0_logits(step), pos + 1
    print(f"\nupstream parity: max abs diff {max(diffs):.3e} over prompt embeds + 13 logit rows; greedy {greedy}")
    assert max(diffs) < 1e-9
    # And back: an upstream-strict save loads into upstream T3 with strict=True.
    save_checkpoint(ours, tmp_path / "back", upstream_strict=True)
    t3.load_state_dict(load_file(str(tmp_path / "back" / "model.safetensors")), strict=True)
