"""Triton == torch with the CB0 repetition penalty after the filters (Chatterbox's order), bit for bit.

The stage-level parity (tests/kernels/test_triton_parity.py::test_sample_cb0) draws both
orders over random tables; here the sampler rows alone, with greedy rows under filters and
extreme penalties, and the tiny Chatterbox talker end to end on both backends.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

pytest.importorskip("triton")

from models.chatterbox import ChatterboxInputs, demo_conditioning, tiny_config, tiny_demo_talker  # noqa: E402
from mtp_fsm.engine import LockstepEngine, NewRequest  # noqa: E402
from mtp_fsm.kernels import reference as REF  # noqa: E402
from mtp_fsm.kernels import triton_kernels as TK  # noqa: E402
from mtp_fsm.kernels.contract import StepBatch  # noqa: E402
from mtp_fsm.lifecycle import State, compile_lifecycle, single_codebook_lifecycle  # noqa: E402
from mtp_fsm.model_api import ModelSpec  # noqa: E402
from mtp_fsm.sampling import SamplingParams  # noqa: E402
from mtp_fsm.sampling.penalties import PENALTY_AFTER_FILTERS  # noqa: E402
from mtp_fsm.slots import SlotTable  # noqa: E402
from mtp_fsm.testing.runs import run_to_completion  # noqa: E402

DEVICE = torch.device("cpu") if TK.interpreted() else torch.device("cuda")
if TK.unsupported(DEVICE) is not None:
    pytest.skip(f"Triton backend unusable here: {TK.unsupported(DEVICE)}", allow_module_level=True)

V, SLOTS, EOS = 50, 6, 49
LC = compile_lifecycle(single_codebook_lifecycle()).to(DEVICE)


def _table(g: torch.Generator, rows: int) -> SlotTable:
    spec = ModelSpec(name="t", hidden_size=4, num_codebooks=1, backbone_vocab_size=V, codebook_size=V - 1,
                     eos_token_id=EOS, max_context=8, repetition_penalty_order=PENALTY_AFTER_FILTERS)
    t = SlotTable.allocate(SLOTS, spec, DEVICE)
    r = SLOTS + 1
    t.state.fill_(int(State.DECODING))
    t.serial.fill_(1)
    t.prompt_len.fill_(1)
    t.num_computed.fill_(2)
    t.max_frames.fill_(8)
    t.num_frames.copy_(torch.randint(0, 6, (r,), generator=g))
    t.seed.copy_(torch.randint(-(2**62), 2**62, (r,), generator=g))
    t.cb0_temperature.copy_(torch.tensor([0.0, 0.3, 0.8, 1.0, 1e-30])[torch.randint(0, 5, (r,), generator=g)])
    t.cb0_top_k.copy_(torch.tensor([0, 1, 2, 7, V + 3])[torch.randint(0, 5, (r,), generator=g)])
    t.cb0_top_p.copy_(torch.tensor([1.0, 0.95, 0.5, 1e-6])[torch.randint(0, 4, (r,), generator=g)])
    t.cb0_penalty.copy_(torch.tensor([1.0, 1.2, 1.3, 0.5, 1e-30, 1e30])[torch.randint(0, 6, (r,), generator=g)])
    t.cb0_counts.copy_(torch.where(torch.rand(r, V, generator=g) < 0.3, 1, 0).int())
    t.min_frames.copy_(torch.randint(0, 4, (r,), generator=g))
    return t


def _clone(t: SlotTable) -> SlotTable:
    return t.clone()


def _batch(g: torch.Generator, rows: int) -> StepBatch:
    idx = torch.randperm(SLOTS, generator=g)[:rows].to(DEVICE)
    ones = torch.ones(rows, dtype=torch.int64, device=DEVICE)
    return StepBatch(idx_mapping=idx, is_padding=torch.zeros(rows, dtype=torch.bool, device=DEVICE),
                     expected_serial=ones, num_scheduled=ones, query_start_loc=torch.arange(rows + 1, device=DEVICE),
                     token_rows=torch.arange(rows, device=DEVICE), token_offsets=torch.zeros_like(ones),
                     last_token=torch.arange(rows, device=DEVICE), cb0_filters=True, mtp_filters=False)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.integers(0, 2**31), st.integers(1, SLOTS), st.sampled_from([1.0, 8.0, 1e30]))
def test_sample_cb0_with_the_penalty_after_the_filters(seed, rows, scale):
    g = torch.Generator().manual_seed(seed)
    ref = _table(g, rows)
    tri = _clone(ref)
    batch = _batch(g, rows)
    logits = torch.randn(rows, V, generator=g) * scale
    logits[torch.rand(rows, V, generator=g) < 0.2] = float("-inf")
    if seed % 3 == 0:
        logits = torch.randint(-2, 3, (rows, V), generator=g).float()  # ties
    tok_ref = REF.sample_cb0(ref, LC, batch, logits.to(DEVICE), eos_token_id=EOS, allowed=None)
    tok_tri = TK.sample_cb0(tri, LC, batch, logits.to(DEVICE), eos_token_id=EOS, allowed=None)
    assert torch.equal(tok_ref, tok_tri)
    for name, column in ref.columns().items():
        assert torch.equal(column, tri.columns()[name]), name


def test_chatterbox_torch_and_triton_publish_identical_frames():
    """The tiny Chatterbox T3 (penalty 1.2 after the filters by default), sampled and greedy
    requests batched together: every frame equal on both backends."""
    speaker, cond = demo_conditioning(tiny_config())

    def requests():
        params = (SamplingParams(0.8, 50, 0.95), SamplingParams(0.0, 5, 1.0), SamplingParams(0.8, 1, 1.0, 1.3))
        return [NewRequest(f"c{i}", ChatterboxInputs(text="la la la" * (i + 1), speaker_emb=speaker, cond_tokens=cond),
                           max_frames=8, seed=11 + i, cb0_sampling=p) for i, p in enumerate(params)]

    runs = [run_to_completion(LockstepEngine(tiny_demo_talker(0, device=DEVICE), 3, device=DEVICE, kernels=k),
                              requests()) for k in ("torch", "triton")]
    assert runs[0] == runs[1] and sum(len(f) for f in runs[0][0].values()) > 8
