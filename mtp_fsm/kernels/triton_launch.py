"""Host-side launch helpers shared by the Triton stages: interpreter detection, tiles, blocks, constexprs."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..lifecycle import DeviceLifecycle, Phase
from ..sampling.noise import gumbel_table
from ..sampling.topp import fixed_tables
from .triton_common import fire_host
from .triton_sampling import MAX_VOCAB

ROW_BLOCK = 128


def _built_for_interpreter() -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - a Triton without the interpreter
        return False
    return isinstance(fire_host, InterpretedFunction)


_INTERPRETED = _built_for_interpreter()


def interpreted() -> bool:
    """Whether these kernels were built for the CPU interpreter (TRITON_INTERPRET=1)."""
    return _INTERPRETED


def unsupported(device: torch.device) -> str | None:
    """Why this backend cannot run on `device` (None when it can)."""
    device = torch.device(device)
    if interpreted():
        return None if device.type == "cpu" else f"Triton interpreter mode runs on CPU tensors, not {device}"
    if device.type != "cuda":
        return (f"Triton kernels need a GPU; for {device} set TRITON_INTERPRET=1 before triton is first "
                "imported (interpreter mode), or use kernels='torch'")
    return None


def contiguous_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` with unit stride along its last axis (the kernels index a row's elements densely)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def as_u8(t: torch.Tensor) -> torch.Tensor:
    """A bool mask as uint8 (Triton loads bytes, not torch's bool)."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
TRITON_RAW = {1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64}  # a column's raw element, by width


@functools.lru_cache(maxsize=None)
def raw_bits(value: float, dtype: torch.dtype) -> int:
    """`value` stored as `dtype`, read back as the same-width integer (a column's default)."""
    return int(torch.tensor(value, dtype=dtype).view(_RAW[dtype.itemsize]).item())


def warps_for(block: int) -> int:
    """Warps for a program that reduces over `block` elements."""
    return 8 if block >= 2048 else 4


def block_for(n: int, cap: int = 1024) -> int:
    """The power-of-two block covering n elements, at most `cap`."""
    return min(cap, triton.next_power_of_2(max(n, 1)))


def rule_strides(lc: DeviceLifecycle) -> dict:
    """The rules tensor's strides as constexprs: NS (states per trigger row) and PLANE
    (elements per rule plane); the kernels index it flat."""
    if not lc.rules.is_contiguous():
        raise ValueError("the lifecycle rules tensor must be contiguous")
    _, triggers, states = lc.rules.shape
    return {"NS": int(states), "PLANE": int(triggers * states)}


def phase_chain(lc: DeviceLifecycle, phase: Phase) -> tuple[torch.Tensor, dict]:
    """One phase's chain tensor [stages, 1 + longest] and its shape as constexprs. A phase
    without stages passes the rules tensor as a placeholder pointer (never read)."""
    chain = lc.chains[phase]
    stages, width = int(chain.shape[0]), int(chain.shape[1])
    if stages == 0:
        return lc.rules, {"STAGES": 0, "WIDTH": 1}
    if not chain.is_contiguous():
        chain = chain.contiguous()
    return chain, {"STAGES": stages, "WIDTH": width}


def row_tile(n: int, gpu: int) -> int:
    """Rows per program: `gpu` on a GPU; on the interpreter, as many as possible (one
    program per launch amortises its large per-program overhead)."""
    return min(64, triton.next_power_of_2(max(n, 1))) if interpreted() else gpu


def draw_inputs(logits: torch.Tensor):
    """What a sampling launch takes beside the logits (dense rows): the vocabulary block, the
    noise and fixed-point top-p tables, and the rows per program (one on a GPU)."""
    noise, (hi, lo) = gumbel_table(logits.device), fixed_tables(logits.device)
    return contiguous_rows(logits), vocab_block(logits.shape[1]), noise, hi, lo, row_tile(logits.shape[0], 1)


def vocab_block(vocab: int) -> int:
    """The sampler's one block over a whole vocabulary (loud past MAX_VOCAB)."""
    if vocab > MAX_VOCAB:
        raise ValueError(f"the Triton sampler handles a vocabulary of up to {MAX_VOCAB} ids in one block, got {vocab}")
    return triton.next_power_of_2(vocab)
