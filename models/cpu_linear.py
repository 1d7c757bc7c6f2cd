"""Inference linear layers on a CPU: one-row fp32 products stream a column-major weight, more rows go through oneDNN over a copy packed once."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Measured on this project's CPU (1 thread, fp32, [3072, 1024] weights, bench/real_size.py's
# probe): F.linear (MKL) over a row-major weight falls to ~9 GB/s at 8 rows (its small-M gemm is
# compute-bound); oneDNN over a weight packed once streams ~22 GB/s at 8 rows. Packing keeps a
# second copy of the weight, so only large weights are packed (tiny and checking models keep
# F.linear's exact path).
MIN_PACKED_NUMEL = 1 << 20
PACK_BATCH_HINT = 16  # one packed layout serves 1..32 rows within noise (measured 1, 8, 32)
_DTYPES = (torch.float32, torch.bfloat16)
# One row (a B=1 decode step, the code predictor's depth steps) is a gemv: it reads the whole
# weight for one multiply-add per element, so only how the weight streams matters. Over a
# column-major fp32 weight MKL's gemv walks memory in one sequential pass, the access of a
# plain sum: measured on an Intel host at 1.00-1.07x a same-run streaming sum, against
# 0.78-0.84x for oneDNN's packed layout and 0.91-0.97x for a row-major weight (whose rows MKL
# reads as several strided streams). An earlier host (the first real-size bench) measured
# oneDNN's packed layout ahead of a row-major MKL gemv at one row (~26-33 against ~20 GB/s);
# the column-major gemv was not measured there. bf16 is the other way round (packed 0.77x,
# column-major 0.37x, row-major 0.65x), so bf16 keeps the packed path at every row count.
ONE_ROW_DTYPES = (torch.float32,)


def packs(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN runs packed products of `dtype` (bf16 needs AVX-512 BW/VL/DQ
    or AVX-NE-CONVERT: an AVX2-only host refuses to pack it, so bf16 keeps F.linear there)."""
    if dtype not in _DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype == weight.dtype
            and weight.numel() >= MIN_PACKED_NUMEL
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
            and packs(weight.dtype))


def is_column_major(weight: torch.Tensor) -> bool:
    """[N, K] stored as its contiguous transpose (element (n, k) at k * N + n)."""
    return weight.dim() == 2 and weight.stride() == (1, weight.shape[0])


def hold_column_major_(weight: torch.Tensor) -> None:
    """Give `weight` ([N, K]) column-major storage in place: the same tensor object (a module's
    Parameter stays registered, its state_dict key and values unchanged), values copied once
    into the transposed layout, the old storage freed. Later in-place writes (load_state_dict's
    copy_) keep the layout; a weight assigned anew is moved again at its first use."""
    if not is_column_major(weight):
        # Outside inference mode: a first use under it must not leave the module holding an
        # inference tensor (autograd would refuse the weight later).
        with torch.inference_mode(False):
            weight.data = weight.detach().t().contiguous().t()


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
    """x [..., K] @ weight[N, K].T + bias, or None where this path does not apply (another
    device or dtype, a small weight, autograd, no oneDNN or none for this dtype on this CPU).

    An fp32 `weight` (the calling module's own parameter) is moved to column-major storage at
    its first use here (hold_column_major_), so that one-row products stream it; products of
    more rows, and every bf16 product, run over the packed copy in `cache`."""
    if not _usable(x, weight):
        return None
    flat = x.reshape(-1, x.shape[-1])
    if weight.dtype in ONE_ROW_DTYPES:
        hold_column_major_(weight)
        if flat.shape[0] == 1:
            return F.linear(flat, weight, bias).view(*x.shape[:-1], weight.shape[0])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(flat, cache.get(weight), bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])
