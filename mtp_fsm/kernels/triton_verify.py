"""Triton verify positions as rows (speculative decoding): one sampling launch over every decode row's k + 1 positions, one launch walking each row through them.

The same contract as `verify` (the torch reference), by another route: the torch stages look
every position up for every state at once and chain the gathers; the kernel here walks a
row's positions in order, with the row's running counters, through the generic chain
executor (`triton_common.run_stage`). Tested bit-exact against the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..lifecycle import DeviceLifecycle, Phase
from ..sampling.penalties import PENALTY_AFTER_FILTERS
from ..slots import SlotTable
from .contract import OUT_CODES, StepBatch
from .triton_common import (
    B_CB0_FAULT, B_DRAFT_ACCEPTED, B_EOS_SAMPLED, B_LENGTH_REACHED, B_PROMPT_DONE, C_LIVE, E_ILLEGAL, O_CODES,
    O_ERROR, O_FRAME_INDEX, O_NUM_COMPUTED, O_NUM_FRAMES, O_REASON, O_STATE, O_VALID, cast_to, in_class,
    predicate_bit, row_owner, run_chain, run_stage,
)
from .triton_launch import (
    as_u8, block_for, contiguous_rows, draw_inputs, phase_chain, row_tile, rule_strides, warps_for,
)
from .triton_sampling import sample_cb0_rows
from .verify import position_counts


@triton.jit(do_not_specialize=['N', 'P'])
def sample_positions_kernel(idx_ptr, N, P, frames_ptr, seed_ptr, temp_ptr, topk_ptr, topp_ptr, pen_ptr, minf_ptr,
                            counts_ptr, counts_stride, logits_ptr, logits_stride, V, allowed_ptr, gumbel_ptr, fx_hi_ptr,
                            fx_lo_ptr, eos_id, tokens_ptr, faults_ptr,
                            HAS_ALLOWED: tl.constexpr, APPLY_FILTERS: tl.constexpr, HAS_PENALTY: tl.constexpr,
                            HAS_SUPPRESS: tl.constexpr, PENALTY_AFTER: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_V: tl.constexpr):
    """A tile of position rows r = b * P + j: frame num_frames + j of row b's request, its
    penalty counts the per-position ones (`verify.position_counts`, row r)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = r < N
    slot = tl.load(idx_ptr + r // P, mask=rm, other=0)
    frames = tl.load(frames_ptr + slot, mask=rm, other=0) + (r % P)
    token, fault = sample_cb0_rows(
        logits_ptr, logits_stride, r, rm, V, slot, frames, seed_ptr, temp_ptr, topk_ptr, topp_ptr, pen_ptr, minf_ptr,
        allowed_ptr, gumbel_ptr, fx_hi_ptr, fx_lo_ptr, counts_ptr, counts_stride, r, eos_id,
        HAS_ALLOWED, APPLY_FILTERS, HAS_PENALTY, HAS_SUPPRESS, BLOCK_V, PENALTY_AFTER)
    tl.store(tokens_ptr + r, token, mask=rm)
    tl.store(faults_ptr + r, fault, mask=rm)


@triton.jit(do_not_specialize=['B'])
def verify_frames_kernel(idx_ptr, pad_ptr, exp_ptr, nsched_ptr, verify_ptr, B, state_ptr, serial_ptr, computed_ptr,
                         plen_ptr, frames_ptr, maxf_ptr, reason_ptr, error_ptr, fault_ptr, fcodes_ptr, flog_ptr,
                         fembed_ptr, counts_ptr, counts_stride, V0, rules_ptr, class_ptr, schain_ptr, pchain_ptr,
                         tokens_ptr, faults_ptr, drafts_ptr, drafts_stride, fe_ptr, fe_stride, out_ptr, out_stride, C, H,
                         eos_id, NS: tl.constexpr, PLANE: tl.constexpr, SAMPLE_STAGES: tl.constexpr, SAMPLE_WIDTH: tl.constexpr,
                         PUBLISH_STAGES: tl.constexpr, PUBLISH_WIDTH: tl.constexpr, P: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_H: tl.constexpr):
    """A tile of rows, each walked through its P positions: the sample-phase chain (num_computed
    advanced while live, prompt done, a bad sample, EOS), the publish-phase stages one by one
    (DRAFT_ACCEPTED: a verify row's token equals its draft there; LENGTH_REACHED counting the
    frames published so far), the frame of a publishing position logged and counted; a row
    goes on while its position published and left it live. Then the row's columns, its
    newest frame's codes and embedding, and the packed rows of its positions."""
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = row < B
    slot, pad, state, owned = row_owner(row, rm, idx_ptr, pad_ptr, exp_ptr, state_ptr, serial_ptr)
    verify = tl.load(verify_ptr + row, mask=rm, other=0) != 0
    first_width = tl.where(verify, 1, tl.load(nsched_ptr + row, mask=rm, other=0))
    computed = tl.load(computed_ptr + slot, mask=rm, other=0)
    plen = tl.load(plen_ptr + slot, mask=rm, other=0)
    first = tl.load(frames_ptr + slot, mask=rm, other=0)
    frames = first
    max_frames = tl.load(maxf_ptr + slot, mask=rm, other=0)
    reason = tl.load(reason_ptr + slot, mask=rm, other=0)
    err = tl.load(error_ptr + slot, mask=rm, other=0)
    fault = tl.load(fault_ptr + slot, mask=rm, other=0)
    going = rm
    newest = tl.zeros_like(first) - 1  # position of the row's newest published frame (-1: none)
    newest_token = tl.zeros_like(first)
    row64 = row.to(tl.int64)
    for j in tl.static_range(P):
        enter = owned & going
        token = tl.load(tokens_ptr + row64 * P + j, mask=rm, other=0)
        bad = tl.load(faults_ptr + row64 * P + j, mask=rm, other=0)
        live = enter & in_class(class_ptr, state, C_LIVE, rm)
        if j == 0:
            computed = computed + tl.where(live, first_width, 0)
        else:
            computed = computed + tl.where(live, 1, 0)
        word = (predicate_bit(computed >= plen, B_PROMPT_DONE) | predicate_bit(bad != 0, B_CB0_FAULT)
                | predicate_bit((token == eos_id) & (eos_id >= 0), B_EOS_SAMPLED))
        state, why, _, stuck = run_chain(rules_ptr, schain_ptr, state, word, enter, NS, PLANE, SAMPLE_STAGES, SAMPLE_WIDTH)
        reason = tl.where(why != 0, why, reason)
        fault = tl.where(enter & (why != 0) & (fault == 0), bad, fault)  # row_ops.record's fault rule
        accepted = tl.zeros_like(verify)
        if j < P - 1:
            accepted = verify & (token == tl.load(drafts_ptr + row64 * drafts_stride + j, mask=rm, other=-1))
        frame_word = predicate_bit(accepted, B_DRAFT_ACCEPTED)
        full = computed >= C
        why = tl.zeros_like(state)
        ready = tl.zeros_like(owned)
        for s in tl.static_range(PUBLISH_STAGES):
            length = ((frames + ready.to(tl.int64)) >= max_frames) | full
            state, why, ready, stuck = run_stage(rules_ptr, pchain_ptr, s, state,
                                                 predicate_bit(length, B_LENGTH_REACHED) | frame_word,
                                                 enter, why, ready, stuck, NS, PLANE, PUBLISH_WIDTH)
        reason = tl.where(why != 0, why, reason)
        err = tl.where(stuck, err | E_ILLEGAL, err)
        log_at = (slot * C + tl.minimum(frames, C - 1)).to(tl.int64)
        tl.store(flog_ptr + log_at, token, mask=rm & ready)
        # The repetition penalty's memory (a slot owns one row of a step: no race).
        count_at = counts_ptr + slot.to(tl.int64) * counts_stride + tl.minimum(tl.maximum(token, 0), V0 - 1)
        tl.store(count_at, tl.load(count_at, mask=rm & ready, other=0) + 1, mask=rm & ready)
        out = out_ptr + (row64 * P + j) * out_stride
        tl.store(out + O_VALID, ready.to(tl.int64), mask=rm)
        tl.store(out + O_FRAME_INDEX, first + j, mask=rm)
        tl.store(out + O_CODES, tl.where(ready, token, 0), mask=rm)
        newest = tl.where(ready, j, newest)
        newest_token = tl.where(ready, token, newest_token)
        frames = frames + ready.to(tl.int64)
        going = enter & ready & in_class(class_ptr, state, C_LIVE, rm) & verify
    w = rm & ~pad
    tl.store(state_ptr + slot, state, mask=w)
    tl.store(reason_ptr + slot, reason, mask=w)
    tl.store(error_ptr + slot, err, mask=w)
    tl.store(fault_ptr + slot, fault, mask=w)
    tl.store(computed_ptr + slot, computed, mask=w)
    tl.store(frames_ptr + slot, frames, mask=w)
    some = w & (newest >= 0)
    tl.store(fcodes_ptr + slot, newest_token, mask=some)
    source = (row64 * P + tl.maximum(newest, 0)) * fe_stride
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        rh = some[:, None] & (h < H)[None, :]
        fe = tl.load(fe_ptr + source[:, None] + h[None, :], mask=rh)
        tl.store(fembed_ptr + (slot * H)[:, None] + h[None, :], cast_to(fe, fembed_ptr.dtype.element_ty), mask=rh)
    for j in tl.static_range(P):
        out = out_ptr + (row64 * P + j) * out_stride
        tl.store(out + O_STATE, state.to(tl.int64), mask=rm)
        tl.store(out + O_REASON, reason.to(tl.int64), mask=rm)
        tl.store(out + O_ERROR, err.to(tl.int64), mask=rm)
        tl.store(out + O_NUM_FRAMES, frames, mask=rm)
        tl.store(out + O_NUM_COMPUTED, computed, mask=rm)


def sample_positions(table: SlotTable, batch: StepBatch, verify: torch.Tensor, logits: torch.Tensor,
                     drafts: torch.Tensor, *, eos_token_id: int | None,
                     allowed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify.sample_positions`: one launch over the B * (k + 1) position rows."""
    rows, positions = batch.num_rows, drafts.shape[1] + 1
    n, vocab = logits.shape
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    faults = torch.zeros(n, dtype=torch.int32, device=logits.device)
    if n:
        logits, block, noise, hi, lo, tile = draw_inputs(logits)
        counts = position_counts(table, batch.idx_mapping, drafts) if batch.cb0_penalty else table.cb0_counts
        sample_positions_kernel[(triton.cdiv(n, tile),)](
            batch.idx_mapping, n, positions, table.num_frames, table.seed, table.cb0_temperature, table.cb0_top_k,
            table.cb0_top_p, table.cb0_penalty, table.min_frames, counts, counts.stride(0), logits, logits.stride(0),
            vocab, noise if allowed is None else as_u8(allowed), noise, hi, lo,
            -1 if eos_token_id is None else int(eos_token_id), tokens, faults,
            HAS_ALLOWED=allowed is not None, APPLY_FILTERS=bool(batch.cb0_filters), HAS_PENALTY=bool(batch.cb0_penalty),
            HAS_SUPPRESS=bool(batch.cb0_min_frames) and eos_token_id is not None,
            PENALTY_AFTER=table.cb0_penalty_order == PENALTY_AFTER_FILTERS, BLOCK_R=tile, BLOCK_V=block,
            num_warps=warps_for(block),
        )
    return tokens.view(rows, positions), faults.view(rows, positions)


def verify_frames(table: SlotTable, lc: DeviceLifecycle, batch: StepBatch, verify: torch.Tensor,
                  tokens: torch.Tensor, faults: torch.Tensor, drafts: torch.Tensor, frame_embeds: torch.Tensor,
                  *, eos_token_id: int | None) -> torch.Tensor:
    """`verify.verify_frames`: one launch, each row's positions walked in order."""
    rows, positions = tokens.shape
    packed = torch.empty(rows * positions, OUT_CODES + 1, dtype=torch.int64, device=table.device)
    if rows == 0:
        return packed
    tokens, faults = tokens.contiguous(), faults.contiguous()
    frame_embeds = contiguous_rows(frame_embeds)
    drafts = drafts.contiguous() if drafts.shape[1] else tokens
    h = table.hidden_size
    block = block_for(h)
    tile = row_tile(rows, max(1, 1024 // block))
    sample_chain, sample_shape = phase_chain(lc, Phase.SAMPLE)
    publish_chain, publish_shape = phase_chain(lc, Phase.PUBLISH)
    verify_frames_kernel[(triton.cdiv(rows, tile),)](
        batch.idx_mapping, as_u8(batch.is_padding), batch.expected_serial, batch.num_scheduled, as_u8(verify.contiguous()),
        rows, table.state, table.serial, table.num_computed, table.prompt_len, table.num_frames, table.max_frames,
        table.finish_reason, table.error, table.fault, table.frame_codes, table.frame_log, table.frame_embed,
        table.cb0_counts, table.cb0_counts.stride(0), table.cb0_counts.shape[1], lc.rules, lc.state_class,
        sample_chain, publish_chain, tokens, faults, drafts, drafts.stride(0), frame_embeds, frame_embeds.stride(0),
        packed, packed.stride(0), table.max_context, h, -1 if eos_token_id is None else int(eos_token_id),
        **rule_strides(lc), SAMPLE_STAGES=sample_shape["STAGES"], SAMPLE_WIDTH=sample_shape["WIDTH"],
        PUBLISH_STAGES=publish_shape["STAGES"], PUBLISH_WIDTH=publish_shape["WIDTH"], P=positions, BLOCK_R=tile, BLOCK_H=block,
    )
    return packed
