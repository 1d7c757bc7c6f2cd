"""mtp_fsm.invariant against torch's own ops (accuracy), and its rules for every input (hypothesis)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from mtp_fsm import invariant
from mtp_fsm.testing.row_invariance import same_bits

FLOATS = st.floats(-60, 60, allow_nan=False, width=64)


def _ulps(ours, ref):
    scale = torch.finfo(ref.dtype).eps * ref.abs().clamp(min=torch.finfo(ref.dtype).tiny)
    return ((ours - ref).abs() / scale).max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_transcendentals_match_torch_within_a_few_ulps(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(20000, generator=g, dtype=torch.float64) * 8).to(dtype)
    assert _ulps(invariant.exp(x), torch.exp(x)) <= 2
    assert _ulps(invariant.tanh(x), torch.tanh(x)) <= 2
    assert _ulps(invariant.sigmoid(x), torch.sigmoid(x)) <= 4
    assert _ulps(invariant.silu(x), F.silu(x)) <= 4
    pos = x.abs() + 1e-3
    assert _ulps(invariant.log(pos), torch.log(pos)) <= 2
    angles = (torch.rand(20000, generator=g, dtype=torch.float64) * 5000).to(dtype)
    cos, sin = invariant.cos_sin(angles)
    assert (cos - torch.cos(angles)).abs().max() <= 2 * torch.finfo(dtype).eps
    assert (sin - torch.sin(angles)).abs().max() <= 2 * torch.finfo(dtype).eps


def test_special_values():
    x = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 800.0, -800.0], dtype=torch.float64)
    assert invariant.exp(x).tolist()[:4] == [1.0, 1.0, math.inf, 0.0]
    assert math.isnan(invariant.exp(x)[4]) and invariant.exp(x)[5] == math.inf and invariant.exp(x)[6] == 0.0
    assert invariant.tanh(torch.tensor([-0.0, 40.0, -40.0])).tolist() == [-0.0, 1.0, -1.0]
    logs = invariant.log(torch.tensor([0.0, -1.0, math.inf, 1.0], dtype=torch.float64))
    assert logs[0] == -math.inf and math.isnan(logs[1]) and logs[2] == math.inf and logs[3] == 0.0
    masked = torch.tensor([[0.0, -math.inf, 1.0]])
    assert torch.allclose(invariant.softmax(masked), torch.softmax(masked, -1))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 9), k=st.integers(1, 40), n=st.integers(1, 12), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_linear_rows_do_not_depend_on_the_batch(rows, k, n, seed, dtype):
    """Each row of linear / softmax / tree_sum equals that row computed alone, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(n, k, generator=g, dtype=torch.float64).to(dtype)
    full, probs, sums = invariant.linear(x, w), invariant.softmax(x), invariant.tree_sum(x, -1)
    for i in range(rows):
        assert same_bits(invariant.linear(x[i:i + 1], w)[0], full[i])
        assert same_bits(invariant.softmax(x[i:i + 1])[0], probs[i])
        assert same_bits(invariant.tree_sum(x[i:i + 1], -1)[0], sums[i])
    assert torch.allclose(full, F.linear(x, w), rtol=1e-4, atol=1e-4)


@settings(max_examples=60, deadline=None)
@given(values=st.lists(FLOATS, min_size=1, max_size=33), dim=st.sampled_from([0, -1]))
def test_tree_sum_is_a_sum(values, dim):
    column = torch.tensor(values, dtype=torch.float64)
    x = column[:, None].expand(-1, 2) if dim == 0 else column[None, :]
    got = invariant.tree_sum(x, dim)
    assert torch.allclose(got, torch.tensor(math.fsum(values), dtype=torch.float64), rtol=1e-12, atol=1e-9)
    assert invariant.tree_sum(x, dim, keepdim=True).shape == x.sum(dim, keepdim=True).shape


@settings(max_examples=100, deadline=None)
@given(x=FLOATS)
def test_exp_log_round_trip(x):
    t = torch.tensor([x], dtype=torch.float64)
    assert torch.allclose(invariant.log(invariant.exp(t)), t, rtol=1e-14, atol=1e-14)
