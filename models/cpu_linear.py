"""Inference linear layers on a CPU through oneDNN with weights packed once (the real-size talkers' matmuls)."""

from __future__ import annotations

import torch

# Measured on this project's CPU (1 thread, fp32, [3072, 1024] weights, bench/real_size.py's
# probe): F.linear (MKL) streams ~20 GB/s at one row and falls to ~9 GB/s at 8 rows (its small-M
# gemm is compute-bound); oneDNN over a weight packed once streams ~26-33 GB/s at one row (the
# bandwidth of a plain sum) and ~22 GB/s at 8 rows. Packing keeps a second copy of the weight,
# so only large weights are packed (tiny and checking models keep F.linear's exact path).
MIN_PACKED_NUMEL = 1 << 20
PACK_BATCH_HINT = 16  # one packed layout serves 1..32 rows within noise (measured 1, 8, 32)
_DTYPES = (torch.float32, torch.bfloat16)


def _usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype == weight.dtype
            and weight.dtype in _DTYPES and weight.numel() >= MIN_PACKED_NUMEL
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
            and torch.backends.mkldnn.is_available())


class PackedWeight:
    """A weight's oneDNN-packed copy, made on first use and again whenever the weight changes
    (another tensor, or written in place: its version counter moves, e.g. a checkpoint load)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._packed: torch.Tensor | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.data_ptr(), weight._version, weight.dtype, tuple(weight.shape))
        if key != self._key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
            self._key = key
        return self._packed  # type: ignore[return-value]


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  cache: PackedWeight) -> torch.Tensor | None:
    """x [..., K] @ weight[N, K].T + bias through the packed weight, or None where the packed
    path does not apply (another device or dtype, a small weight, autograd, no oneDNN)."""
    if not _usable(x, weight):
        return None
    flat = x.reshape(-1, x.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(flat, cache.get(weight), bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])
