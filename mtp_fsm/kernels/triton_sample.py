"""Triton sample and MTP stages, kernels beside launchers: CB0 draw and sample phase, MTP draws, MTP phase."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..lifecycle import DeviceLifecycle, Phase
from ..sampling import SamplingParams
from ..sampling.faults import FAULT_CODEBOOK_SHIFT
from ..sampling.penalties import PENALTY_AFTER_FILTERS
from ..slots import SlotTable
from .contract import StepBatch
from .triton_common import (
    B_CB0_FAULT, B_EOS_SAMPLED, B_MTP_FAULT, B_MTP_STOP, B_PROMPT_DONE, C_IN_STEP, C_LIVE, E_ILLEGAL, in_class,
    predicate_bit, row_owner, run_chain,
)
from .triton_launch import ROW_BLOCK, as_u8, draw_inputs, phase_chain, rule_strides, warps_for
from .triton_sampling import row_key, sample_cb0_rows, sample_rows


F_CODEBOOK_SHIFT = tl.constexpr(FAULT_CODEBOOK_SHIFT)


@triton.jit(do_not_specialize=['B'])
def sample_cb0_kernel(idx_ptr, pad_ptr, exp_ptr, nsched_ptr, B,
                      state_ptr, serial_ptr, computed_ptr, plen_ptr, error_ptr, reason_ptr, fault_ptr,
                      frames_ptr, seed_ptr, temp_ptr, topk_ptr, topp_ptr, rules_ptr, class_ptr, chain_ptr,
                      logits_ptr, logits_stride, V, allowed_ptr, gumbel_ptr, fx_hi_ptr, fx_lo_ptr, eos_id, tokens_ptr,
                      pen_ptr, counts_ptr, counts_stride, minf_ptr,
                      NS: tl.constexpr, PLANE: tl.constexpr, STAGES: tl.constexpr, WIDTH: tl.constexpr,
                      HAS_ALLOWED: tl.constexpr, APPLY_FILTERS: tl.constexpr, HAS_PENALTY: tl.constexpr,
                      HAS_SUPPRESS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
                      PENALTY_AFTER: tl.constexpr):
    """A tile of rows: counters, CB0 sampling (with the repetition penalty where the model's
    order puts it, PENALTY_AFTER, and the EOS suppression of min_frames), the sample-phase
    predicates (prompt done, a bad CB0 sample, EOS sampled), the sample-phase stage chain and
    the fault column."""
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = row < B
    slot, pad, state, owned = row_owner(row, rm, idx_ptr, pad_ptr, exp_ptr, state_ptr, serial_ptr)
    live = owned & in_class(class_ptr, state, C_LIVE, rm)
    n = tl.load(nsched_ptr + row, mask=rm, other=0)
    computed = tl.load(computed_ptr + slot, mask=rm, other=0) + tl.where(live, n, 0)
    token, fault = sample_cb0_rows(
        logits_ptr, logits_stride, row, rm, V, slot, tl.load(frames_ptr + slot, mask=rm, other=0), seed_ptr, temp_ptr,
        topk_ptr, topp_ptr, pen_ptr, minf_ptr, allowed_ptr, gumbel_ptr, fx_hi_ptr, fx_lo_ptr, counts_ptr,
        counts_stride, slot, eos_id, HAS_ALLOWED, APPLY_FILTERS, HAS_PENALTY, HAS_SUPPRESS, BLOCK_V, PENALTY_AFTER)
    bad = fault != 0
    tl.store(tokens_ptr + row, token, mask=rm)
    done = computed >= tl.load(plen_ptr + slot, mask=rm, other=0)
    eos = (token == eos_id) & (eos_id >= 0)
    word = predicate_bit(done, B_PROMPT_DONE) | predicate_bit(bad, B_CB0_FAULT) | predicate_bit(eos, B_EOS_SAMPLED)
    new, why, published, stuck = run_chain(rules_ptr, chain_ptr, state, word, owned, NS, PLANE, STAGES, WIDTH)
    w = rm & ~pad
    reason = tl.load(reason_ptr + slot, mask=w, other=0)
    err = tl.load(error_ptr + slot, mask=w, other=0)
    tl.store(computed_ptr + slot, computed, mask=w)
    tl.store(state_ptr + slot, new, mask=w)
    tl.store(reason_ptr + slot, tl.where(why != 0, why, reason), mask=w)
    tl.store(error_ptr + slot, tl.where(stuck, err | E_ILLEGAL, err), mask=w)
    _record_fault(fault_ptr, slot, w, owned, why, fault)  # codebook 0: the word is the kind


@triton.jit
def _record_fault(fault_ptr, slot, w, owned, why, fault):
    """row_ops.record's fault column: the row's first fault word, where the phase ended an owned
    row (a recorded reason) on a bad sample and the column is still 0."""
    old = tl.load(fault_ptr + slot, mask=w, other=0)
    write = owned & (why != 0) & (fault != 0) & (old == 0)
    tl.store(fault_ptr + slot, tl.where(write, fault, old), mask=w)


def sample_cb0(
    table: SlotTable,
    lc: DeviceLifecycle,
    batch: StepBatch,
    logits: torch.Tensor,
    *,
    eos_token_id: int | None,
    allowed: torch.Tensor | None,
) -> torch.Tensor:
    """Counters, CB0 sampling, the sample-phase predicates and stage chain: one program per row."""
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return tokens
    logits, block, noise, hi, lo, tile = draw_inputs(logits)
    chain, shape = phase_chain(lc, Phase.SAMPLE)
    sample_cb0_kernel[(triton.cdiv(rows, tile),)](
        batch.idx_mapping, as_u8(batch.is_padding), batch.expected_serial, batch.num_scheduled, rows,
        table.state, table.serial, table.num_computed, table.prompt_len, table.error, table.finish_reason,
        table.fault, table.num_frames, table.seed, table.cb0_temperature, table.cb0_top_k, table.cb0_top_p,
        lc.rules, lc.state_class, chain, logits, logits.stride(0), vocab, noise if allowed is None else as_u8(allowed),
        noise, hi, lo, -1 if eos_token_id is None else int(eos_token_id), tokens,
        table.cb0_penalty, table.cb0_counts, table.cb0_counts.stride(0), table.min_frames,
        **rule_strides(lc), **shape, HAS_ALLOWED=allowed is not None, APPLY_FILTERS=bool(batch.cb0_filters),
        HAS_PENALTY=bool(batch.cb0_penalty), HAS_SUPPRESS=bool(batch.cb0_min_frames) and eos_token_id is not None,
        PENALTY_AFTER=table.cb0_penalty_order == PENALTY_AFTER_FILTERS,
        BLOCK_R=tile, BLOCK_V=block, num_warps=warps_for(block),
    )
    return tokens


@triton.jit(do_not_specialize=['B', 'codebook'])
def sample_mtp_kernel(idx_ptr, B, frames_ptr, seed_ptr, temp_ptr, topk_ptr, topp_ptr,
                      logits_ptr, logits_stride, V, codebook, gumbel_ptr, fx_hi_ptr, fx_lo_ptr, tokens_ptr, fault_ptr,
                      APPLY_FILTERS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    """A tile of rows: MTP codebook `codebook` with each row's MTP parameters; each row's
    fault word (int32, kind | codebook << 4) keeps its lowest bad codebook."""
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = row < B
    slot = tl.load(idx_ptr + row, mask=rm, other=0)
    seed = tl.load(seed_ptr + slot, mask=rm, other=0)
    key = row_key(seed, tl.load(frames_ptr + slot, mask=rm, other=0), seed * 0 + codebook)
    token, kind = sample_rows(
        logits_ptr, logits_stride, row, rm, V, tl.load(temp_ptr + slot, mask=rm, other=0.0),
        tl.load(topk_ptr + slot, mask=rm, other=0), tl.load(topp_ptr + slot, mask=rm, other=1.0), key,
        gumbel_ptr, gumbel_ptr, fx_hi_ptr, fx_lo_ptr, gumbel_ptr, 0, slot, seed * 0, rm, -1,
        False, APPLY_FILTERS, False, False, BLOCK_V, False)
    tl.store(tokens_ptr + row, token, mask=rm)
    old = tl.load(fault_ptr + row, mask=rm, other=0)
    cb = codebook.to(tl.int32)
    first = (kind != 0) & ((old == 0) | ((old >> F_CODEBOOK_SHIFT) > cb))
    tl.store(fault_ptr + row, kind | (cb << F_CODEBOOK_SHIFT), mask=rm & first)


def mtp_sampler(table: SlotTable, batch: StepBatch):
    """The CodebookSampler handed to the model's MTP hook, plus a callable giving its per-row
    fault words once the hook has run (int32, kind | codebook << 4 of the lowest bad
    codebook; 0 = none): the kernels keep them in place as they sample.

    Parameters, seed and frame index are read from the table at sampling time; the MTP
    hook runs between this call and mtp_scatter, where nothing writes those columns."""
    slot = batch.idx_mapping
    rows = int(slot.shape[0])
    faults = torch.zeros(rows, dtype=torch.int32, device=slot.device)
    filters = bool(batch.mtp_filters)

    def sample(logits: torch.Tensor, codebook: int, params: SamplingParams | None = None) -> torch.Tensor:
        n, vocab = logits.shape
        tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
        if n == 0:
            return tokens
        logits, block, noise, hi, lo, tile = draw_inputs(logits)
        columns, apply = (table.mtp_temperature, table.mtp_top_k, table.mtp_top_p), filters
        if params is not None:  # a model-owned draw (e.g. MOSS's stop head): one value for every slot
            columns = tuple(torch.full_like(c, v) for c, v in zip(columns, (params.temperature, params.top_k,
                                                                          params.top_p)))
            apply = params.filters
        sample_mtp_kernel[(triton.cdiv(n, tile),)](
            slot, n, table.num_frames, table.seed, *columns,
            logits, logits.stride(0), vocab, int(codebook), noise, hi, lo, tokens, faults,
            APPLY_FILTERS=apply, BLOCK_R=tile, BLOCK_V=block, num_warps=warps_for(block),
        )
        return tokens

    return sample, lambda: faults


@triton.jit(do_not_specialize=['B'])
def mtp_scatter_kernel(idx_ptr, pad_ptr, exp_ptr, fault_in_ptr, stop_ptr, B, state_ptr, serial_ptr, reason_ptr, error_ptr,
                       fault_ptr, rules_ptr, class_ptr, chain_ptr, NS: tl.constexpr, PLANE: tl.constexpr, STAGES: tl.constexpr,
                       WIDTH: tl.constexpr, HAS_STOP: tl.constexpr, LAST: tl.constexpr, BLOCK: tl.constexpr):
    """The MTP-phase stage chain on the predicates MTP_FAULT (a row's fault word != 0) and
    MTP_STOP (the hook's stop flags, when it returned any), then the fault column. LAST: the
    step's final stage (speculative: the drafter), which flags rows left in an in-step state."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = r < B
    slot, pad, state, owned = row_owner(r, m, idx_ptr, pad_ptr, exp_ptr, state_ptr, serial_ptr)
    fault = tl.load(fault_in_ptr + r, mask=m, other=0)
    word = predicate_bit(fault != 0, B_MTP_FAULT)
    if HAS_STOP:
        word = word | predicate_bit(tl.load(stop_ptr + r, mask=m, other=0) != 0, B_MTP_STOP)
    new, why, published, stuck = run_chain(rules_ptr, chain_ptr, state, word, owned, NS, PLANE, STAGES, WIDTH)
    if LAST:
        stuck = stuck | (owned & in_class(class_ptr, new, C_IN_STEP, m))
    w = m & ~pad
    reason = tl.load(reason_ptr + slot, mask=w, other=0)
    err = tl.load(error_ptr + slot, mask=w, other=0)
    tl.store(state_ptr + slot, new, mask=w)
    tl.store(reason_ptr + slot, tl.where(why != 0, why, reason), mask=w)
    tl.store(error_ptr + slot, tl.where(stuck, err | E_ILLEGAL, err), mask=w)
    _record_fault(fault_ptr, slot, w, owned, why, fault)


def mtp_scatter(
    table: SlotTable, lc: DeviceLifecycle, batch: StepBatch, mtp_faults: torch.Tensor, mtp_stop: torch.Tensor | None = None,
    last: bool = False,
) -> None:
    """The MTP-phase stage chain (a lifecycle without one leaves every row as it is); last:
    the step's final stage, which flags rows left in-step (reference.mtp_scatter)."""
    rows = batch.num_rows
    if rows == 0 or not lc.has_stages(Phase.MTP):
        return
    chain, shape = phase_chain(lc, Phase.MTP)
    mtp_scatter_kernel[(triton.cdiv(rows, ROW_BLOCK),)](
        batch.idx_mapping, as_u8(batch.is_padding), batch.expected_serial, mtp_faults,
        mtp_faults if mtp_stop is None else as_u8(mtp_stop), rows,
        table.state, table.serial, table.finish_reason, table.error, table.fault, lc.rules, lc.state_class, chain,
        **rule_strides(lc), **shape, HAS_STOP=mtp_stop is not None, LAST=last, BLOCK=ROW_BLOCK,
    )
