"""What-if for the engine owner: a leaner batched sampler, bit-identical, timed against the current one."""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch

from ..sampling import sample_tokens
from .counters import count_call
from ..sampling.noise import MASK32, NOISE_BITS, gumbel_table, mix32

NEG_INF = float("-inf")


def step_key(seed: torch.Tensor, frame_index: torch.Tensor) -> torch.Tensor:
    """The first three rounds of `row_key`: they do not depend on the codebook, so once per step."""
    seed = seed.to(torch.int64)
    h = mix32(seed & MASK32)
    h = mix32(h ^ ((seed >> 32) & MASK32))
    return mix32(h ^ (frame_index.to(torch.int64) & MASK32))


def lean_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    key3: torch.Tensor,
    codebook: int,
    tokens: torch.Tensor,
    *,
    k_max: int,
    allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_tokens` for batches where every row has top_p = 1 and 1 <= top_k <= k_max
    (host-known from the admitted requests): `topk(k_max)` instead of a full sort plus the
    fixed-point top-p mass, the per-step key prefix reused, the codebook folded in as a
    Python int (no tensor made from host data). Same tokens, bit for bit."""
    logits = logits.float()
    bad = ~torch.isfinite(logits).all(dim=-1)
    logits = torch.nan_to_num(logits, nan=0.0, posinf=0.0, neginf=0.0)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, NEG_INF)
    greedy = temperature <= 0
    scores = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    kth = scores.topk(k_max, dim=-1).values.gather(-1, (top_k.clamp(1, k_max) - 1)[:, None])
    key = mix32(key3 ^ (codebook & MASK32))
    noise = gumbel_table(logits.device)[mix32(key[:, None] ^ tokens[None, :]) >> (32 - NOISE_BITS)]
    scores = torch.where(scores >= kth, scores + noise, NEG_INF)
    return torch.argmax(torch.where(greedy[:, None], logits, scores), dim=-1), bad


def mtp_noise(key3: torch.Tensor, num_codebooks: int, tokens: torch.Tensor) -> torch.Tensor:
    """Gumbel noise of codebooks 1..Q-1 in one pass, [Q-1, B, V]: the noise depends on (seed,
    frame, codebook, token) only, never on earlier codebooks' tokens, so the MTP sampler can
    draw it for the whole frame before the depth loop starts."""
    books = torch.arange(1, num_codebooks, dtype=torch.int64, device=key3.device)
    keys = mix32(key3[None, :] ^ books[:, None])
    return gumbel_table(key3.device)[mix32(keys[:, :, None] ^ tokens[None, None, :]) >> (32 - NOISE_BITS)]


def noised_sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, noise: torch.Tensor, *, k_max: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`lean_sample` with the noise already drawn (see `mtp_noise`)."""
    logits = logits.float()
    bad = ~torch.isfinite(logits).all(dim=-1)
    logits = torch.nan_to_num(logits, nan=0.0, posinf=0.0, neginf=0.0)
    greedy = temperature <= 0
    scores = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    kth = scores.topk(k_max, dim=-1).values.gather(-1, (top_k.clamp(1, k_max) - 1)[:, None])
    scores = torch.where(scores >= kth, scores + noise, NEG_INF)
    return torch.argmax(torch.where(greedy[:, None], logits, scores), dim=-1), bad


def compare_samplers(
    batch_sizes: Sequence[int], cb0_vocab: int, vocab: int, *, num_codebooks: int = 16, top_k: int = 50,
    reps: int = 7, count_ops: bool = False, log=print,
) -> dict:
    """Per batch size: ms for one step's sampling (CB0 + Q-1 MTP codebooks) with the engine's
    `sample_tokens`, with `lean_sample`, and with `lean_sample` for CB0 + `mtp_noise` /
    `noised_sample` for the MTP codebooks; raises if any token differs."""
    out = {}
    gen = torch.Generator().manual_seed(0)
    for b in batch_sizes:
        cb0_logits = torch.randn(b, cb0_vocab, generator=gen) * 3
        mtp_logits = torch.randn(num_codebooks - 1, b, vocab, generator=gen) * 3
        allowed = torch.ones(cb0_vocab, dtype=torch.bool)
        temperature = torch.full((b,), 0.9)
        k = torch.full((b,), top_k, dtype=torch.int64)
        p = torch.ones(b)
        seed = torch.randint(-(2**62), 2**62, (b,), generator=gen)
        frame = torch.randint(0, 500, (b,), generator=gen)
        tok0, tok = torch.arange(cb0_vocab), torch.arange(vocab)

        def reference():
            got = [sample_tokens(cb0_logits, temperature, k, p, seed, frame, 0, allowed=allowed)[0]]
            got += [sample_tokens(mtp_logits[g - 1], temperature, k, p, seed, frame, g)[0] for g in range(1, num_codebooks)]
            return got

        def lean():
            key3 = step_key(seed, frame)
            got = [lean_sample(cb0_logits, temperature, k, key3, 0, tok0, k_max=top_k, allowed=allowed)[0]]
            got += [lean_sample(mtp_logits[g - 1], temperature, k, key3, g, tok, k_max=top_k)[0]
                    for g in range(1, num_codebooks)]
            return got

        def lean_noise():
            key3 = step_key(seed, frame)
            got = [lean_sample(cb0_logits, temperature, k, key3, 0, tok0, k_max=top_k, allowed=allowed)[0]]
            noise = mtp_noise(key3, num_codebooks, tok)
            got += [noised_sample(mtp_logits[g - 1], temperature, k, noise[g - 1], k_max=top_k)[0]
                    for g in range(1, num_codebooks)]
            return got

        variants = {"reference": reference, "lean": lean, "lean_noise": lean_noise}
        want = reference()
        same = all(all(torch.equal(a, c) for a, c in zip(want, fn())) for fn in variants.values())
        if not same:
            raise AssertionError(f"a lean sampler differs from sample_tokens at B={b}")
        times = {name: [] for name in variants}
        for _ in range(reps):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        ms = {n: 1e3 * statistics.median(t) for n, t in times.items()}
        ops = {n: count_call(fn).kernels for n, fn in variants.items()} if count_ops else {}
        out[b] = {"reference_ms": ms["reference"], "lean_ms": ms["lean"], "lean_noise_ms": ms["lean_noise"],
                  "speedup": ms["reference"] / ms["lean"], "speedup_noise": ms["reference"] / ms["lean_noise"],
                  "ops": ops, "identical": same}
        log(f"  sampler B={b} V={vocab}: sample_tokens {ms['reference']:.2f} ms, lean {ms['lean']:.2f} ms, "
            f"lean + noise drawn once {ms['lean_noise']:.2f} ms; same tokens" + (f"; ops {ops}" if ops else ""))
    return out
