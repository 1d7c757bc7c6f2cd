"""Counter-based standard Gaussian noise per row: a pure function of (seed, frame, element)."""

from __future__ import annotations

import math

import torch

from .. import invariant
from .noise import codebook_key, token_hash

# The hash stream of payload noise, apart from every codebook's (codebooks are small ints).
PAYLOAD_STREAM = 0x50A7_10AD
_SCALE = 1.0 / 2**32


def gaussian_noise(frame_keys: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 [B, *shape] of N(0, 1) draws for rows whose frame keys (noise.frame_key) are
    `frame_keys` [B]: Box-Muller on two hashed uniforms per element, in float64, rounded once.

    Element i of a row depends only on that row's key and i, never on the batch; log and cos
    come from mtp_fsm.invariant, so the bits are the same on every CPU kernel set.
    """
    numel = int(torch.Size(shape).numel())
    hashes = token_hash(codebook_key(frame_keys, PAYLOAD_STREAM), 2 * numel).to(torch.float64)
    u1 = (hashes[:, :numel] + 0.5) * _SCALE  # in (0, 1): the log is finite
    u2 = (hashes[:, numel:] + 0.5) * _SCALE
    z = torch.sqrt(-2.0 * invariant.log(u1)) * invariant.cos_sin((2.0 * math.pi) * u2)[0]
    return z.to(torch.float32).reshape(frame_keys.shape[0], *shape)
