"""Batch-invariant tensor ops: a row's bits depend on that row alone, on any CPU and kernel set.

Why plain torch is not enough (measured, DESIGN 2.5.1): BLAS (MKL) picks gemm / gemv
kernels by shape and CPU vendor, so a row of `x @ w` can differ in the last place between
B = 1 and B > 1; ATen's reductions accumulate in vector-width order (AVX-512 and AVX2 differ);
ATen's elementwise transcendentals run a SIMD body (Sleef) and a scalar tail (libm), so an
element's bits depend on where it sits in the tensor, and `ATEN_CPU_CAPABILITY=default` uses
libm throughout. Every op here is composed of correctly rounded IEEE operations (+, -, *, /,
round, comparisons, bit casts) applied elementwise in an order fixed by the shapes alone, so
each output element is a function of its own inputs: independent of the batch, the row's
position, padding, the BLAS, the vector width and ATEN_CPU_CAPABILITY.

Transcendentals are evaluated in float64 (range reduction + Taylor polynomial, error a few
float64 ulps) and rounded once to the input's dtype. The price is memory and op count
(`linear` materialises the [.., N, K] products): right for tiny and checking models and for
per-row heads, not for a real-size backbone's matmuls, which use BLAS when a model is built
without `batch_invariant`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# fdlibm's split of ln 2: k * _LN2_HI is exact for |k| < 2**11.
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e+00
_EXP_MAX, _EXP_MIN = 709.782712893384, -745.1332191019412
_EXP_TAYLOR = tuple(1.0 / math.factorial(n) for n in range(14))  # |r| <= ln2 / 2: error < 1e-17
_EXPM1_TAYLOR = tuple(1.0 / math.factorial(n) for n in range(1, 19))  # |u| <= 0.7
# pi / 2 in three parts (fdlibm): k * part is exact for |k| < 2**20.
_PIO2 = (1.57079632673412561417e+00, 6.07710050630396597660e-11, 2.02226624871116645580e-21)
_TWO_OVER_PI = 6.36619772367581382433e-01
_SIN_TAYLOR = tuple((-1) ** i / math.factorial(2 * i + 1) for i in range(10))  # |r| <= pi / 4
_COS_TAYLOR = tuple((-1) ** i / math.factorial(2 * i) for i in range(11))
# log(m) = 2 atanh(s), s = (m - 1) / (m + 1), |s| <= 0.1716 for m in [sqrt(1/2), sqrt(2)).
_ATANH_TAYLOR = tuple(2.0 / (2 * i + 1) for i in range(14))
_GELU_BETA, _GELU_KAPPA = math.sqrt(2.0 / math.pi), 0.044715


def tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Sum along `dim` as a pairwise tree of elementwise adds (zero-padded to a power of two):
    the order depends on the reduced length only."""
    dim = dim % x.dim()
    y = x.movedim(dim, -1)
    n = y.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if n == 0:
        y = y.new_zeros(*y.shape[:-1], 1)
    elif width != n:
        y = F.pad(y, (0, width - n))
    while y.shape[-1] > 1:
        half = y.shape[-1] // 2
        y = y[..., :half] + y[..., half:]
    return y.movedim(-1, dim) if keepdim else y[..., 0]


def mean(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    return tree_sum(x, dim, keepdim) / x.shape[dim]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): x [..., K], weight [N, K] -> [..., N]."""
    y = tree_sum(x.unsqueeze(-2) * weight, -1)
    return y if bias is None else y + bias


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [K, N] -> [..., N]."""
    return linear(x, w.transpose(-1, -2))


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x**2) + eps) over the last axis (no weight)."""
    return x * torch.rsqrt(mean(x * x, -1, keepdim=True) + eps)


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2.0 ** k (float64) for int64 k in [-1022, 1023], from its bits."""
    return ((k + 1023) << 52).view(torch.float64)


