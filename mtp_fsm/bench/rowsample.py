"""Per-row sampling for the naive baselines: one request at a time, same tokens as the engine."""

from __future__ import annotations

import torch

from ..sampling import SamplingParams
from ..sampling.noise import MASK32, MUL_A, MUL_B, NOISE_BITS, gumbel_table, mix32

NEG_INF = float("-inf")


def _mix32_int(x: int) -> int:
    x ^= x >> 16
    x = (x * MUL_A) & MASK32
    x ^= x >> 15
    x = (x * MUL_B) & MASK32
    return x ^ (x >> 16)


def row_key_int(seed: int, frame_index: int, codebook: int) -> int:
    """`mtp_fsm.sampling.row_key` for one row, in Python integers (no tensor ops)."""
    h = _mix32_int(seed & MASK32)
    h = _mix32_int(h ^ ((seed >> 32) & MASK32))
    h = _mix32_int(h ^ (frame_index & MASK32))
    return _mix32_int(h ^ (codebook & MASK32))


def faulty_rows(logits: torch.Tensor) -> torch.Tensor:
    """Bool [B]: rows holding NaN or +inf (-inf is a mask). Rows with every id masked are
    not checked: the baselines' models never produce them."""
    logits = logits.float()
    return torch.isnan(logits).any(-1) | (logits == float("inf")).any(-1)


class RowSampler:
    """Samples one request's token from its own logits row [V] with torch ops.

    The lean per-request code a serving loop would write (top-k via `topk`, no top-p pass,
    no fault check), yet bit-identical to the engine's batched `sample_tokens` for
    top_p = 1: scores = logits / T, keep scores >= the k-th largest, argmax(scores + gumbel)
    with the same counter-based noise table; greedy at T = 0.
    """

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.vocab_size = vocab_size
        self.tokens = torch.arange(vocab_size, dtype=torch.int64, device=device)
        self.table = gumbel_table(device)

    def __call__(
        self,
        logits: torch.Tensor,
        params: SamplingParams,
        seed: int,
        frame_index: int,
        codebook: int,
        banned: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """logits [V]; banned: bool [V] of ids never sampled. Returns a 0-d int64 tensor."""
        if params.top_p < 1.0:
            raise NotImplementedError("the per-row baseline implements top-k only (bench uses top_p=1)")
        logits = logits.float()
        if banned is not None:
            logits = logits.masked_fill(banned, NEG_INF)
        if params.temperature <= 0:
            return logits.argmax()
        scores = logits / params.temperature
        key = row_key_int(seed, frame_index, codebook)
        noise = self.table[mix32(self.tokens ^ key) >> (32 - NOISE_BITS)]
        if 0 < params.top_k < self.vocab_size:
            kth = scores.topk(params.top_k).values[-1]
            return torch.where(scores >= kth, scores + noise, NEG_INF).argmax()
        return (scores + noise).argmax()
