"""Triton publish stage, kernel beside launcher: the publish phase, frame cache and packed output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..lifecycle import DeviceLifecycle, Phase
from ..slots import SlotTable
from .contract import OUT_CODES, StepBatch
from .triton_common import (
    B_DRAFT_ACCEPTED, B_EOC_FRAME, B_EOS_FRAME, B_LENGTH_REACHED, B_RAMP_DONE, B_WIND_DONE, C_IN_STEP, E_ILLEGAL,
    O_CODES, O_ERROR, O_FRAME_INDEX, O_NUM_COMPUTED, O_NUM_FRAMES, O_REASON, O_STATE, O_VALID, cast_to, in_class,
    predicate_bit, row_owner, run_stage,
)
from .triton_launch import as_u8, block_for, contiguous_rows, phase_chain, row_tile, rule_strides


@triton.jit(do_not_specialize=['B'])
def publish_kernel(idx_ptr, pad_ptr, exp_ptr, B, state_ptr, serial_ptr, frames_ptr, maxf_ptr, computed_ptr,
                   reason_ptr, error_ptr, rules_ptr, class_ptr, chain_ptr, codes_ptr, codes_s0, codes_s1, fe_ptr,
                   fe_stride, fcodes_ptr, flog_ptr, fembed_ptr, out_ptr, out_stride, C, H, Q, counts_ptr, counts_stride, V0,
                   EOC, EOS, accepted_ptr, NS: tl.constexpr, PLANE: tl.constexpr, STAGES: tl.constexpr,
                   WIDTH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr,
                   DELAY: tl.constexpr, EOS_FRAME: tl.constexpr, ACCEPTED: tl.constexpr, LAST: tl.constexpr):
    """A tile of rows: the publish-phase stage chain (LENGTH_REACHED per stage, counting the
    frame a previous stage published; with DELAY, the delay-pattern facts of the frame, EOC
    its id), then frame cache / log / embedding and counters for rows whose fired rule
    publishes, and the packed output rows."""
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = row < B
    slot, pad, state, owned = row_owner(row, rm, idx_ptr, pad_ptr, exp_ptr, state_ptr, serial_ptr)
    frame_index = tl.load(frames_ptr + slot, mask=rm, other=0)
    max_frames = tl.load(maxf_ptr + slot, mask=rm, other=0)
    # The next input would sit at position num_computed: no room when it no longer fits.
    full = tl.load(computed_ptr + slot, mask=rm, other=0) >= C
    why = tl.zeros_like(state)
    ready = tl.zeros_like(owned)
    stuck = tl.zeros_like(owned)
    q = tl.arange(0, BLOCK_Q)
    qm = rm[:, None] & (q < Q)[None, :]
    row64 = row.to(tl.int64)
    codes = tl.load(codes_ptr + (row64 * codes_s0)[:, None] + (q * codes_s1)[None, :], mask=qm, other=0)
    cb0 = tl.load(codes_ptr + row64 * codes_s0, mask=rm, other=0)
    frame_word = tl.zeros_like(state)
    if DELAY:  # reference.delay_facts: the frame's facts (after the last published one), the same for every stage
        previous0 = tl.load(fcodes_ptr + slot * Q, mask=rm, other=0)
        winding = ((previous0 == EOC) & (frame_index > 0)) | (Q == 1)
        lead = tl.sum(((codes == EOC) & qm & (q < Q - 1)[None, :]).to(tl.int32), axis=1) == Q - 1
        wind_done = (cb0 == EOC) & winding & lead
        frame_word = (predicate_bit(frame_index >= Q - 2, B_RAMP_DONE) | predicate_bit(cb0 == EOC, B_EOC_FRAME)
                      | predicate_bit(wind_done, B_WIND_DONE))
    if EOS_FRAME:  # the stop head's: the frame's CB0 is the EOS id
        frame_word = frame_word | predicate_bit(cb0 == EOS, B_EOS_FRAME)
    if ACCEPTED:  # speculative: the verify position's draft matched (computed by the caller)
        frame_word = frame_word | predicate_bit(tl.load(accepted_ptr + row, mask=rm, other=0) != 0, B_DRAFT_ACCEPTED)
    for s in tl.static_range(STAGES):
        length = ((frame_index + ready.to(tl.int64)) >= max_frames) | full
        word = predicate_bit(length, B_LENGTH_REACHED) | frame_word
        state, why, ready, stuck = run_stage(rules_ptr, chain_ptr, s, state, word,
                                             owned, why, ready, stuck, NS, PLANE, WIDTH)
    if LAST:  # whatever the stages did, no row may rest in a state that exists only inside a step
        stuck = stuck | (owned & in_class(class_ptr, state, C_IN_STEP, rm))
    num_frames = frame_index + ready.to(tl.int64)
    reason = tl.load(reason_ptr + slot, mask=rm, other=0)
    reason = tl.where(why != 0, why, reason)
    err = tl.load(error_ptr + slot, mask=rm, other=0)
    err = tl.where(stuck, err | E_ILLEGAL, err)
    rq = qm & ready[:, None]
    tl.store(fcodes_ptr + (slot * Q)[:, None] + q[None, :], codes, mask=rq)
    log_at = (slot * C + tl.minimum(frame_index, C - 1)) * Q
    tl.store(flog_ptr + log_at[:, None] + q[None, :], codes, mask=rq)
    # The repetition penalty's memory: one more occurrence of the published CB0 id (a slot
    # owns at most one row of a step, so the read-modify-write does not race).
    count_at = counts_ptr + slot.to(tl.int64) * counts_stride + tl.minimum(tl.maximum(cb0, 0), V0 - 1)
    tl.store(count_at, tl.load(count_at, mask=rm & ready, other=0) + 1, mask=rm & ready)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        rh = (rm & ready)[:, None] & (h < H)[None, :]
        fe = tl.load(fe_ptr + (row64 * fe_stride)[:, None] + h[None, :], mask=rh)
        tl.store(fembed_ptr + (slot * H)[:, None] + h[None, :], cast_to(fe, fembed_ptr.dtype.element_ty), mask=rh)
    w = rm & ~pad
    tl.store(frames_ptr + slot, num_frames, mask=w)
    tl.store(state_ptr + slot, state, mask=w)
    tl.store(reason_ptr + slot, reason, mask=w)
    tl.store(error_ptr + slot, err, mask=w)
    out = out_ptr + row64 * out_stride
    tl.store(out + O_VALID, ready.to(tl.int64), mask=rm)
    tl.store(out + O_FRAME_INDEX, frame_index, mask=rm)
    tl.store(out + O_STATE, state.to(tl.int64), mask=rm)
    tl.store(out + O_REASON, reason.to(tl.int64), mask=rm)
    tl.store(out + O_ERROR, err.to(tl.int64), mask=rm)
    tl.store(out + O_NUM_FRAMES, num_frames, mask=rm)
    tl.store(out + O_NUM_COMPUTED, tl.load(computed_ptr + slot, mask=rm, other=0), mask=rm)
    tl.store(out[:, None] + O_CODES + q[None, :], tl.where(ready[:, None], codes, 0), mask=qm)


def publish_frames(
    table: SlotTable, lc: DeviceLifecycle, batch: StepBatch, codes: torch.Tensor, frame_embeds: torch.Tensor,
    eoc: int | None = None, eos: int | None = None, accepted: torch.Tensor | None = None, last: bool = True,
) -> torch.Tensor:
    """The publish-phase stage chain; frame cache, counters and the packed output
    [B, OUT_CODES + Q] for rows whose fired rule publishes. eoc: the delay pattern's EOC id;
    eos: the EOS id whose frames are the last; accepted: a verify position's DRAFT_ACCEPTED;
    last: flag rows resting in-step (reference.publish_frames)."""
    rows, q, h = batch.num_rows, table.num_codebooks, table.hidden_size
    packed = torch.empty(rows, OUT_CODES + q, dtype=torch.int64, device=table.device)
    if rows == 0:
        return packed
    if codes.dtype != torch.int64:
        codes = codes.long()
    frame_embeds = contiguous_rows(frame_embeds)
    block = block_for(h)
    tile = row_tile(rows, max(1, 1024 // block))
    chain, shape = phase_chain(lc, Phase.PUBLISH)
    publish_kernel[(triton.cdiv(rows, tile),)](
        batch.idx_mapping, as_u8(batch.is_padding), batch.expected_serial, rows, table.state, table.serial,
        table.num_frames, table.max_frames, table.num_computed, table.finish_reason, table.error, lc.rules,
        lc.state_class, chain, codes, codes.stride(0), codes.stride(1), frame_embeds, frame_embeds.stride(0),
        table.frame_codes, table.frame_log, table.frame_embed, packed, packed.stride(0),
        table.max_context, h, q, table.cb0_counts, table.cb0_counts.stride(0), table.cb0_counts.shape[1],
        -1 if eoc is None else eoc, -1 if eos is None else eos, packed if accepted is None else as_u8(accepted),
        **rule_strides(lc), **shape, BLOCK_R=tile, BLOCK_Q=triton.next_power_of_2(q), BLOCK_H=block, DELAY=eoc is not None,
        EOS_FRAME=eos is not None, ACCEPTED=accepted is not None, LAST=last,
    )
    return packed
