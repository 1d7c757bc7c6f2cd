"""Triton backend vs the torch reference: every output and every slot-table column bit-equal.

Each test builds a random slot table (mixed states incl. free / terminal / preempted and
the within-step states, padding rows pointing at a random scratch row, arbitrary row
order, stale serials, bad spans, float32 and bfloat16 embeddings), clones it, runs one
stage through the reference and through Triton, and compares bit patterns (atol=0), for
both lifecycle variants and for random rule tables (the chain executor is generic).
On a CPU the kernels run under the Triton interpreter (tests/kernels/conftest.py).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

pytest.importorskip("triton")

from mtp_fsm.engine import LockstepEngine, NewRequest  # noqa: E402
from mtp_fsm.kernels import contract  # noqa: E402
from mtp_fsm.kernels import reference as REF  # noqa: E402
from mtp_fsm.kernels import triton_kernels as TK  # noqa: E402
from mtp_fsm.kernels.contract import ReplayFrames, StagedAdmits, StagedEvents, StepBatch  # noqa: E402
from mtp_fsm.lifecycle import (  # noqa: E402
    VARIANTS, DeviceLifecycle, Phase, Predicate, State, Trigger, compile_lifecycle, mtp_lifecycle, single_codebook_lifecycle,
)
from mtp_fsm.model_api import ColumnSpec, ModelSpec  # noqa: E402
from mtp_fsm.sampling import SamplingParams  # noqa: E402
from mtp_fsm.sampling.penalties import PENALTY_ORDERS  # noqa: E402
from mtp_fsm.slots import SlotTable  # noqa: E402
from mtp_fsm.gpu.step_harness import lockstep_plans, scripted  # noqa: E402
from mtp_fsm.testing import ScriptInputs  # noqa: E402

DEVICE = torch.device("cpu") if TK.interpreted() else torch.device("cuda")
if TK.unsupported(DEVICE) is not None:
    pytest.skip(f"Triton backend unusable here: {TK.unsupported(DEVICE)} (triton was imported before "
                "TRITON_INTERPRET=1; run `pytest tests/kernels`)", allow_module_level=True)

H, Q, C, SLOTS, V0 = 8, 3, 12, 6, 37
EOS = 34
FAST = settings(max_examples=15, deadline=None, derandomize=True)
MORE = settings(max_examples=40, deadline=None, derandomize=True)
LIFECYCLES = {spec.name: compile_lifecycle(spec).to(DEVICE) for spec in (f() for f in VARIANTS.values())}
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# -- random tables and batches ---------------------------------------------------------


def _rand(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _ints(g, lo, hi, *shape, dtype=torch.int64):
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def make_table(seed: int, dtype: torch.dtype, live_bias: tuple[int, ...] = ()) -> SlotTable:
    """Every column random (scratch row included); `live_bias` states are drawn more often."""
    g = torch.Generator().manual_seed(seed)
    spec = ModelSpec(name="t", hidden_size=H, num_codebooks=Q, backbone_vocab_size=V0, codebook_size=30,
                     eos_token_id=EOS, max_context=C, dtype=dtype)
    extra = {"text_key": ColumnSpec((), torch.int64), "trail": ColumnSpec((4, H), dtype, 0.5),
             "flag": ColumnSpec((), torch.bool)}
    t = SlotTable.allocate(SLOTS, spec, "cpu", extra)
    r = SLOTS + 1
    pool = torch.tensor(list(range(9)) + list(live_bias) * 3)
    t.state.copy_(pool[_ints(g, 0, len(pool), r)].int())
    t.serial.copy_(_ints(g, 0, 4, r))
    t.prompt_len.copy_(_ints(g, 1, C, r))
    t.num_computed.copy_(_ints(g, 0, C + 1, r))
    t.num_frames.copy_(_ints(g, 0, C + 2, r))
    # Half the rows sit at the frame budget's edge (the frame being published may reach it).
    near = (t.num_frames + _ints(g, 0, 3, r)).clamp(min=1)
    t.max_frames.copy_(torch.where(torch.rand(r, generator=g) < 0.5, near, _ints(g, 1, C + 2, r)))
    t.finish_reason.copy_(_ints(g, 0, 6, r, dtype=torch.int32))
    t.frame_embed.copy_(_rand(g, r, H, dtype=dtype))
    t.frame_codes.copy_(_ints(g, 0, 30, r, Q))
    t.frame_log.copy_(_ints(g, 0, 30, r, C, Q))
    t.seed.copy_(torch.randint(-(2**63), 2**63 - 1, (r,), generator=g))
    for prefix in ("cb0", "mtp"):
        temps = torch.tensor([0.0, 0.7, 1.0, 1.6, 0.25])[_ints(g, 0, 5, r)]
        getattr(t, f"{prefix}_temperature").copy_(temps)
        k = _ints(g, 0, V0 + 3, r)
        getattr(t, f"{prefix}_top_k").copy_(torch.where(torch.rand(r, generator=g) < 0.5, 0, k))
        p = torch.rand(r, generator=g) * 0.95 + 0.05
        getattr(t, f"{prefix}_top_p").copy_(torch.where(torch.rand(r, generator=g) < 0.4, 1.0, p))
    t.error.copy_(torch.where(torch.rand(r, generator=g) < 0.2, _ints(g, 0, 8, r), 0).int())
    t.prompt_embeds.copy_(_rand(g, r, C, H, dtype=dtype))
    t.extra["text_key"].copy_(_ints(g, 0, 8, r))
    t.extra["trail"].copy_(_rand(g, r, 4, H, dtype=dtype))
    t.extra["flag"].copy_(torch.rand(r, generator=g) < 0.5)
    # The CB0 history rules: penalties either side of 1, EOS masked on rows below min_frames.
    t.cb0_penalty.copy_(torch.tensor([1.0, 1.05, 1.7, 0.6])[_ints(g, 0, 4, r)])
    t.min_frames.copy_(_ints(g, 0, C + 2, r))
    t.cb0_counts.copy_(torch.where(torch.rand(r, V0, generator=g) < 0.2, _ints(g, 1, 4, r, V0, dtype=torch.int32), 0))
    return _to(t, DEVICE)


def _to(t: SlotTable, device) -> SlotTable:
    return t.clone(device)


def make_batch(seed: int, table: SlotTable, rows: int, pad_tokens: bool = False, filters=(True, True)) -> StepBatch:
    """Distinct owned slots in random order, padding rows (scratch), stale serials, bad spans."""
    g = torch.Generator().manual_seed(seed)
    real = int(_ints(g, 0, min(rows, SLOTS) + 1, 1))
    slots = torch.randperm(SLOTS, generator=g)[:real].tolist() + [None] * (rows - real)
    slots = [slots[i] for i in torch.randperm(rows, generator=g).tolist()]
    serial, computed, plen = (x.cpu() for x in (table.serial, table.num_computed, table.prompt_len))
    idx, pad, expected, counts = [], [], [], []
    for s in slots:
        if s is None:
            idx.append(SLOTS), pad.append(True), expected.append(0), counts.append(1 if pad_tokens else 0)
            continue
        stale = float(torch.rand(1, generator=g)) < 0.15
        idx.append(s), pad.append(False), expected.append(int(serial[s]) + (1 if stale else 0))
        left = int(plen[s] - computed[s])
        n = int(_ints(g, 1, left + 1, 1)) if left > 0 else 1
        counts.append(n + (1 if float(torch.rand(1, generator=g)) < 0.25 else 0))  # some bad spans
    starts = torch.tensor([0] + counts).cumsum(0)
    token_rows = torch.repeat_interleave(torch.arange(rows), torch.tensor(counts))
    return StepBatch(
        idx_mapping=torch.tensor(idx).to(DEVICE), is_padding=torch.tensor(pad).to(DEVICE),
        expected_serial=torch.tensor(expected).to(DEVICE), num_scheduled=torch.tensor(counts).to(DEVICE),
        query_start_loc=starts.to(DEVICE), token_rows=token_rows.to(DEVICE),
        token_offsets=(torch.arange(int(starts[-1])) - starts[token_rows]).to(DEVICE),
        last_token=(starts[1:] - 1).clamp(min=0).to(DEVICE), cb0_filters=filters[0], mtp_filters=filters[1],
    )


class Toy:
    """frame_embed / text_step callables (model dtype may differ from the table's)."""

    def __init__(self, dtype):
        g = torch.Generator().manual_seed(7)
        self.codes = _rand(g, Q, 64, H, dtype=dtype).to(DEVICE)
        self.text = _rand(g, 8, H, dtype=dtype, scale=0.3).to(DEVICE)

    def frame_embed(self, codes):
        out = self.codes[0][codes[:, 0].clamp(0, 63)]
        for q in range(1, codes.shape[1]):
            out = out + self.codes[q][codes[:, q].clamp(0, 63)]
        return out

    def text_step(self, columns, slots, frame_index):
        return self.text[(columns["text_key"][slots] + frame_index) % 8]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_RAW[t.element_size()]) if t.is_floating_point() else t


