"""models/cpu_linear.py: the packed oneDNN linear and the one-row column-major gemv equal F.linear to
float rounding, follow weight changes, and leave small weights, autograd and the batch-invariant path alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from models.cpu_linear import MIN_PACKED_NUMEL, PackedWeight, is_column_major, packed_linear, packs
from models.qwen3_tts.layers import Linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 40), lead=st.integers(1, 3), out_features=st.sampled_from([1024, 1536, 2048]),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_packed_equals_f_linear(rows, lead, out_features, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, 1024, generator=gen) / 32
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(lead, rows, 1024, generator=gen)
    with torch.no_grad():
        got = packed_linear(x, weight, b, PackedWeight())
    assert got is not None and got.shape == (lead, rows, out_features)
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_the_packed_copy_follows_the_weight():
    layer = Linear(1024, 1024, True).requires_grad_(False)
    x = torch.randn(3, 1024)
    with torch.no_grad():
        first = layer(x)
        layer.weight.mul_(2)  # in place: the version counter moves
        layer.bias.zero_()
        second = layer(x)
        torch.testing.assert_close(second, F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
        layer.load_state_dict({"weight": torch.eye(1024), "bias": torch.ones(1024)})
        torch.testing.assert_close(layer(x), x + 1, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(first, second)


def test_small_weights_autograd_and_batch_invariant_keep_their_paths():
    small = torch.randn(64, 32)
    assert small.numel() < MIN_PACKED_NUMEL
    with torch.no_grad():
        assert packed_linear(torch.randn(2, 32), small, None, PackedWeight()) is None
    big = torch.randn(1024, 1024, requires_grad=True)
    assert packed_linear(torch.randn(2, 1024), big, None, PackedWeight()) is None  # grad enabled
    layer = Linear(1024, 1024, False, batch_invariant=True).requires_grad_(False)
    x = torch.randn(1, 1024)
    with torch.no_grad():
        alone, batched = layer(x), layer(torch.cat([x, torch.randn(5, 1024)]))[:1]
    assert torch.equal(alone, batched) and layer._packed._key is None
    assert layer.weight.is_contiguous() and not is_column_major(layer.weight)


@settings(max_examples=10, deadline=None)
@given(lead=st.sampled_from([(), (1,), (1, 1)]), out_features=st.sampled_from([1024, 3072]), bias=st.booleans(),
       strided=st.booleans(), seed=st.integers(0, 2**16))
def test_one_row_fp32_streams_a_column_major_weight(lead, out_features, bias, strided, seed):
    """A one-row fp32 product moves the module's own weight to column-major storage in place
    (same Parameter, same values, same state_dict) and equals F.linear over the original."""
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(1024, out_features, bias).requires_grad_(False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, 1024, generator=gen) / 32)
        if bias:
            layer.bias.copy_(torch.randn(out_features, generator=gen))
    param, original = layer.weight, layer.weight.detach().clone()
    base = torch.randn(1024, 2, generator=gen)[:, 0] if strided else torch.randn(1024, generator=gen)
    x = base.reshape(*lead, 1024)  # one row; a strided view when `strided`
    assert x.is_contiguous() != strided
    with torch.no_grad():
        got = layer(x)
        expected = F.linear(x, original, layer.bias)
    assert layer.weight is param and is_column_major(layer.weight)
    assert torch.equal(layer.weight, original) and torch.equal(layer.state_dict()["weight"], original)
    assert got.shape == expected.shape == (*lead, out_features)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_column_major_weight_serves_many_rows_and_follows_loads():
    """After the move, products of more rows (oneDNN over a copy packed from the column-major
    storage) and a load_state_dict (copy_ into it, the layout kept) both stay right."""
    layer = Linear(1024, 2048, True).requires_grad_(False)
    x = torch.randn(5, 1024)
    with torch.no_grad():
        layer(x[:1])
        assert is_column_major(layer.weight)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight.contiguous(), layer.bias), rtol=1e-5, atol=1e-5)
        new_w, new_b = torch.randn(2048, 1024) / 32, torch.randn(2048)
        layer.load_state_dict({"weight": new_w, "bias": new_b})
        assert is_column_major(layer.weight)
        for rows in (1, 5):
            torch.testing.assert_close(layer(x[:rows]), F.linear(x[:rows], new_w, new_b), rtol=1e-5, atol=1e-5)


def test_bf16_keeps_a_row_major_weight():
    """bf16 runs over the packed copy where this CPU's oneDNN packs bf16, else F.linear (an
    AVX2-only host); either way the weight stays row-major and the product is right."""
    layer = Linear(1024, 1024, False).requires_grad_(False).to(torch.bfloat16)
    x = torch.randn(1, 1024, dtype=torch.bfloat16)
    with torch.no_grad():
        got = layer(x)
    assert layer.weight.is_contiguous()
    assert (layer._packed._key is not None) == packs(torch.bfloat16)
    torch.testing.assert_close(got, F.linear(x, layer.weight), rtol=2e-2, atol=2e-2)


def test_norms_reduce_with_aten_only_without_batch_invariance():
    """A Qwen3-TTS model built without batch invariance normalises with upstream's formula in
    ATen (float rounding away from the fixed-order tree); a batch-invariant one keeps the tree."""
    from models.qwen3_tts import Qwen3TTSTalker, tiny_config
    from models.qwen3_tts.layers import RMSNorm

    plain = Qwen3TTSTalker(tiny_config(batch_invariant=False), seed=0)
    exact = Qwen3TTSTalker(tiny_config(), seed=0)
    norms = [m for m in plain.module.modules() if isinstance(m, RMSNorm)]
    assert norms and not any(m.fixed_order for m in norms)
    assert all(m.fixed_order for m in exact.module.modules() if isinstance(m, RMSNorm))
    x = torch.randn(4, 64, dtype=torch.float64) * 7
    norm = next(m for m in norms if m.weight.shape[0] == 64).double()
    fast = norm(x)
    norm.fixed_order = True
    torch.testing.assert_close(fast, norm(x), rtol=1e-14, atol=1e-14)
    reference = x / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + norm.eps) * norm.weight
    torch.testing.assert_close(fast, reference, rtol=1e-12, atol=1e-12)


def test_a_first_use_under_inference_mode_leaves_a_trainable_weight():
    """The move to column-major storage at a first use under torch.inference_mode (as a serving
    host runs forwards) keeps an ordinary tensor: autograd can still use the weight afterwards."""
    layer = Linear(1024, 1024, False)
    x = torch.randn(1, 1024)
    with torch.inference_mode():
        layer(x)
    assert is_column_major(layer.weight) and not layer.weight.is_inference() and layer.weight.requires_grad
    layer(x).sum().backward()
    torch.testing.assert_close(layer.weight.grad, x.expand(1024, 1024))
