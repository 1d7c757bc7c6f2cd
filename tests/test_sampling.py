"""Unit and property tests of mtp_fsm.sampling: counter-based noise and batched sampling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from mtp_fsm.sampling import (
    FAULT_EMPTY, FAULT_NAN, FAULT_OK, FAULT_POSINF, GREEDY, SamplingParams, filter_mask, gumbel_noise, mix32, row_key,
    sample_tokens, token_hash,
)
from mtp_fsm.sampling.candidates import top_k_candidates
from mtp_fsm.sampling.noise import MASK32, NOISE_TABLE_SIZE, gumbel_table
from mtp_fsm.sampling.sampler import NO_SAMPLED_ROWS
from mtp_fsm.sampling.topp import FX_LIMIT, FX_ONE, FX_STEP, MAX_VOCAB_FIXED, fixed_tables
from mtp_fsm.testing.alone import torch_threads

PROPS = settings(max_examples=50, deadline=None)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


@st.composite
def batches(draw, min_rows=1, max_rows=6, max_vocab=40):
    """Random logits [B, V] plus per-row parameters (temperature, top_k, top_p, seed, frame)."""
    b, v = draw(st.integers(min_rows, max_rows)), draw(st.integers(2, max_vocab))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logits = torch.randn(b, v, generator=g) * draw(st.sampled_from([0.1, 1.0, 4.0]))
    temperature = torch.tensor(draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 1.7]), min_size=b, max_size=b)))
    top_k = torch.tensor(draw(st.lists(st.integers(0, v + 2), min_size=b, max_size=b)), dtype=torch.int64)
    top_p = torch.tensor(draw(st.lists(st.sampled_from([1.0, 0.95, 0.5, 0.1, 1e-6]), min_size=b, max_size=b)))
    seed = torch.tensor(draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=b, max_size=b)), dtype=torch.int64)
    frame = torch.tensor(draw(st.lists(st.integers(0, 5000), min_size=b, max_size=b)), dtype=torch.int64)
    return logits, temperature, top_k, top_p, seed, frame


def sample(batch, codebook=0, **kw):
    logits, temperature, top_k, top_p, seed, frame = batch
    return sample_tokens(logits, temperature, top_k, top_p, seed, frame, codebook, **kw)


def rows(batch, index):
    return tuple(t[index] for t in batch)


@PROPS
@given(batches(), st.integers(0, 15))
def test_sampling_is_deterministic(batch, codebook):
    a, bad_a = sample(batch, codebook)
    b, bad_b = sample(tuple(t.clone() for t in batch), codebook)
    assert torch.equal(a, b) and torch.equal(bad_a, bad_b) and not bad_a.any()


@PROPS
@given(batches())
def test_greedy_is_argmax_whatever_the_filters(batch):
    logits, _, top_k, top_p, seed, frame = batch
    zero = torch.zeros(logits.shape[0])
    tokens, _ = sample_tokens(logits, zero, top_k, top_p, seed, frame, 0)
    assert torch.equal(tokens, logits.argmax(-1))


@PROPS
@given(batches(), st.sampled_from(["top_k=1", "top_p tiny"]))
def test_top_k_one_and_tiny_top_p_are_argmax(batch, how):
    logits, temperature, top_k, top_p, seed, frame = batch
    temperature = temperature.clamp(min=0.3)  # sampling, not greedy
    if how == "top_k=1":
        top_k = torch.ones_like(top_k)
    else:
        top_p = torch.full_like(top_p, 1e-9)
    tokens, _ = sample_tokens(logits, temperature, top_k, top_p, seed, frame, 0)
    picked = logits.gather(1, tokens[:, None])[:, 0]
    assert torch.equal(picked, logits.max(-1).values)


@PROPS
@given(batches(), st.integers(0, 3))
def test_tokens_are_always_kept_by_the_filters_and_the_allowed_mask(batch, codebook):
    logits, temperature, top_k, top_p, seed, frame = batch
    v = logits.shape[1]
    allowed = torch.zeros(v, dtype=torch.bool)
    allowed[torch.arange(v) % 3 != 1] = True
    tokens, _ = sample_tokens(logits, temperature, top_k, top_p, seed, frame, codebook, allowed=allowed)
    assert allowed[tokens].all()
    masked = logits.masked_fill(~allowed, float("-inf"))
    scores = masked / torch.where(temperature > 0, temperature, torch.ones_like(temperature))[:, None]
    keep = filter_mask(scores, top_k, top_p)
    sampled = temperature > 0
    assert keep[torch.arange(len(tokens)), tokens][sampled].all()


def brute_force_filter(scores: np.ndarray, k: int, p: float) -> np.ndarray:
    """top-k then top-p by the contract's words, one float32 row, Python integers for the mass."""
    v = len(scores)
    order = np.argsort(-scores, kind="stable")
    kth = np.sort(scores)[::-1][min(k, v) - 1] if k > 0 else -np.inf
    kept = scores >= kth
    if p >= 1.0:
        return kept
    hi = [round(FX_ONE * math.exp(-j / 64)) for j in range(FX_LIMIT >> 6)] + [0]
    lo = [round(FX_ONE * math.exp(-i / FX_STEP)) for i in range(64)]
    top = scores[kept].max()

    def weight(i: int) -> int:
        if not kept[i] or scores[i] == -np.inf:
            return 0
        d = float(np.float32(top - scores[i])) * FX_STEP  # the float32 difference, scaled exactly
        q = FX_LIMIT if d >= FX_LIMIT else math.floor(d)
        return (hi[q >> 6] * lo[q & 63]) >> 24

    weights = {i: weight(i) for i in order}
    total, need = sum(weights.values()), math.floor(p * FX_ONE)
    out = np.zeros(v, dtype=bool)
    before = 0
    for i in order:
        if kept[i] and scores[i] > -np.inf and before * FX_ONE < need * total:
            out[i] = True
        before += weights[i]
    threshold = scores[out].min() if out.any() else top  # nothing reached: the top score only
    return scores >= max(threshold, kth)