def assert_same(a, b, what=""):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(_bits(a), _bits(b)), f"{what}: reference {a} != triton {b}"
    elif isinstance(a, (tuple, list)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{what}[{i}]")


def assert_tables(a: SlotTable, b: SlotTable):
    for name, col in a.columns().items():
        assert_same(col, b.columns()[name], f"column {name}")


def both(seed, dtype, live_bias=()):
    ref = make_table(seed, dtype, live_bias)
    return ref, _to(ref, DEVICE)


STAGES = ("apply_host_events", "apply_admits", "replay_frames", "compose_inputs", "sample_cb0", "mtp_sampler",
          "mtp_scatter", "publish_frames")


def test_same_stage_names_signatures_and_output_layout():
    import inspect

    for name in STAGES:
        assert str(inspect.signature(getattr(TK, name))) == str(inspect.signature(getattr(REF, name))), name
    for name in ("OUT_VALID", "OUT_FRAME_INDEX", "OUT_STATE", "OUT_REASON", "OUT_ERROR", "OUT_NUM_FRAMES", "OUT_CODES"):
        assert getattr(TK, name) == getattr(contract, name)


def test_no_kernel_names_a_trigger_or_a_state():
    """The lifecycle reaches the kernels as data: no trigger / state / finish-reason
    constants in the Triton sources."""
    import inspect
    import re

    from mtp_fsm.kernels import triton_common, triton_launch, triton_sampling

    for module in (triton_common, triton_launch, triton_sampling, TK, *TK.STAGE_MODULES):
        src = inspect.getsource(module)
        for pattern in (r"\b(Trigger|State|FinishReason)\b(?!-)", r"\b[STR]_[A-Z]"):
            assert not re.search(pattern, src), (module.__name__, pattern, re.search(pattern, src))


# -- one test per stage ----------------------------------------------------------------


@FAST
@given(st.integers(0, 2**31), DTYPES, st.sampled_from(list(LIFECYCLES)))
def test_apply_host_events(seed, dtype, life):
    ref, tri = both(seed, dtype)
    g = torch.Generator().manual_seed(seed + 1)
    n = int(_ints(g, 0, SLOTS + 1, 1))
    host = [int(t) for t in (Trigger.PREEMPT, Trigger.RESUME, Trigger.ABORT, Trigger.RELEASE, Trigger.ADMIT)]
    trig = torch.tensor(host + [-1, int(Trigger.SAMPLE)])[_ints(g, 0, 7, n, 2)]
    events = StagedEvents(torch.randperm(SLOTS, generator=g)[:n].to(DEVICE), trig.to(DEVICE),
                          _ints(g, 0, 6, n, dtype=torch.int32).to(DEVICE))
    lc = LIFECYCLES[life]
    REF.apply_host_events(ref, lc, events)
    TK.apply_host_events(tri, lc, events)
    assert_tables(ref, tri)


@FAST
@given(st.integers(0, 2**31), DTYPES, st.sampled_from(["all", "some", "cast"]), st.sampled_from(list(LIFECYCLES)))
def test_apply_admits(seed, dtype, which, life):
    ref, tri = both(seed, dtype)
    g = torch.Generator().manual_seed(seed + 2)
    a = int(_ints(g, 1, SLOTS + 1, 1))
    slots = torch.randperm(SLOTS, generator=g)[:a]
    values = {}
    for name, col in ref.columns().items():
        if which == "some" and float(torch.rand(1, generator=g)) < 0.5:
            continue
        shape = list(col.shape[1:])
        if name in ("prompt_embeds", "frame_log", "trail"):
            shape[0] = int(_ints(g, 1, shape[0] + 1, 1))  # a shorter leading dimension
        v = _rand(g, a, *shape, scale=5.0) if col.is_floating_point() else _ints(g, 0, 9, a, *shape)
        dt = col.dtype
        if which == "cast" and name in ("prompt_embeds", "serial", "cb0_top_p", "flag"):
            dt = {torch.int64: torch.int32, torch.bool: torch.int64}.get(dt, torch.float64)
        values[name] = v.to(dt).to(DEVICE)
    admits = StagedAdmits(slots.to(DEVICE), values, trigger=int(Trigger.ADMIT))
    lc = LIFECYCLES[life]
    REF.apply_admits(ref, lc, admits)
    TK.apply_admits(tri, lc, admits)
    assert_tables(ref, tri)


@FAST
@given(st.integers(0, 2**31), DTYPES, DTYPES)
def test_replay_frames(seed, dtype, model_dtype):
    ref, tri = both(seed, dtype)
    g = torch.Generator().manual_seed(seed + 3)
    n = int(_ints(g, 1, 9, 1))
    cells = torch.randperm(SLOTS * C, generator=g)[:n]
    replay = ReplayFrames(slots=(cells // C).to(DEVICE), frame_index=_ints(g, 0, 10, n).to(DEVICE),
                          positions=(cells % C).to(DEVICE), codes=_ints(g, 0, 64, n, Q).to(DEVICE))
    toy = Toy(model_dtype)
    REF.replay_frames(ref, replay, toy.frame_embed, toy.text_step)
    TK.replay_frames(tri, replay, toy.frame_embed, toy.text_step)
    assert_tables(ref, tri)


@MORE
@given(st.integers(0, 2**31), DTYPES, DTYPES, st.integers(1, 7), st.booleans(), st.sampled_from(list(LIFECYCLES)))
def test_compose_inputs(seed, dtype, model_dtype, rows, pad_tokens, life):
    ref, tri = both(seed, dtype, live_bias=(1, 2, 3))
    batch = make_batch(seed, ref, rows, pad_tokens)
    toy = Toy(model_dtype)
    lc = LIFECYCLES[life]
    out_ref = REF.compose_inputs(ref, lc, batch, toy.text_step)
    out_tri = TK.compose_inputs(tri, lc, batch, toy.text_step)
    assert_same(out_ref, out_tri, "compose outputs")
    assert_tables(ref, tri)


def _logits(g, rows, vocab, dtype):
    x = torch.randn(rows, vocab, generator=g) * float(torch.tensor([0.5, 2.0, 6.0])[_ints(g, 0, 3, 1)])
    if float(torch.rand(1, generator=g)) < 0.5:
        x = (x * 2).round() / 2  # ties
    hot = torch.rand(rows, generator=g) < 0.3
    if vocab > EOS:
        x[hot, EOS] = 20.0  # EOS sampled (greedy and mostly sampled rows)
    for r in range(rows):
        u = float(torch.rand(1, generator=g))
        if u < 0.08:
            x[r, int(_ints(g, 0, vocab, 1))] = float("nan")
        elif u < 0.12:
            x[r, int(_ints(g, 0, vocab, 1))] = float("inf")
        elif u < 0.3:  # -inf masks ids (not a fault)
            x[r, torch.rand(vocab, generator=g) < 0.5] = float("-inf")
        elif u < 0.34:  # nothing left to sample (a fault)
            x[r] = float("-inf")
    return x.to(dtype).to(DEVICE)


@FAST
@given(st.integers(0, 2**31), DTYPES, st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
       st.integers(1, 7), st.booleans(), st.booleans(), st.sampled_from(list(LIFECYCLES)),
       st.sampled_from(PENALTY_ORDERS))
def test_sample_cb0(seed, dtype, logit_dtype, rows, filters, use_allowed, life, order):
    ref, tri = both(seed, dtype, live_bias=(1, 2, 3, 6, 7))
    ref.cb0_penalty_order = tri.cb0_penalty_order = order  # where the model puts the CB0 penalty
    batch = make_batch(seed, ref, rows, filters=(filters, False))
    g = torch.Generator().manual_seed(seed + 4)
    logits = _logits(g, rows, V0, logit_dtype)
    allowed = None
    if use_allowed:
        allowed = (torch.rand(V0, generator=g) < 0.7)
        allowed[EOS] = True
        allowed = allowed.to(DEVICE)
    eos = EOS if float(torch.rand(1, generator=g)) < 0.8 else None
    lc = LIFECYCLES[life]
    tok_ref = REF.sample_cb0(ref, lc, batch, logits, eos_token_id=eos, allowed=allowed)
    tok_tri = TK.sample_cb0(tri, lc, batch, logits, eos_token_id=eos, allowed=allowed)
    assert_same(tok_ref, tok_tri, "cb0 tokens")
    assert_tables(ref, tri)


@FAST
@given(st.integers(0, 2**31), st.sampled_from([torch.float32, torch.bfloat16]), st.integers(1, 7),
       st.booleans(), st.sampled_from([5, 30, 200]))
def test_mtp_sampler(seed, logit_dtype, rows, filters, vocab):
    ref, tri = both(seed, torch.float32)
    batch = make_batch(seed, ref, rows, filters=(False, filters))
    g = torch.Generator().manual_seed(seed + 5)
    s_ref, fault_ref = REF.mtp_sampler(ref, batch)
    s_tri, fault_tri = TK.mtp_sampler(tri, batch)
    codebooks = list(range(1, Q + 1))
    codebooks = codebooks[::-1] if seed % 2 else codebooks  # the lowest bad codebook wins in any order
    for codebook in codebooks:
        logits = _logits(g, rows, vocab, logit_dtype)
        assert_same(s_ref(logits, codebook), s_tri(logits, codebook), f"codebook {codebook}")
    # A model-owned draw (MOSS's stop head): the same parameters for every row, any codebook index.
    own = SamplingParams(temperature=1.0, top_k=int(_ints(g, 0, 4, 1)), top_p=0.9 if seed % 3 else 1.0)
    logits = _logits(g, rows, 2 + seed % 7, logit_dtype)
    assert_same(s_ref(logits, Q + 1, own), s_tri(logits, Q + 1, own), "model-owned draw")
    assert_same(fault_ref(), fault_tri(), "mtp fault words")
    assert_tables(ref, tri)


def _fault_words(g, rows, p):
    """Per-row MTP fault words (kind | codebook << 4), a fraction p of them non-zero."""
    kinds = _ints(g, 1, 4, rows).to(torch.int32) | (_ints(g, 1, Q + 1, rows).to(torch.int32) << 4)
    return torch.where(torch.rand(rows, generator=g) < p, kinds, 0).to(torch.int32).to(DEVICE)


@FAST
@given(st.integers(0, 2**31), DTYPES, st.integers(1, 7), st.sampled_from(list(LIFECYCLES)))
def test_mtp_scatter(seed, dtype, rows, life):
    ref, tri = both(seed, dtype, live_bias=(4, 4, 5))
    batch = make_batch(seed, ref, rows)
    g = torch.Generator().manual_seed(seed + 6)
    faults = _fault_words(g, rows, 0.3)
    lc = LIFECYCLES[life]
    REF.mtp_scatter(ref, lc, batch, faults)
    TK.mtp_scatter(tri, lc, batch, faults)
    assert_tables(ref, tri)


@FAST
@given(st.integers(0, 2**31), DTYPES, DTYPES, st.integers(1, 7), st.sampled_from(list(LIFECYCLES)))
def test_publish_frames(seed, dtype, model_dtype, rows, life):
    ref, tri = both(seed, dtype, live_bias=(5, 5, 4))
    batch = make_batch(seed, ref, rows)
    g = torch.Generator().manual_seed(seed + 7)
    codes = _ints(g, 0, 30, rows, Q).to(DEVICE)
    embeds = _rand(g, rows, H, dtype=model_dtype, scale=3.0).to(DEVICE)
    lc = LIFECYCLES[life]
    out_ref = REF.publish_frames(ref, lc, batch, codes, embeds)
    out_tri = TK.publish_frames(tri, lc, batch, codes, embeds)
    assert_same(out_ref, out_tri, "packed output")
    assert_tables(ref, tri)


# -- the chain executor on random rule tables ----------------------------------------------


def random_lifecycle(seed: int) -> DeviceLifecycle:
    """Rules and chains no spec would declare (guards that overlap, several triggers firing
    in one stage, padding in the middle of a chain, total and partial stages, reasons and
    publishing edges anywhere): the generic executors must still agree bit for bit."""
    g = torch.Generator().manual_seed(seed)
    nt, ns = len(Trigger), len(State)
    dest = torch.where(torch.rand(nt, ns, generator=g) < 0.8, _ints(g, 0, ns, nt, ns), -1)
    bits = 1 << torch.arange(len(Predicate))
    must = ((torch.rand(nt, ns, len(Predicate), generator=g) < 0.15) * bits).sum(-1)  # sparse guards
    must_not = ((torch.rand(nt, ns, len(Predicate), generator=g) < 0.15) * bits).sum(-1) & ~must
    reason = torch.where(torch.rand(nt, ns, generator=g) < 0.4, _ints(g, 1, 6, nt, ns), 0)
    publishes = (torch.rand(nt, ns, generator=g) < 0.3).long()
    rules = torch.stack([dest, must, must_not, reason, publishes]).int().contiguous()
    state_class = _ints(g, 0, 16, ns, dtype=torch.int32)
    chains, host = {}, {}
    for phase in Phase:
        stages, width = int(_ints(g, 1, 4, 1)), int(_ints(g, 1, 5, 1))
        table = torch.full((stages, 1 + width), -1, dtype=torch.int32)
        chain = []
        for i in range(stages):
            total = bool(torch.rand(1, generator=g) < 0.5)
            trig = torch.where(torch.rand(width, generator=g) < 0.2, -1, torch.randperm(nt, generator=g)[:width])
            table[i, 0] = int(total)
            table[i, 1:] = trig
            chain.append((total, tuple(int(t) for t in trig if t >= 0)))
        chains[phase], host[phase] = table.to(DEVICE), tuple(chain)
    return DeviceLifecycle(rules.to(DEVICE), state_class.to(DEVICE), chains, host)


@MORE
@given(st.integers(0, 2**31), st.integers(1, 7), st.booleans())
def test_chain_executor_on_random_rules(seed, rows, eos_hot):
    """sample_cb0, mtp_scatter and publish_frames with random rules and chains."""
    lc = random_lifecycle(seed)
    ref, tri = both(seed, torch.float32, live_bias=(1, 2, 3, 4, 5))
    batch = make_batch(seed, ref, rows)
    g = torch.Generator().manual_seed(seed + 8)
    logits = _logits(g, rows, V0, torch.float32)
    if eos_hot:
        logits[:, EOS] = 50.0
    for table, k in ((ref, REF), (tri, TK)):
        k.sample_cb0(table, lc, batch, logits, eos_token_id=EOS, allowed=None)
    assert_tables(ref, tri)
    faults = _fault_words(g, rows, 0.4)
    REF.mtp_scatter(ref, lc, batch, faults)
    TK.mtp_scatter(tri, lc, batch, faults)
    assert_tables(ref, tri)
    codes = _ints(g, 0, 30, rows, Q).to(DEVICE)
    embeds = _rand(g, rows, H, scale=3.0).to(DEVICE)
    out_ref = REF.publish_frames(ref, lc, batch, codes, embeds)
    out_tri = TK.publish_frames(tri, lc, batch, codes, embeds)
    assert_same(out_ref, out_tri, "packed output")
    assert_tables(ref, tri)


# -- the sampling filter itself (the set of kept ids) --------------------------------------

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mtp_fsm.kernels.triton_sampling import filter_keep  # noqa: E402
from mtp_fsm.sampling import filter_mask  # noqa: E402
from mtp_fsm.sampling.topp import FX_LIMIT, FX_ONE, FX_STEP, fixed_tables, fixed_weights  # noqa: E402


@triton.jit
def _filter_kernel(scores_ptr, B, V, topk_ptr, topp_ptr, hi_ptr, lo_ptr, out_ptr,
                   BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = r < B
    offs = tl.arange(0, BLOCK_V)
    inb = rm[:, None] & (offs < V)[None, :]
    x = tl.load(scores_ptr + r[:, None] * V + offs[None, :], mask=inb, other=float("-inf"))
    keep = filter_keep(x, inb, V, tl.load(topk_ptr + r, mask=rm, other=0), tl.load(topp_ptr + r, mask=rm, other=1.0),
                       hi_ptr, lo_ptr)
    tl.store(out_ptr + r[:, None] * V + offs[None, :], keep.to(tl.int8), mask=inb)


def triton_filter(scores, top_k, top_p):
    b, v = scores.shape
    out = torch.empty(b, v, dtype=torch.int8, device=scores.device)
    hi, lo = fixed_tables(scores.device)
    tile = min(64, triton.next_power_of_2(b))
    _filter_kernel[(triton.cdiv(b, tile),)](scores, b, v, top_k, top_p, hi, lo, out,
                                           BLOCK_R=tile, BLOCK_V=triton.next_power_of_2(v))
    return out.bool()


def _scores(g, rows, vocab):
    x = torch.randn(rows, vocab, generator=g) * float(torch.tensor([0.3, 2.0, 8.0])[_ints(g, 0, 3, 1)])
    mode = int(_ints(g, 0, 4, 1))
    if mode == 1:
        x = (x * 2).round() / 2  # many ties
    elif mode == 2:
        x = x.round()  # ties and signed zeros
        x = torch.where(torch.rand(rows, vocab, generator=g) < 0.2, -x, x)
    x[torch.rand(rows, vocab, generator=g) < 0.15] = float("-inf")  # disallowed ids
    return x.contiguous()


@MORE
@given(st.integers(0, 2**31), st.sampled_from([3, 17, 64, 300]))
def test_filter_mask_matches_reference(seed, vocab):
    """top-k and the fixed-point top-p (sampling.filter_mask, the contract) on random draws:
    the kept sets must be equal."""
    g = torch.Generator().manual_seed(seed)
    rows = 48
    scores = _scores(g, rows, vocab).to(DEVICE)
    top_k = torch.where(torch.rand(rows, generator=g) < 0.3, 0, _ints(g, 1, vocab + 3, rows)).to(DEVICE)
    top_p = torch.where(torch.rand(rows, generator=g) < 0.3, 1.0, torch.rand(rows, generator=g) * 0.98 + 0.01)
    top_p[torch.rand(rows, generator=g) < 0.1] = 1e-8
    top_p[torch.rand(rows, generator=g) < 0.1] = 0.999
    scores[int(_ints(g, 0, rows, 1))] = float("-inf")  # nothing finite
    top_p = top_p.to(DEVICE)
    assert torch.equal(filter_mask(scores, top_k, top_p), triton_filter(scores, top_k, top_p))


@MORE
@given(st.integers(0, 2**31), st.sampled_from([3, 17, 64, 300]))
def test_fixed_point_top_p_is_exact_even_at_the_boundary(seed, vocab):
    """The fixed-point top-p rule: the same integers on both sides, so top_p placed
    exactly on (and one float32 ulp around) a mass boundary still gives equal sets."""
    g = torch.Generator().manual_seed(seed)
    rows = 48
    scores = (torch.randint(-40, 8, (rows, vocab), generator=g) / 8.0).float()  # d * 4096 lands on table points
    scores[torch.rand(rows, vocab, generator=g) < 0.1] = float("-inf")
    top_k = torch.where(torch.rand(rows, generator=g) < 0.5, 0, _ints(g, 1, vocab + 1, rows))
    # top_p exactly at the mass before some sorted position, and one ulp either side.
    ordered = torch.sort(scores, descending=True).values
    kth = ordered.gather(1, (torch.where(top_k > 0, top_k.clamp(max=vocab), vocab) - 1)[:, None])
    w = fixed_weights(torch.where(ordered >= kth, ordered, float("-inf")))
    before = (w.cumsum(1) - w).double() / w.sum(1, keepdim=True).double()
    at = before.gather(1, _ints(g, 0, vocab, rows)[:, None])[:, 0].float().nan_to_num(1.0).clamp(1e-6, 1.0)
    nudge = _ints(g, -1, 2, rows).float()
    top_p = torch.where(nudge == 0, at, torch.nextafter(at, at + nudge)).clamp(1e-6, 1.0)
    top_p[torch.rand(rows, generator=g) < 0.1] = 1e-8  # floor(top_p * 2**24) == 0: keep the top only
    scores[int(_ints(g, 0, rows, 1))] = float("-inf")  # nothing finite
    want = filter_mask(scores, top_k, top_p)
    got = triton_filter(scores.to(DEVICE), top_k.to(DEVICE), top_p.to(DEVICE))
    assert torch.equal(want.to(DEVICE), got)


def test_fixed_point_top_p_exact_boundary_is_exclusive_on_both_sides():
    """A row where the mass before the second score is exactly half (integer equality):
    top_p = 0.5 keeps the top only, one float32 ulp above keeps two, on both backends."""
    hi, lo = fixed_tables("cpu")
    q = torch.arange(FX_LIMIT + 1)
    w = ((hi[q >> 6] * lo[q & 63]) >> 24).tolist()
    at = {x: i for i, x in enumerate(w)}  # weights 2**24, w1, 2**24 - w1 at d = 0, q1 / 4096, q2 / 4096
    q1, q2 = next((i, at[FX_ONE - x]) for i, x in enumerate(w) if 0 < i < at.get(FX_ONE - x, 0) < FX_LIMIT)
    row = torch.tensor([[0.0, -q1 / FX_STEP, -q2 / FX_STEP]] * 3)
    half = torch.tensor(0.5)
    top_p = torch.stack([half, torch.nextafter(half, torch.tensor(1.0)), torch.nextafter(half, torch.tensor(0.0))])
    top_k = torch.zeros(3, dtype=torch.int64)
    want = torch.tensor([[True, False, False], [True, True, False], [True, False, False]])
    assert torch.equal(filter_mask(row, top_k, top_p), want)
    assert torch.equal(triton_filter(row.to(DEVICE), top_k.to(DEVICE), top_p.to(DEVICE)).cpu(), want)


# -- the whole engine --------------------------------------------------------------------


def _requests(n: int) -> list[NewRequest]:
    out = []
    for i in range(n):
        inputs = ScriptInputs(tuple(range(3 * i, 3 * i + 3 + i % 3)), eos_at=5 + i if i != 1 else None,
                              nan_at=3 if i == 4 else None, mtp_nan_at=2 if i == 5 else None)
        out.append(NewRequest(
            f"r{i}", inputs, max_frames=6 + i, seed=1000 + 17 * i,
            cb0_sampling=SamplingParams(0.0 if i % 3 == 0 else 0.9, 8 if i % 2 else 0, 0.9 if i % 3 == 2 else 1.0),
            mtp_sampling=SamplingParams(1.1, 0, 1.0) if i % 2 else SamplingParams(0.8, 5, 0.8),
        ))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_torch_and_triton_publish_identical_frames(dtype):
    """One schedule (chunked prefill, EOS, NaN aborts, preempt + resume, abort, overrun, length
    finish, padding rows) driven through both backends; every step's output and the whole
    slot table must be bit-equal."""
    engines = [LockstepEngine(scripted(DEVICE, 96, dtype), 3, device=DEVICE, kernels=k) for k in ("torch", "triton")]
    assert engines[1].kernels is TK
    pending, state = _requests(6), {}
    for step in range(60):
        plan, done = lockstep_plans(engines[0], pending, state)  # preempt at 6 / 13, abort at 9
        if done:
            break
        outs = [e.step(plan) for e in engines]
        assert outs[0].frames.request_ids == outs[1].frames.request_ids
        assert_same(outs[0].frames.codes, outs[1].frames.codes, f"step {step} frames")
        assert_same(outs[0].frames.frame_index, outs[1].frames.frame_index, f"step {step} frame index")
        assert outs[0].finished == outs[1].finished
        assert_tables(engines[0].table, engines[1].table)
    assert done and state["step"] > 15


def test_engine_qwen3_tts_tiny_torch_and_triton_identical():
    """The real model path (CB0 vocab 3072 with top-k/top-p, 15 MTP codebooks of 2048)."""
    qwen = pytest.importorskip("models.qwen3_tts")
    from mtp_fsm.testing.runs import run_to_completion

    def requests():
        return [NewRequest(f"q{i}", qwen.TTSInputs(text="hi" * (i + 1)), max_frames=3, seed=5 + i,
                           cb0_sampling=SamplingParams(0.9, 50, 0.9), mtp_sampling=SamplingParams(0.8, 0, 1.0))
                for i in range(2)]

    runs = [run_to_completion(LockstepEngine(qwen.Qwen3TTSTalker(qwen.tiny_config(), seed=0, dtype=torch.bfloat16,
                                                                 device=DEVICE), 2, device=DEVICE, kernels=k),
                              requests()) for k in ("torch", "triton")]
    assert runs[0] == runs[1] and sum(len(f) for f in runs[0][0].values()) > 0


_SELECTOR = """
import sys
{block}
from mtp_fsm.engine import LockstepEngine
from mtp_fsm.errors import KernelBackendError
from mtp_fsm.testing import ScriptedTalker
assert LockstepEngine(ScriptedTalker(), 2, kernels="auto").kernels.__name__.endswith("reference")
try:
    LockstepEngine(ScriptedTalker(), 2, kernels="triton")
except KernelBackendError as exc:
    print("ERROR:", exc)
"""


@pytest.mark.parametrize("block, expected", [
    ("sys.modules['triton'] = None", "Triton is unavailable"),  # triton not installed
    ("import os; os.environ.pop('TRITON_INTERPRET', None)", "TRITON_INTERPRET=1"),  # CPU, compiled mode
])
def test_backend_selector_explains_why_triton_cannot_run(block, expected):
    import os
    import subprocess
    import sys

    if torch.cuda.is_available() and "TRITON" in block:
        pytest.skip("a GPU is present: compiled Triton is usable")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _SELECTOR.format(block=block)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "ERROR:" in out.stdout and expected in out.stdout, out.stdout


def test_gpu_check_without_cuda_exits_cleanly(capsys):
    from mtp_fsm.gpu import gpu_check

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: run `python -m mtp_fsm.gpu.gpu_check` instead")
    assert gpu_check.main([]) == 0
    assert gpu_check.main(["--require-gpu"]) == 2
    assert "no CUDA device" in capsys.readouterr().out