def _horner(r: torch.Tensor, coefficients: tuple[float, ...]) -> torch.Tensor:
    p = torch.full_like(r, coefficients[-1])
    for c in reversed(coefficients[:-1]):
        p = p * r + c
    return p


def exp(x: torch.Tensor) -> torch.Tensor:
    h = x.to(torch.float64)
    hc = h.clamp(_EXP_MIN, _EXP_MAX)
    k = torch.round(hc * _INV_LN2)
    r = (hc - k * _LN2_HI) - k * _LN2_LO
    k = torch.nan_to_num(k).to(torch.int64)
    half = torch.div(k, 2, rounding_mode="floor")  # two factors keep 2**k representable down to 2**-1075
    y = _horner(r, _EXP_TAYLOR) * _pow2(half) * _pow2(k - half)
    y = torch.where(h > _EXP_MAX, math.inf, torch.where(h < _EXP_MIN, 0.0, y))
    return torch.where(torch.isnan(h), h, y).to(x.dtype)


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log (x > 0; 0 -> -inf, x < 0 or NaN -> NaN, inf -> inf)."""
    h = x.to(torch.float64)
    m, e = torch.frexp(h)  # h = m * 2**e, m in [0.5, 1): exact
    low = m < 0.7071067811865476
    m = torch.where(low, m * 2.0, m)
    e = (e - low.to(e.dtype)).to(torch.float64)
    s = (m - 1.0) / (m + 1.0)
    y = s * _horner(s * s, _ATANH_TAYLOR) + e * _LN2_LO + e * _LN2_HI
    y = torch.where(h == 0, -math.inf, torch.where(h == math.inf, math.inf, y))
    return torch.where((h < 0) | torch.isnan(h), math.nan, y).to(x.dtype)


def _expm1_small(u: torch.Tensor) -> torch.Tensor:
    """exp(u) - 1 for float64 |u| <= 0.7 without cancellation."""
    return u * _horner(u, _EXPM1_TAYLOR)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    e = exp(x - x.amax(dim, keepdim=True))  # the max is exact in any order
    return e / tree_sum(e, dim, keepdim=True)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + exp(-x)), ATen's formula."""
    return x / (1.0 + exp(-x))


def tanh(x: torch.Tensor) -> torch.Tensor:
    h = x.to(torch.float64)
    a = h.abs()
    small = a < 0.35
    em = _expm1_small(torch.where(small, -2.0 * a, 0.0))  # tanh(a) = -expm1(-2a) / (2 + expm1(-2a))
    t = exp(torch.where(small, 0.0, -2.0 * a))
    y = torch.where(small, -em / (2.0 + em), (1.0 - t) / (1.0 + t))
    return torch.copysign(y, h).to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (HF gelu_new / gelu_pytorch_tanh), ATen's formula."""
    return 0.5 * x * (1.0 + tanh(_GELU_BETA * (x + _GELU_KAPPA * x * x * x)))


def _reduce_quadrant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = x.to(torch.float64)
    k = torch.round(h * _TWO_OVER_PI)
    r = ((h - k * _PIO2[0]) - k * _PIO2[1]) - k * _PIO2[2]
    return r, torch.nan_to_num(k).to(torch.int64) % 4


def cos_sin(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos x, sin x) in x's dtype, for |x| < 2**19 (RoPE and time-embedding tables)."""
    r, q = _reduce_quadrant(x)
    r2 = r * r
    s, c = r * _horner(r2, _SIN_TAYLOR), _horner(r2, _COS_TAYLOR)
    cos = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    sin = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    return cos.to(x.dtype), sin.to(x.dtype)


def pow_table(base: float, exponents: torch.Tensor) -> torch.Tensor:
    """base ** exponents for a small host table (RoPE frequencies), through Python's libm and
    rounded once to the exponents' dtype."""
    values = [base ** e for e in exponents.to(torch.float64).tolist()]
    return torch.tensor(values, dtype=torch.float64).to(exponents.dtype)
