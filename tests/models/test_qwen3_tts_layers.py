"""Qwen3-TTS layers: batch-invariant vs plain attention paths, and the KV-cached code predictor."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.qwen3_tts import Qwen3TTSTalker, tiny_config
from models.qwen3_tts.layers import DecoderLayer, rope_tables

HIDDEN, HEAD_DIM, EPS = 32, 8, 1e-6
HEAD_SHAPES = [(4, 2), (8, 2), (16, 8), (4, 4)]


def layer_pair(heads: int, kv_heads: int) -> tuple[DecoderLayer, DecoderLayer]:
    """The same random float64 weights behind the plain and the batch-invariant paths."""
    torch.manual_seed(heads * 100 + kv_heads)
    plain = DecoderLayer(HIDDEN, heads, kv_heads, HEAD_DIM, 64, EPS, bi=False).double()
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.3)
    bi = DecoderLayer(HIDDEN, heads, kv_heads, HEAD_DIM, 64, EPS, bi=True).double()
    bi.load_state_dict(plain.state_dict())
    return plain.requires_grad_(False), bi.requires_grad_(False)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("heads, kv_heads", HEAD_SHAPES)
def test_cached_form_batch_invariant_equals_plain(heads, kv_heads):
    """Talker form: flat tokens of several slots written into and read from a slot cache."""
    plain, bi = layer_pair(heads, kv_heads)
    slots, context, tokens = 3, 12, 7
    cos_t, sin_t = rope_tables(context, HEAD_DIM, 1e6, torch.float64, "cpu")
    x = torch.randn(tokens, HIDDEN, dtype=torch.float64)
    write_slot = torch.tensor([0, 0, 1, 2, 2, 2, 0])
    pos = torch.tensor([0, 1, 4, 0, 1, 2, 2])
    mask = torch.arange(context)[None, :] <= pos[:, None]
    history = torch.randn(2, slots, context, kv_heads, HEAD_DIM, dtype=torch.float64)
    outs = []
    for layer in (plain, bi):
        k, v = (t.clone() for t in history)  # identical earlier entries (and stale ones) for both paths
        outs.append(layer(x, lambda attn, h, k=k, v=v: attn.forward_cached(h, cos_t[pos], sin_t[pos],
                                                                          write_slot, pos, mask, k, v)))
    assert close(*outs)


@pytest.mark.parametrize("heads, kv_heads", HEAD_SHAPES)
def test_causal_forms_batch_invariant_equal_plain(heads, kv_heads):
    """Code-predictor forms: whole-sequence causal, and the cached window (prefill 2, then 1 by 1)."""
    plain, bi = layer_pair(heads, kv_heads)
    batch, seq = 3, 6
    cos_t, sin_t = rope_tables(seq, HEAD_DIM, 1e6, torch.float64, "cpu")
    x = torch.randn(batch, seq, HIDDEN, dtype=torch.float64)
    causal = [layer(x, lambda attn, h: attn.forward_causal(h, cos_t, sin_t)) for layer in (plain, bi)]
    assert close(*causal)
    for layer, whole in zip((plain, bi), causal):
        k = torch.full((batch, seq, kv_heads, HEAD_DIM), float("nan"), dtype=torch.float64)
        v = k.clone()  # never-written entries must not be read
        pieces, start = [], 0
        for length in (2, 1, 1, 1, 1):
            end = start + length

            def attend(attn, h, s=start, e=end):
                return attn.forward_window(h, cos_t[s:e], sin_t[s:e], s, k, v)
            pieces.append(layer(x[:, start:end], attend))
            start = end
        assert close(torch.cat(pieces, dim=1), whole)


# ---- the cached code predictor ------------------------------------------------------------


def reprefill_reference(cp, talker_hidden, cb0_embed, sample, cos, sin) -> torch.Tensor:
    """The pre-cache depth loop: re-run the whole growing sequence for every codebook."""
    seq = [cp.small_to_mtp_projection(talker_hidden), cp.small_to_mtp_projection(cb0_embed)]
    out = []
    for g in range(1, cp.cfg.num_code_groups):
        h = cp.model(torch.stack(seq, dim=1), cos[: g + 1], sin[: g + 1])
        token = sample(cp.lm_head[g - 1](h[:, g]), g).long()
        out.append(token)
        if g < cp.cfg.num_code_groups - 1:
            emb = cp.model.codec_embedding[g - 1](token.clamp(0, cp.cfg.vocab_size - 1))
            seq.append(cp.small_to_mtp_projection(emb))
    return torch.stack(out, dim=1)


class Recorder:
    """Greedy sampler that keeps every logits row it is shown, per codebook."""

    def __init__(self) -> None:
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, g: int) -> torch.Tensor:
        self.logits.append(logits.clone())
        return logits.argmax(-1)


def run_cp(model: Qwen3TTSTalker, hidden: torch.Tensor, cb0: torch.Tensor, fn=None):
    cp = model.talker.code_predictor
    rec = Recorder()
    embed = model.talker.model.codec_embedding(cb0)
    if fn is None:
        codes = cp.generate(hidden, embed, rec, model._cp_cos, model._cp_sin)
    else:
        codes = fn(cp, hidden, embed, rec, model._cp_cos, model._cp_sin)
    return codes, torch.stack(rec.logits, dim=1)  # [B, Q-1], [B, Q-1, V]


@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_cached_code_predictor_matches_reprefill(batch_invariant, dtype, tol):
    model = Qwen3TTSTalker(tiny_config(batch_invariant=batch_invariant), seed=2, dtype=dtype)
    torch.manual_seed(0)
    hidden = torch.randn(5, model.config.hidden_size, dtype=dtype)
    cb0 = torch.randint(0, model.config.codebook_size, (5,))
    codes, logits = run_cp(model, hidden, cb0)
    ref_codes, ref_logits = run_cp(model, hidden, cb0, reprefill_reference)
    assert codes.shape == (5, model.config.num_code_groups - 1)
    assert torch.equal(codes, ref_codes)
    assert torch.allclose(logits, ref_logits, rtol=tol, atol=tol)


def test_cached_code_predictor_bigger_stack_matches_reprefill():
    """Several layers and a projection (talker hidden != code-predictor hidden) in float64."""
    from models.qwen3_tts.config import CodePredictorConfig

    cp_cfg = CodePredictorConfig(hidden_size=48, num_hidden_layers=3, num_attention_heads=8,
                                 num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                 max_position_embeddings=64)
    model = Qwen3TTSTalker(tiny_config(code_predictor=cp_cfg, batch_invariant=False), seed=4, dtype=torch.float64)
    hidden = torch.randn(3, model.config.hidden_size, dtype=torch.float64)
    cb0 = torch.tensor([0, 7, 2047])
    codes, logits = run_cp(model, hidden, cb0)
    ref_codes, ref_logits = run_cp(model, hidden, cb0, reprefill_reference)
    assert torch.equal(codes, ref_codes) and torch.allclose(logits, ref_logits, rtol=1e-12, atol=1e-12)


_POOL = 6
_MODEL = Qwen3TTSTalker(tiny_config(), seed=3)  # batch_invariant=True
_gen = torch.Generator().manual_seed(7)
_HIDDEN = torch.randn(_POOL, _MODEL.config.hidden_size, generator=_gen)
_CB0 = torch.randint(0, _MODEL.config.codebook_size, (_POOL,), generator=_gen)
_ALONE = [run_cp(_MODEL, _HIDDEN[i:i + 1], _CB0[i:i + 1]) for i in range(_POOL)]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(st.integers(0, _POOL - 1), min_size=1, max_size=8))
def test_cached_code_predictor_is_batch_invariant(rows):
    """Any batch composition (order, size, duplicates): each row's logits and codes are
    bit-identical to that row run alone."""
    idx = torch.tensor(rows)
    codes, logits = run_cp(_MODEL, _HIDDEN[idx], _CB0[idx])
    for pos, row in enumerate(rows):
        alone_codes, alone_logits = _ALONE[row]
        assert torch.equal(codes[pos], alone_codes[0])
        assert torch.equal(logits[pos], alone_logits[0])