@PROPS
@given(batches(max_vocab=24))
def test_filter_mask_matches_a_brute_force_reading_of_the_contract(batch):
    logits, _, top_k, top_p, *_ = batch
    got = filter_mask(logits, top_k, top_p)
    for i in range(logits.shape[0]):
        want = brute_force_filter(logits[i].float().numpy(), int(top_k[i]), float(top_p[i]))
        assert got[i].numpy().tolist() == want.tolist(), (int(top_k[i]), float(top_p[i]))


def exact_half_row() -> torch.Tensor:
    """Scores [0, -d1, -d2] whose fixed-point weights are 2**24, w1, 2**24 - w1: the mass
    before the second score is exactly half of the total (d = q / 4096 is exact in float32)."""
    hi, lo = fixed_tables("cpu")
    q = torch.arange(FX_LIMIT + 1)
    w = ((hi[q >> 6] * lo[q & 63]) >> 24).tolist()
    at = {x: i for i, x in enumerate(w)}
    q1, q2 = next((i, at[FX_ONE - x]) for i, x in enumerate(w) if 0 < i < at.get(FX_ONE - x, 0) < FX_LIMIT)
    return torch.tensor([[0.0, -q1 / FX_STEP, -q2 / FX_STEP]])


def test_top_p_boundary_is_exclusive_in_exact_integers():
    row = exact_half_row()
    half = torch.tensor([0.5])
    cases = {0.5: [True, False, False], float(torch.nextafter(half, torch.ones(1))): [True, True, False],
             float(torch.nextafter(half, torch.zeros(1))): [True, False, False]}
    for p, want in cases.items():
        got = filter_mask(row, torch.zeros(1, dtype=torch.int64), torch.tensor([p]))
        assert got[0].tolist() == want, p
        assert brute_force_filter(row[0].numpy(), 0, p).tolist() == want, p


def test_top_p_beyond_the_fixed_point_vocabulary_is_refused_only_when_used():
    vocab = MAX_VOCAB_FIXED + 1
    scores = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    top_k = torch.tensor([0, 5])
    assert torch.equal(filter_mask(scores, top_k, torch.ones(2))[0], torch.ones(vocab, dtype=torch.bool))
    with pytest.raises(ValueError, match=str(MAX_VOCAB_FIXED)):
        filter_mask(scores, top_k, torch.tensor([1.0, 0.9]))


@PROPS
@given(batches(min_rows=2), st.data())
def test_noise_does_not_depend_on_batch_composition_or_row_order(batch, data):
    tokens, _ = sample(batch, 2)
    n = batch[0].shape[0]
    perm = torch.tensor(data.draw(st.permutations(range(n))))
    permuted, _ = sample(tuple(t[perm] for t in batch), 2)
    assert torch.equal(permuted, tokens[perm])
    subset = torch.tensor(sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1))))
    alone, _ = sample(tuple(t[subset] for t in batch), 2)
    assert torch.equal(alone, tokens[subset])
    for i in range(n):  # each row on its own
        one, _ = sample(tuple(t[i : i + 1] for t in batch), 2)
        assert int(one[0]) == int(tokens[i])


