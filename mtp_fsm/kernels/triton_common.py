"""Shared @triton.jit helpers: the generic lifecycle chain executor, exact dtype casts.

The lifecycle reaches the kernels only as data (`DeviceLifecycle`): the rules tensor
[plane, trigger, state], the state-class words and the stage chains. The constants here
are the *layout* of that data (rule planes, class bits, predicate bits, error bits, the
packed output columns); no kernel names a trigger, a state or a finish reason.

Every helper is written so the GPU and the CPU interpreter (TRITON_INTERPRET=1) produce
the same bits as the torch reference:

- float32 -> bfloat16 rounds to nearest-even with integer ops (the interpreter's own cast
  truncates), NaN -> 0x7FC0 like c10::BFloat16;
- float64 -> bfloat16 / float16 goes through float32, as torch does (double rounding);
- bfloat16 / float16 arithmetic is done in float32 and rounded once, as torch's CPU
  kernels do.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..lifecycle import CLASS_IN_STEP, CLASS_LIVE, CLASS_VACANT, Predicate
from ..lifecycle.compiled import RULE_DEST, RULE_MUST, RULE_MUST_NOT, RULE_PUBLISHES, RULE_REASON
from ..slots import ERR_IDENTITY, ERR_ILLEGAL, ERR_SPAN
from . import contract

# Planes of the rules tensor [plane, trigger, state].
P_DEST = tl.constexpr(RULE_DEST)
P_MUST = tl.constexpr(RULE_MUST)
P_MUST_NOT = tl.constexpr(RULE_MUST_NOT)
P_REASON = tl.constexpr(RULE_REASON)
P_PUBLISHES = tl.constexpr(RULE_PUBLISHES)

# State-class bits (lc.state_class[state]).
C_LIVE = tl.constexpr(CLASS_LIVE)
C_IN_STEP = tl.constexpr(CLASS_IN_STEP)
C_VACANT = tl.constexpr(CLASS_VACANT)

# Bit positions of the per-row predicate word.
B_PROMPT_DONE = tl.constexpr(int(Predicate.PROMPT_DONE))
B_CB0_FAULT = tl.constexpr(int(Predicate.CB0_FAULT))
B_EOS_SAMPLED = tl.constexpr(int(Predicate.EOS_SAMPLED))
B_MTP_FAULT = tl.constexpr(int(Predicate.MTP_FAULT))
B_LENGTH_REACHED = tl.constexpr(int(Predicate.LENGTH_REACHED))
B_MTP_STOP = tl.constexpr(int(Predicate.MTP_STOP))
B_RAMP_DONE = tl.constexpr(int(Predicate.RAMP_DONE))
B_EOC_FRAME = tl.constexpr(int(Predicate.EOC_FRAME))
B_WIND_DONE = tl.constexpr(int(Predicate.WIND_DONE))
B_EOS_FRAME = tl.constexpr(int(Predicate.EOS_FRAME))
B_DRAFT_ACCEPTED = tl.constexpr(int(Predicate.DRAFT_ACCEPTED))

E_IDENTITY = tl.constexpr(ERR_IDENTITY)
E_ILLEGAL = tl.constexpr(ERR_ILLEGAL)
E_SPAN = tl.constexpr(ERR_SPAN)

# Columns of the packed per-row output.
O_VALID = tl.constexpr(contract.OUT_VALID)
O_FRAME_INDEX = tl.constexpr(contract.OUT_FRAME_INDEX)
O_STATE = tl.constexpr(contract.OUT_STATE)
O_REASON = tl.constexpr(contract.OUT_REASON)
O_ERROR = tl.constexpr(contract.OUT_ERROR)
O_NUM_FRAMES = tl.constexpr(contract.OUT_NUM_FRAMES)
O_NUM_COMPUTED = tl.constexpr(contract.OUT_NUM_COMPUTED)
O_CODES = tl.constexpr(contract.OUT_CODES)


@triton.jit
def in_class(class_ptr, state, CLASS: tl.constexpr, mask):
    """Whether `state` is in the state class with bit CLASS (False where ~mask)."""
    return (tl.load(class_ptr + state, mask=mask, other=0) & CLASS) != 0


@triton.jit
def fire_host(rules_ptr, NS: tl.constexpr, PLANE: tl.constexpr, trigger, state, mask):
    """A host trigger (no guard) where `mask`: (new state, illegal); illegal rows keep
    their state. `trigger` is data (e.g. the admission trigger the host read from the
    spec), the destination is the RULE_DEST plane of the compiled rules."""
    dest = tl.load(rules_ptr + P_DEST * PLANE + tl.maximum(trigger, 0) * NS + state, mask=mask, other=-1)
    illegal = mask & (dest < 0)
    return tl.where(mask & (dest >= 0), dest, state), illegal


@triton.jit
def predicate_bit(mask, BIT: tl.constexpr):
    """One predicate's contribution to the word (the bit of its Predicate value, as in a compiled guard mask)."""
    return mask.to(tl.int32) << BIT


