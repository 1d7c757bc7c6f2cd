"""The @triton.jit stage kernels: one launch per transition stage over all rows.

Each kernel computes its phase's predicates, runs the compiled stage chains of that phase
through the generic executor (`triton_common.run_stage`: rules gathered at the row's
state, guard masks on the predicate word) and moves the data the fired rules call for.
No kernel names a trigger or a state: the lifecycle arrives as tensors (rules, state
classes, chains), and the chain shapes are constexprs, so a kernel compiles once per
lifecycle variant. Padding rows (is_padding, pointing at the scratch row)
compute like any row but never write the table: the reference's writes for them store
the values they already hold, so skipping them is exact and race-free. Row and token counts
are not specialised on (do_not_specialize), so a new batch size never recompiles.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import (
    B_WIND_DONE, B_CB0_FAULT, B_EOC_FRAME, B_EOS_SAMPLED, B_LENGTH_REACHED, B_MTP_FAULT, B_MTP_STOP, B_PROMPT_DONE,
    B_EOS_FRAME, B_RAMP_DONE, B_DRAFT_ACCEPTED, C_IN_STEP, C_LIVE, C_VACANT,
    E_IDENTITY, E_ILLEGAL, E_SPAN, O_CODES, O_ERROR, O_FRAME_INDEX, O_NUM_COMPUTED, O_NUM_FRAMES, O_REASON, O_STATE,
    O_VALID,
    add_in, cast_to, fire_host, in_class, predicate_bit, run_chain, run_stage,
)
from ..sampling.faults import FAULT_CODEBOOK_SHIFT
from .triton_sampling import row_key, sample_cb0_rows, sample_rows

F_CODEBOOK_SHIFT = tl.constexpr(FAULT_CODEBOOK_SHIFT)


@triton.jit(do_not_specialize=['E'])
def host_events_kernel(slots_ptr, trig_ptr, trig_stride, reasons_ptr, E,
                       state_ptr, reason_ptr, serial_ptr, error_ptr, rules_ptr, class_ptr,
                       NS: tl.constexpr, PLANE: tl.constexpr, CHAIN: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < E
    slot = tl.load(slots_ptr + i, mask=m, other=0)
    state = tl.load(state_ptr + slot, mask=m, other=0)
    err = tl.load(error_ptr + slot, mask=m, other=0)
    for k in tl.static_range(CHAIN):
        trig = tl.load(trig_ptr + i * trig_stride + k, mask=m, other=-1)
        state, illegal = fire_host(rules_ptr, NS, PLANE, trig, state, m & (trig >= 0))
        err = tl.where(illegal, err | E_ILLEGAL, err)
    reason = tl.load(reasons_ptr + i, mask=m, other=0)
    old_reason = tl.load(reason_ptr + slot, mask=m, other=0)
    serial = tl.load(serial_ptr + slot, mask=m, other=0)
    tl.store(state_ptr + slot, state, mask=m)
    tl.store(error_ptr + slot, err, mask=m)
    tl.store(reason_ptr + slot, tl.where(reason != 0, reason, old_reason), mask=m)
    tl.store(serial_ptr + slot, tl.where(in_class(class_ptr, state, C_VACANT, m), 0, serial), mask=m)


@triton.jit(do_not_specialize=['A', 'C'])
def admit_kernel(slots_ptr, A, state_ptr, error_ptr, rules_ptr, trigger, columns_ptr, C,
                 NS: tl.constexpr, PLANE: tl.constexpr, RAW: tl.constexpr, FIRE: tl.constexpr,
                 BLOCK_A: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (admitted-row tiles, element blocks): the admitted rows of C columns of one element
    width (viewed as the raw integers RAW) reset to their default after a staged value prefix.
    `columns_ptr` is the columns' pointer table, int64 [C, 5]: destination and source
    addresses, destination and source elements per row, default bits. FIRE (the first
    launch) also fires the admission `trigger` (the error column is reset, not or-ed)."""
    a = tl.program_id(0) * BLOCK_A + tl.arange(0, BLOCK_A)
    amask = a < A
    blk = tl.program_id(1)
    slot = tl.load(slots_ptr + a, mask=amask, other=0).to(tl.int64)
    if FIRE:
        if blk == 0:
            state = tl.load(state_ptr + slot, mask=amask, other=0)
            new, illegal = fire_host(rules_ptr, NS, PLANE, trigger, state, amask)
            tl.store(error_ptr + slot, tl.where(illegal, E_ILLEGAL, 0).to(tl.int32), mask=amask)
            tl.store(state_ptr + slot, new, mask=amask)
    offs = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    for c in range(C):
        column = columns_ptr + c * 5
        dst = tl.load(column).to(tl.pointer_type(RAW))
        src = tl.load(column + 1).to(tl.pointer_type(RAW))
        dst_row, src_row, default = tl.load(column + 2), tl.load(column + 3), tl.load(column + 4)
        inside = amask[:, None] & (offs < dst_row)[None, :]
        given = (offs < src_row)[None, :]
        v = tl.load(src + a.to(tl.int64)[:, None] * src_row + offs[None, :], mask=inside & given, other=0)
        v = tl.where(given, v, default.to(RAW))
        tl.store(dst + slot[:, None] * dst_row + offs[None, :], v, mask=inside)


