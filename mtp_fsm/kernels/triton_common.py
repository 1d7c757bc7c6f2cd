"""Shared @triton.jit helpers: lifecycle codes as constexprs, `fire`, exact dtype casts.

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

from ..lifecycle import FinishReason, State, Trigger
from ..slots import ERR_IDENTITY, ERR_ILLEGAL, ERR_SPAN

S_FREE = tl.constexpr(int(State.FREE))
S_WAITING = tl.constexpr(int(State.WAITING))
S_PREFILLING = tl.constexpr(int(State.PREFILLING))
S_DECODING = tl.constexpr(int(State.DECODING))
S_SAMPLED = tl.constexpr(int(State.SAMPLED))
S_FRAME_READY = tl.constexpr(int(State.FRAME_READY))
S_FINISHED = tl.constexpr(int(State.FINISHED))
S_ABORTED = tl.constexpr(int(State.ABORTED))

T_ADMIT = tl.constexpr(int(Trigger.ADMIT))
T_PREFILL = tl.constexpr(int(Trigger.PREFILL))
T_SAMPLE = tl.constexpr(int(Trigger.SAMPLE))
T_EOS = tl.constexpr(int(Trigger.EOS))
T_MTP = tl.constexpr(int(Trigger.MTP))
T_PUBLISH = tl.constexpr(int(Trigger.PUBLISH))
T_FINISH_LENGTH = tl.constexpr(int(Trigger.FINISH_LENGTH))
T_OVERRUN = tl.constexpr(int(Trigger.OVERRUN))
T_ABORT = tl.constexpr(int(Trigger.ABORT))

R_EOS = tl.constexpr(int(FinishReason.EOS))
R_LENGTH = tl.constexpr(int(FinishReason.LENGTH))
R_ERROR = tl.constexpr(int(FinishReason.ERROR))

E_IDENTITY = tl.constexpr(ERR_IDENTITY)
E_ILLEGAL = tl.constexpr(ERR_ILLEGAL)
E_SPAN = tl.constexpr(ERR_SPAN)


@triton.jit
def fire(trans_ptr, NS: tl.constexpr, TRIGGER: tl.constexpr, state, mask):
    """Apply TRIGGER where `mask`: (new state, illegal). Illegal rows keep their state.

    The destination comes from the compiled transition table [trigger, state], never
    from a hand-written next state."""
    dest = tl.load(trans_ptr + TRIGGER * NS + state, mask=mask, other=-1)
    illegal = mask & (dest < 0)
    return tl.where(mask & (dest >= 0), dest, state), illegal


@triton.jit
def is_live(state):
    return (state == S_WAITING) | (state == S_PREFILLING) | (state == S_DECODING)


@triton.jit
def is_terminal(state):
    return (state == S_FINISHED) | (state == S_ABORTED)


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