@triton.jit
def run_stage(rules_ptr, chain_ptr, STAGE: tl.constexpr, state, word, owned, reason, published, stuck,
              NS: tl.constexpr, PLANE: tl.constexpr, WIDTH: tl.constexpr):
    """One stage of a compiled chain over a tile of rows (row_ops.run_phase evaluates the same chains folded per phase).

    chain row STAGE = [total, trigger ids (-1 padding)]; for each trigger the rule is
    gathered at the row's state at stage start and fires where the row is owned, the
    destination is declared and the guard masks hold on `word`. Returns (state, reason,
    published, stuck) after the stage."""
    at_row = chain_ptr + STAGE * WIDTH
    # Chain entries are uniform over the tile; they are widened to the tile's shape as
    # integers before any comparison (the interpreter splats scalar booleans as uint8).
    lanes = tl.zeros_like(state)
    total = lanes + tl.load(at_row)
    new = state
    fired = tl.zeros_like(owned)
    for k in tl.static_range(1, WIDTH):
        trigger = lanes + tl.load(at_row + k)
        has = owned & (trigger >= 0)
        rule = rules_ptr + tl.maximum(trigger, 0) * NS + state
        dest = tl.load(rule + P_DEST * PLANE, mask=has, other=-1)
        must = tl.load(rule + P_MUST * PLANE, mask=has, other=0)
        must_not = tl.load(rule + P_MUST_NOT * PLANE, mask=has, other=0)
        why = tl.load(rule + P_REASON * PLANE, mask=has, other=0)
        emits = tl.load(rule + P_PUBLISHES * PLANE, mask=has, other=0)
        ok = has & (dest >= 0) & ((word & must) == must) & ((word & must_not) == 0)
        new = tl.where(ok, dest, new)
        reason = tl.where(ok & (why != 0), why, reason)
        published = published | (ok & (emits != 0))
        fired = fired | ok
    stuck = stuck | (owned & ~fired & (total != 0))
    return new, reason, published, stuck


@triton.jit
def run_chain(rules_ptr, chain_ptr, state, word, owned, NS: tl.constexpr, PLANE: tl.constexpr,
              STAGES: tl.constexpr, WIDTH: tl.constexpr):
    """Every stage of a phase whose predicates are known up front (one word for all
    stages): (state, reason recorded (0 = none), published, stuck)."""
    reason = tl.zeros_like(state)
    published = tl.zeros_like(owned)
    stuck = tl.zeros_like(owned)
    for s in tl.static_range(STAGES):
        state, reason, published, stuck = run_stage(rules_ptr, chain_ptr, s, state, word, owned, reason, published,
                                                    stuck, NS, PLANE, WIDTH)
    return state, reason, published, stuck


@triton.jit
def f32_to_bf16(x):
    """Round-to-nearest-even float32 -> bfloat16 with integer ops (c10::BFloat16 rule)."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where(x != x, 0x7FC0, r)
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def cast_to(x, DST: tl.constexpr):
    """`x.to(DST)` with torch's rounding on every backend."""
    if DST == tl.bfloat16:
        if x.dtype == tl.bfloat16:
            y = x
        else:
            y = f32_to_bf16(x.to(tl.float32))
    elif DST == tl.float16:
        if x.dtype == tl.float16:
            y = x
        else:
            y = x.to(tl.float32).to(tl.float16)
    else:
        y = x.to(DST)
    return y


@triton.jit
def add_in(a, b, DT: tl.constexpr):
    """`a + b` for two tensors of dtype DT, rounded like torch (half types via float32)."""
    if DT == tl.float64:
        s = a.to(tl.float64) + b.to(tl.float64)
    else:
        s = a.to(tl.float32) + b.to(tl.float32)
    return cast_to(s, DT)


@triton.jit
def row_owner(row, rmask, idx_ptr, pad_ptr, exp_ptr, state_ptr, serial_ptr):
    """A tile of batch rows: each one's slot, padding flag, state, and whether the slot still
    belongs to the request the host scheduled (the identity guard; padding never owns)."""
    slot = tl.load(idx_ptr + row, mask=rmask, other=0)
    pad = tl.load(pad_ptr + row, mask=rmask, other=1) != 0
    state = tl.load(state_ptr + slot, mask=rmask, other=0)
    owned = (~pad) & (tl.load(serial_ptr + slot, mask=rmask, other=0) == tl.load(exp_ptr + row, mask=rmask, other=0))
    return slot, pad, state, owned


@triton.jit
def row_phase(row, rmask, idx_ptr, pad_ptr, exp_ptr, nsched_ptr, state_ptr, serial_ptr, computed_ptr, plen_ptr,
              class_ptr, decode_width):
    """row_owner, plus whether the row is live, in prefill, its span bad, its computed tokens."""
    slot, pad, state, owned = row_owner(row, rmask, idx_ptr, pad_ptr, exp_ptr, state_ptr, serial_ptr)
    live = owned & in_class(class_ptr, state, C_LIVE, rmask)
    computed = tl.load(computed_ptr + slot, mask=rmask, other=0)
    plen = tl.load(plen_ptr + slot, mask=rmask, other=0)
    n = tl.load(nsched_ptr + row, mask=rmask, other=0)
    prefill = computed < plen
    # Phase comes from num_computed < prompt_len, never from the span length.
    bad_span = live & tl.where(prefill, computed + n > plen, n != decode_width)
    return slot, pad, owned, live, prefill, bad_span, computed