@PROPS
@given(batches(min_rows=2), st.data(), st.sampled_from([(float("nan"), FAULT_NAN), (float("inf"), FAULT_POSINF)]))
def test_nan_and_posinf_rows_are_faults_and_do_not_disturb_other_rows(batch, data, value_kind):
    value, kind = value_kind
    logits = batch[0].clone()
    n, v = logits.shape
    bad_row = data.draw(st.integers(0, n - 1))
    logits[bad_row, data.draw(st.integers(0, v - 1))] = value
    tokens, fault = sample((logits, *batch[1:]), 1)
    assert fault.tolist() == [kind if i == bad_row else FAULT_OK for i in range(n)]
    clean, clean_fault = sample(batch, 1)
    others = torch.arange(n) != bad_row
    assert torch.equal(tokens[others], clean[others]) and not clean_fault.any()
    assert 0 <= int(tokens[bad_row]) < v  # still a valid id (the row is discarded by the caller)


@PROPS
@given(batches(), st.data())
def test_minus_inf_is_a_mask_not_a_fault(batch, data):
    """-inf masks an id exactly like `allowed` does (upstream suppress_tokens); only a row
    with nothing left unmasked is a fault (FAULT_EMPTY)."""
    logits = batch[0]
    n, v = logits.shape
    masked = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=v, max_size=v), min_size=n, max_size=n)))
    tokens, fault = sample((logits.masked_fill(masked, float("-inf")), *batch[1:]), 1)
    empty = masked.all(dim=-1)
    assert fault.tolist() == [FAULT_EMPTY if e else FAULT_OK for e in empty.tolist()]
    picked = masked[torch.arange(n), tokens]
    assert not picked[~empty].any(), "a -inf id was sampled"
    if not masked.any():
        assert torch.equal(tokens, sample(batch, 1)[0])


@PROPS
@given(batches())
def test_skipping_the_sort_is_exact_when_no_row_filters(batch):
    logits, temperature, _, _, seed, frame = batch
    k0, p1 = torch.zeros(len(seed), dtype=torch.int64), torch.ones(len(seed))
    a, _ = sample_tokens(logits, temperature, k0, p1, seed, frame, 0, apply_filters=True)
    b, _ = sample_tokens(logits, temperature, k0, p1, seed, frame, 0, apply_filters=False)
    assert torch.equal(a, b)


def test_seed_frame_and_codebook_each_change_the_noise():
    seed, frame = torch.tensor([7, 7, 8, 7]), torch.tensor([0, 1, 0, 0])
    keys = row_key(seed, frame, 0)
    assert len(set(keys.tolist())) == 3 and int(keys[0]) == int(keys[3])
    assert int(row_key(seed[:1], frame[:1], 1)) != int(keys[0])
    # The high 32 bits of a 64-bit seed matter too.
    assert int(row_key(torch.tensor([7 + (1 << 40)]), frame[:1], 0)) != int(keys[0])
    assert ((keys >= 0) & (keys <= MASK32)).all()


def test_noise_helpers_are_pure_and_in_range():
    x = torch.tensor([0, 1, 2**32 - 1, 12345678], dtype=torch.int64)
    assert torch.equal(mix32(x), mix32(x.clone()))
    assert ((mix32(x) >= 0) & (mix32(x) <= MASK32)).all()
    key = row_key(torch.tensor([1, 2]), torch.tensor([0, 0]), 0)
    h = token_hash(key, 50)
    assert h.shape == (2, 50) and len(set(h[0].tolist())) == 50
    noise = gumbel_noise(key, 50)
    assert noise.dtype == torch.float32 and torch.isfinite(noise).all() and torch.equal(noise, gumbel_noise(key, 50))
    table = gumbel_table("cpu")
    assert table.shape == (NOISE_TABLE_SIZE,) and bool((table[1:] > table[:-1]).all())


def test_gumbel_max_samples_follow_the_softmax():
    """Frequencies over many seeds match softmax(logits / temperature) (chi-square, loose)."""
    n, temperature = 6000, 0.7
    logits = torch.tensor([1.0, 0.0, -0.5, 0.3])
    tokens, _ = sample_tokens(logits.expand(n, 4), torch.full((n,), temperature), torch.zeros(n, dtype=torch.int64),
                              torch.ones(n), torch.arange(n), torch.zeros(n, dtype=torch.int64), 0)
    observed = torch.bincount(tokens, minlength=4).double()
    expected = torch.softmax(logits.double() / temperature, 0) * n
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 20.0, (observed.tolist(), expected.tolist())  # 3 dof: p < 2e-4 by chance