@triton.jit(do_not_specialize=['N'])
def replay_kernel(slots_ptr, pos_ptr, N, fe_ptr, fe_stride, ts_ptr, ts_stride, prompt_ptr, C, H,
                  BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr):
    i = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    im = i < N
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = im[:, None] & (h < H)[None, :]
    slot = tl.load(slots_ptr + i, mask=im, other=0)
    pos = tl.load(pos_ptr + i, mask=im, other=0)
    fe = tl.load(fe_ptr + i.to(tl.int64)[:, None] * fe_stride + h[None, :], mask=m)
    ts = tl.load(ts_ptr + i.to(tl.int64)[:, None] * ts_stride + h[None, :], mask=m)
    v = cast_to(add_in(fe, ts, fe_ptr.dtype.element_ty), prompt_ptr.dtype.element_ty)
    tl.store(prompt_ptr + ((slot * C + pos) * H)[:, None] + h[None, :], v, mask=m)


@triton.jit
def _row_phase(row, rmask, idx_ptr, pad_ptr, exp_ptr, nsched_ptr, state_ptr, serial_ptr, computed_ptr, plen_ptr,
               class_ptr, decode_width):
    slot = tl.load(idx_ptr + row, mask=rmask, other=0)
    pad = tl.load(pad_ptr + row, mask=rmask, other=1) != 0
    state = tl.load(state_ptr + slot, mask=rmask, other=0)
    owned = (~pad) & (tl.load(serial_ptr + slot, mask=rmask, other=0) == tl.load(exp_ptr + row, mask=rmask, other=0))
    live = owned & in_class(class_ptr, state, C_LIVE, rmask)
    computed = tl.load(computed_ptr + slot, mask=rmask, other=0)
    plen = tl.load(plen_ptr + slot, mask=rmask, other=0)
    n = tl.load(nsched_ptr + row, mask=rmask, other=0)
    prefill = computed < plen
    # Phase comes from num_computed < prompt_len, never from the span length.
    bad_span = live & tl.where(prefill, computed + n > plen, n != decode_width)
    return slot, pad, owned, live, prefill, bad_span, computed


