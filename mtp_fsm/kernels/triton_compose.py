"""Triton compose stage, kernels beside launcher: span and identity checks, each token's input."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..lifecycle import DeviceLifecycle
from ..slots import SlotTable
from .contract import StepBatch, TextStep
from .triton_common import E_IDENTITY, E_SPAN, add_in, row_phase
from .triton_launch import ROW_BLOCK, as_u8, block_for, contiguous_rows, row_tile


@triton.jit(do_not_specialize=['B'])
def frame_index_kernel(idx_ptr, frames_ptr, out_ptr, B, BLOCK: tl.constexpr):
    """The text step's frame index per row: max(num_frames[slot] - 1, 0)."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = r < B
    slot = tl.load(idx_ptr + r, mask=m, other=0)
    tl.store(out_ptr + r, tl.maximum(tl.load(frames_ptr + slot, mask=m, other=0) - 1, 0), mask=m)


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
        slot, pad, owned, live, prefill, bad_span, computed = row_phase(
            p, rm, idx_ptr, pad_ptr, exp_ptr, nsched_ptr, state_ptr, serial_ptr, computed_ptr, plen_ptr, class_ptr,
            decode_width)
        bits = tl.where(bad_span, E_SPAN, 0) | tl.where(rm & (~pad) & (~owned), E_IDENTITY, 0)
        flag = rm & (bits != 0)
        err = tl.load(error_ptr + slot, mask=flag, other=0)
        tl.store(error_ptr + slot, err | bits, mask=flag)
    tm = p < T
    row = tl.load(rows_ptr + p, mask=tm, other=0)
    slot, pad, owned, live, prefill, bad_span, computed = row_phase(
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


def compose_inputs(table: SlotTable, lc: DeviceLifecycle, batch: StepBatch, text_step: TextStep):
    """Returns (inputs_embeds [T, H], positions [T], token_slots [T]; -1 = inert token)."""
    slot = batch.idx_mapping
    rows, tokens, h = batch.num_rows, batch.num_tokens, table.hidden_size
    device, dtype = table.device, table.frame_embed.dtype
    frame_index = torch.empty(rows, dtype=torch.int64, device=device)
    if rows:
        frame_index_kernel[(triton.cdiv(rows, ROW_BLOCK),)](slot, table.num_frames, frame_index, rows, BLOCK=ROW_BLOCK)
    text = text_step(table.extra, slot, frame_index)
    if text.dtype != dtype:
        text = text.to(dtype)
    text = contiguous_rows(text)
    inputs = torch.empty(tokens, h, dtype=dtype, device=device)
    positions = torch.empty(tokens, dtype=torch.int64, device=device)
    token_slots = torch.empty(tokens, dtype=torch.int64, device=device)
    if max(rows, tokens):
        block = block_for(h)
        tile = row_tile(max(rows, tokens), max(1, 2048 // block))
        compose_kernel[(triton.cdiv(max(rows, tokens), tile), triton.cdiv(h, block))](
            slot, as_u8(batch.is_padding), batch.expected_serial, batch.num_scheduled, batch.token_rows,
            batch.token_offsets, rows, tokens, table.state, table.serial, table.num_computed, table.prompt_len,
            table.error, lc.state_class, table.prompt_embeds, table.frame_embed, text, text.stride(0) if text.dim() == 2 else 0,
            inputs, positions, token_slots, table.max_context, h, batch.decode_width, BLOCK_T=tile, BLOCK_H=block,
        )
    return inputs, positions, token_slots