def test_sampling_params_validation():
    assert SamplingParams().problems() == [] and GREEDY.problems() == []
    assert GREEDY.temperature == 0 and not GREEDY.filters
    assert SamplingParams(top_k=5).filters and SamplingParams(top_k=0, top_p=0.9).filters
    assert not SamplingParams(top_k=0, top_p=1.0).filters
    for bad, word in [
        (SamplingParams(temperature=-0.1), "temperature"), (SamplingParams(temperature=math.nan), "temperature"),
        (SamplingParams(temperature=math.inf), "temperature"), (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(top_k=2.5), "top_k"), (SamplingParams(top_p=0.0), "top_p"), (SamplingParams(top_p=1.5), "top_p"),
    ]:
        problems = bad.problems()
        assert len(problems) == 1 and word in problems[0], problems


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_logits_dtype_does_not_change_greedy(dtype):
    logits = torch.tensor([[0.5, 2.0, -1.0], [3.0, 1.0, 2.5]])
    tokens, fault = sample_tokens(logits.to(dtype), torch.zeros(2), torch.zeros(2, dtype=torch.int64), torch.ones(2),
                                  torch.tensor([1, 2]), torch.tensor([0, 0]), 0)
    assert tokens.tolist() == [1, 0] and not fault.any()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 2**40), min_size=1, max_size=6), st.integers(0, 500), st.integers(1, 15), st.integers(2, 300))
def test_a_frames_noise_drawn_in_one_pass_equals_per_codebook_noise(seeds, frame, count, vocab):
    from mtp_fsm.sampling import codebook_key, frame_key, gumbel_noise_codebooks

    key = frame_key(torch.tensor(seeds), torch.full((len(seeds),), frame))
    block = gumbel_noise_codebooks(key, 1, count, vocab)
    for c in range(1, count + 1):
        assert torch.equal(block[c - 1], gumbel_noise(codebook_key(key, c), vocab))


@st.composite
def top_k_batches(draw):
    """Top-k-only batches over vocabularies >= 4 k_max, with ties (coarse or bf16-rounded
    scores, a tie group at the k-th value), -inf masks and greedy rows mixed in."""
    b, v = draw(st.integers(1, 6)), draw(st.integers(8, 300))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logits = torch.randn(b, v, generator=g) * draw(st.sampled_from([0.1, 1.0, 4.0]))
    mode = draw(st.integers(0, 3))
    if mode == 1:
        logits = logits.round()  # large tie groups
    elif mode == 2:
        logits = logits.to(torch.bfloat16).float()
    elif mode == 3:
        logits[:, : v // 2] = logits[:, :1]  # half the row tied at one value
    logits[torch.rand(b, v, generator=g) < 0.1] = float("-inf")
    if draw(st.booleans()):
        logits[0] = float("-inf")  # nothing left (an empty-row fault)
    k_max = draw(st.integers(1, v // 4))
    top_k = torch.tensor(draw(st.lists(st.integers(1, k_max), min_size=b, max_size=b)))
    top_k[0] = k_max
    temperature = torch.tensor(draw(st.lists(st.sampled_from([0.0, 0.7, 1.0, 1.5]), min_size=b, max_size=b)))
    seed = torch.tensor(draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=b, max_size=b)), dtype=torch.int64)
    frame = torch.tensor(draw(st.lists(st.integers(0, 5000), min_size=b, max_size=b)), dtype=torch.int64)
    return logits, temperature, top_k, torch.ones(b), seed, frame, k_max


@settings(max_examples=200, deadline=None)
@given(top_k_batches(), st.integers(0, 15))
def test_candidate_noise_gives_the_full_vocabulary_tokens(batch, codebook):
    """Drawing noise for the top-k candidates only is the contract's Gumbel-max, bit for bit."""
    logits, temperature, top_k, top_p, seed, frame, k_max = batch
    full = sample_tokens(logits, temperature, top_k, top_p, seed, frame, codebook)
    sampled = top_k[temperature > 0]
    k_min = int(sampled.min()) if len(sampled) else NO_SAMPLED_ROWS
    fast = sample_tokens(logits, temperature, top_k, top_p, seed, frame, codebook, top_k_max=k_max,
                         any_top_p=False, top_k_min=k_min)
    assert torch.equal(full[0], fast[0]) and torch.equal(full[1], fast[1])


def test_a_tie_group_past_the_candidates_falls_back_to_the_whole_vocabulary():
    scores = torch.zeros(1, 40)
    scores[0, 0] = 5.0
    sampled = torch.tensor([False])
    assert top_k_candidates(scores, torch.tensor([2]), 2, torch.tensor([7]), sampled) is None  # 39 ids tie
    scores[0, 1] = 4.0
    assert top_k_candidates(scores, torch.tensor([2]), 2, torch.tensor([7]), sampled) is not None
    scores[0, :2] = 0.0  # a greedy row whose maximum is tied past the candidates
    assert top_k_candidates(scores, torch.tensor([2]), 2, torch.tensor([7]), torch.tensor([True])) is None