@triton.jit(do_not_specialize=['B', 'T'])
def compose_kernel(idx_ptr, pad_ptr, exp_ptr, nsched_ptr, rows_ptr, offs_ptr, B, T,
                   state_ptr, serial_ptr, computed_ptr, plen_ptr, error_ptr, class_ptr,
                   prompt_ptr, fembed_ptr, text_ptr, text_stride, out_ptr, pos_ptr, tslot_ptr, C, H, decode_width,
                   BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """Grid (tiles of max(T, B), H blocks): index p flags row p (span / identity) and
    builds token p's input (prompt row, or frame_embed + text step)."""
    p = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    hb = tl.program_id(1)
    if hb == 0:
        rm = p < B
        slot, pad, owned, live, prefill, bad_span, computed = _row_phase(
            p, rm, idx_ptr, pad_ptr, exp_ptr, nsched_ptr, state_ptr, serial_ptr, computed_ptr, plen_ptr, class_ptr,
            decode_width)
        bits = tl.where(bad_span, E_SPAN, 0) | tl.where(rm & (~pad) & (~owned), E_IDENTITY, 0)
        flag = rm & (bits != 0)
        err = tl.load(error_ptr + slot, mask=flag, other=0)
        tl.store(error_ptr + slot, err | bits, mask=flag)
    tm = p < T
    row = tl.load(rows_ptr + p, mask=tm, other=0)
    slot, pad, owned, live, prefill, bad_span, computed = _row_phase(
        row, tm, idx_ptr, pad_ptr, exp_ptr, nsched_ptr, state_ptr, serial_ptr, computed_ptr, plen_ptr, class_ptr,
        decode_width)
    pos = computed + tl.load(offs_ptr + p, mask=tm, other=0)
    if hb == 0:
        tl.store(pos_ptr + p, pos, mask=tm)
        # A draft past the context is inert (its position holds no KV; verification stops before it).
        tl.store(tslot_ptr + p, tl.where(live & ~bad_span & (pos < C), slot, -1), mask=tm)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m = tm[:, None] & (h < H)[None, :]
    at = slot * C + tl.minimum(pos, C - 1)
    prompt = tl.load(prompt_ptr + (at * H)[:, None] + h[None, :], mask=m & prefill[:, None])
    dm = m & ~prefill[:, None]
    fe = tl.load(fembed_ptr + (slot * H)[:, None] + h[None, :], mask=dm)
    ts = tl.load(text_ptr + (row.to(tl.int64) * text_stride)[:, None] + h[None, :], mask=dm)
    decode = add_in(fe, ts, fembed_ptr.dtype.element_ty)
    tl.store(out_ptr + (p.to(tl.int64) * H)[:, None] + h[None, :], tl.where(prefill[:, None], prompt, decode), mask=m)


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
    slot = tl.load(idx_ptr + row, mask=rm, other=0)
    pad = tl.load(pad_ptr + row, mask=rm, other=1) != 0
    state = tl.load(state_ptr + slot, mask=rm, other=0)
    owned = (~pad) & (tl.load(serial_ptr + slot, mask=rm, other=0) == tl.load(exp_ptr + row, mask=rm, other=0))
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


@triton.jit(do_not_specialize=['B'])
def mtp_scatter_kernel(idx_ptr, pad_ptr, exp_ptr, fault_in_ptr, stop_ptr, B, state_ptr, serial_ptr, reason_ptr, error_ptr,
                       fault_ptr, rules_ptr, class_ptr, chain_ptr, NS: tl.constexpr, PLANE: tl.constexpr, STAGES: tl.constexpr,
                       WIDTH: tl.constexpr, HAS_STOP: tl.constexpr, LAST: tl.constexpr, BLOCK: tl.constexpr):
    """The MTP-phase stage chain on the predicates MTP_FAULT (a row's fault word != 0) and
    MTP_STOP (the hook's stop flags, when it returned any), then the fault column. LAST: the
    step's final stage (speculative: the drafter), which flags rows left in an in-step state."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = r < B
    slot = tl.load(idx_ptr + r, mask=m, other=0)
    pad = tl.load(pad_ptr + r, mask=m, other=1) != 0
    state = tl.load(state_ptr + slot, mask=m, other=0)
    owned = (~pad) & (tl.load(serial_ptr + slot, mask=m, other=0) == tl.load(exp_ptr + r, mask=m, other=0))
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
    slot = tl.load(idx_ptr + row, mask=rm, other=0)
    pad = tl.load(pad_ptr + row, mask=rm, other=1) != 0
    state = tl.load(state_ptr + slot, mask=rm, other=0)
    owned = (~pad) & (tl.load(serial_ptr + slot, mask=rm, other=0) == tl.load(exp_ptr + row, mask=rm, other=0))
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


@triton.jit(do_not_specialize=['B'])
def frame_index_kernel(idx_ptr, frames_ptr, out_ptr, B, BLOCK: tl.constexpr):
    """The text step's frame index per row: max(num_frames[slot] - 1, 0)."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = r < B
    slot = tl.load(idx_ptr + r, mask=m, other=0)
    tl.store(out_ptr + r, tl.maximum(tl.load(frames_ptr + slot, mask=m, other=0) - 1, 0), mask=m)
