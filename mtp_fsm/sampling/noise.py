"""Counter-based noise: a pure integer hash of (seed, frame, codebook, token), no generators.

Only operations Triton has too (int64 multiply by constants below 2**31, xor, shifts,
masks), so the Triton kernels produce the same bits. The Gumbel value is read from a
fixed 2**16-entry table indexed by the hash: a lookup is exact on every backend, where
`-log(-log(u))` computed by two libms could differ in the last ulp and flip a sample.
"""

from __future__ import annotations

import functools

import torch

MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31, so a 32-bit value times one stays below 2**63 in int64.
MUL_A = 0x7FEB352D
MUL_B = 0x2C1B3C6D
NOISE_BITS = 16
NOISE_TABLE_SIZE = 1 << NOISE_BITS


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mix on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * MUL_A) & MASK32
    x = x ^ (x >> 15)
    x = (x * MUL_B) & MASK32
    return x ^ (x >> 16)


def frame_key(seed: torch.Tensor, frame_index: torch.Tensor) -> torch.Tensor:
    """Per-row hash state for one (request seed, frame index): int64 [B]. Computed once
    per step and shared by every codebook of the frame."""
    seed = seed.to(torch.int64)
    h = mix32(seed & MASK32)
    h = mix32(h ^ ((seed >> 32) & MASK32))
    return mix32(h ^ (frame_index.to(torch.int64) & MASK32))


def codebook_key(key: torch.Tensor, codebook: int) -> torch.Tensor:
    """Row keys for one codebook of the frame (codebook is a host int: no device copy)."""
    return mix32(key ^ (int(codebook) & MASK32))


def row_key(seed: torch.Tensor, frame_index: torch.Tensor, codebook: int) -> torch.Tensor:
    """Per-row hash state for one (request seed, frame index, codebook): int64 [B]."""
    return codebook_key(frame_key(seed, frame_index), codebook)


def token_hash(key: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Hash of every token id under each row key: int64 [B, V] in [0, 2**32)."""
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=key.device)
    return mix32(key[:, None] ^ tokens[None, :])


@functools.lru_cache(maxsize=None)
def _gumbel_table_cpu() -> torch.Tensor:
    # Midpoints of 2**16 equal bins of (0, 1), computed once in float64 then rounded; the log is
    # mtp_fsm.invariant's, so the table is the same on every CPU kernel set.
    from .. import invariant

    u = (torch.arange(NOISE_TABLE_SIZE, dtype=torch.float64) + 0.5) / NOISE_TABLE_SIZE
    return (-invariant.log(-invariant.log(u))).to(torch.float32)


_device_tables: dict[torch.device, torch.Tensor] = {}


def gumbel_table(device: torch.device | str) -> torch.Tensor:
    device = torch.device(device)
    table = _device_tables.get(device)
    if table is None:
        table = _device_tables[device] = _gumbel_table_cpu().to(device)
    return table


def gumbel_noise_codebooks(key: torch.Tensor, first: int, count: int, vocab_size: int) -> torch.Tensor:
    """Noise of codebooks first..first+count-1 for frame keys [B] in one pass: [count, B, V].

    Bit-identical to gumbel_noise(codebook_key(key, c), V) per codebook; the noise never
    depends on earlier tokens, so a frame's MTP noise can be drawn before its depth loop.
    """
    codebooks = torch.arange(first, first + count, dtype=torch.int64, device=key.device)
    keys = mix32(key[None, :] ^ (codebooks[:, None] & MASK32))
    return gumbel_noise(keys.reshape(-1), vocab_size).reshape(count, key.shape[0], vocab_size)


def gumbel_noise(key: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise [B, V] (float32) as a pure function of the row keys."""
    index = token_hash(key, vocab_size) >> (32 - NOISE_BITS)
    return gumbel_table(key.device)[index]
