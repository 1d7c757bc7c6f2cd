"""Triton step-boundary stages, kernel beside launcher: host events, admission, frame replay."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..lifecycle import DeviceLifecycle
from ..slots import SlotTable
from .contract import ReplayFrames, StagedAdmits, StagedEvents, TextStep
from .triton_common import C_VACANT, E_ILLEGAL, add_in, cast_to, fire_host, in_class
from .triton_launch import (
    ROW_BLOCK, TRITON_RAW, block_for, contiguous_rows, interpreted, raw_bits, row_tile, rule_strides,
)


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


def apply_host_events(table: SlotTable, lc: DeviceLifecycle, events: StagedEvents) -> None:
    count = int(events.slots.shape[0])
    if count == 0:
        return
    triggers = events.triggers.contiguous()
    host_events_kernel[(triton.cdiv(count, ROW_BLOCK),)](
        events.slots, triggers, triggers.stride(0), events.reasons, count,
        table.state, table.finish_reason, table.serial, table.error, lc.rules, lc.state_class,
        **rule_strides(lc), CHAIN=int(triggers.shape[1]), BLOCK=ROW_BLOCK,
    )


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


def apply_admits(table: SlotTable, lc: DeviceLifecycle, admits: StagedAdmits) -> None:
    """Every column of each admitted row reset, its staged prefix written: one launch per
    element width in the table (at most four), whatever the number of rows or columns, each
    given its columns as one pointer table; the first also fires `admits.trigger`."""
    slots = admits.slots
    count = int(slots.shape[0])
    if count == 0:
        return
    defaults = table.column_defaults()
    by_width: dict[int, list[tuple[int, int, int, int, int]]] = {}
    keep = []  # staged values converted here: alive until the launches below are queued
    for name, column in table.columns().items():
        if name in ("state", "error"):
            continue
        dst_row = column[0].numel()
        value = admits.values.get(name)
        if value is None:
            src, src_row = column, 0
        else:
            value = value.to(column.dtype).contiguous()
            src_row = value.numel() // count
            if src_row > dst_row:
                raise ValueError(f"admit value for column {name!r} has rows of {src_row} > {dst_row} elements")
            src = value
            keep.append(value)
        by_width.setdefault(column.element_size(), []).append(
            (column.data_ptr(), src.data_ptr(), dst_row, src_row, raw_bits(defaults[name], column.dtype)))
    tile = row_tile(count, 1)
    for n, width in enumerate(sorted(by_width)):
        group = by_width[width]
        widest = max(spec[2] for spec in group)
        block = block_for(widest, 4096 if interpreted() else 1024)
        pointers = torch.tensor(group, dtype=torch.int64)
        if slots.device.type == "cuda":  # pinned: an async upload, no host sync
            pointers = pointers.pin_memory().to(slots.device, non_blocking=True)
        admit_kernel[(triton.cdiv(count, tile), triton.cdiv(widest, block))](
            slots, count, table.state, table.error, lc.rules, int(admits.trigger), pointers, len(group),
            **rule_strides(lc), RAW=TRITON_RAW[width], FIRE=n == 0, BLOCK_A=tile, BLOCK=block,
        )


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


def replay_frames(table: SlotTable, replay: ReplayFrames, frame_embed, text_step: TextStep) -> None:
    count = int(replay.slots.shape[0])
    if count == 0:
        return
    fe = frame_embed(replay.codes)
    ts = text_step(table.extra, replay.slots, replay.frame_index)
    if fe.dtype != ts.dtype:
        promoted = torch.promote_types(fe.dtype, ts.dtype)
        fe, ts = fe.to(promoted), ts.to(promoted)
    fe, ts = contiguous_rows(fe), contiguous_rows(ts)
    h = table.hidden_size
    block = block_for(h)
    tile = row_tile(count, max(1, 2048 // block))
    replay_kernel[(triton.cdiv(count, tile), triton.cdiv(h, block))](
        replay.slots, replay.positions, count, fe, fe.stride(0), ts, ts.stride(0), table.prompt_embeds,
        table.max_context, h, BLOCK_N=tile, BLOCK_H=block,
    )
