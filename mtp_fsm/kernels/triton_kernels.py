"""Triton backend: the stage functions of `reference`, same names, signatures and contract.

Each stage is one fused kernel launch over all rows (the phase's predicates, the compiled
stage chains run by one generic executor, data movement); launches never depend on the
batch size:

| stage             | launches                                                         |
|-------------------|------------------------------------------------------------------|
| apply_host_events | 1                                                                |
| apply_admits      | 1 per element width among the columns (<= 4): a pointer table each |
| replay_frames     | 1 (+ the model's frame_embed and text_step)                      |
| compose_inputs    | 2: frame index, then the fused gather (+ the model's text_step)  |
| sample_cb0        | 1                                                                |
| mtp_sampler       | 1 memset (fault words) + 1 per codebook the MTP hook samples     |
| mtp_scatter       | 1                                                                |
| publish_frames    | 1                                                                |
| sample_positions  | 1 (speculative: every verify position of every row)              |
| verify_frames     | 1 (speculative: the verify loop, each row's positions in order)  |

A decode step is 6 launches plus Q - 1 MTP sampling launches. No stage reads a device
value on the host, and no decode stage builds a tensor from host data (admission uploads its
pointer tables through pinned memory), so the decode stages can be captured in a CUDA graph
(after a warm-up launch has compiled them). The lifecycle is data (a `DeviceLifecycle`):
chain shapes and table strides are the only constexprs taken from it, so the kernels
compile once per lifecycle variant. Kernels process tiles of rows: one
row (sampling) or a few per program on a GPU, the whole batch in one program under the
CPU interpreter (TRITON_INTERPRET=1, set before triton is first imported), whose
per-program cost is large.
"""

from __future__ import annotations

import functools

import torch
import triton  # ImportError when Triton is missing: the backend selector reports it
import triton.language as tl

from ..lifecycle import DeviceLifecycle, Phase
from ..sampling import SamplingParams
from ..sampling.noise import gumbel_table
from ..sampling.penalties import PENALTY_AFTER_FILTERS
from ..sampling.topp import fixed_tables
from ..slots import SlotTable
from . import triton_stages as K
from .contract import (  # noqa: F401  (re-exported: the packed output layout)
    OUT_CODES, OUT_ERROR, OUT_FRAME_INDEX, OUT_NUM_FRAMES, OUT_REASON, OUT_STATE, OUT_VALID, ReplayFrames,
    StagedAdmits, StagedEvents, StepBatch, TextStep,
)
from .triton_sampling import MAX_VOCAB
# Speculative decoding's verify positions as rows: their own module, the stage functions' names.
from .triton_verify import sample_positions, verify_frames  # noqa: F401

# No stage reads a device value on the host: a decode step can be captured as a CUDA graph
# (engine/decode_graphs.py; the torch reference's candidate sampler reads one on purpose).
CUDA_GRAPHS = True
ROW_BLOCK = 128


def _built_for_interpreter() -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - a Triton without the interpreter
        return False
    return isinstance(K.compose_kernel, InterpretedFunction)


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


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.bool else t


_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TRITON_RAW = {1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64}  # a column's raw element, by width


@functools.lru_cache(maxsize=None)
def _bits(value: float, dtype: torch.dtype) -> int:
    return int(torch.tensor(value, dtype=dtype).view(_RAW[dtype.itemsize]).item())


def _warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def _block(n: int, cap: int = 1024) -> int:
    return min(cap, triton.next_power_of_2(max(n, 1)))


def _rules(lc: DeviceLifecycle) -> dict:
    """The rules tensor's strides as constexprs: NS (states per trigger row) and PLANE
    (elements per rule plane); the kernels index it flat."""
    if not lc.rules.is_contiguous():
        raise ValueError("the lifecycle rules tensor must be contiguous")
    _, triggers, states = lc.rules.shape
    return {"NS": int(states), "PLANE": int(triggers * states)}


def _chain(lc: DeviceLifecycle, phase: Phase) -> tuple[torch.Tensor, dict]:
    """One phase's chain tensor [stages, 1 + longest] and its shape as constexprs. A phase
    without stages passes the rules tensor as a placeholder pointer (never read)."""
    chain = lc.chains[phase]
    stages, width = int(chain.shape[0]), int(chain.shape[1])
    if stages == 0:
        return lc.rules, {"STAGES": 0, "WIDTH": 1}
    if not chain.is_contiguous():
        chain = chain.contiguous()
    return chain, {"STAGES": stages, "WIDTH": width}


def _row_tile(n: int, gpu: int) -> int:
    """Rows per program: `gpu` on a GPU; on the interpreter, as many as possible (one
    program per launch amortises its large per-program overhead)."""
    return min(64, triton.next_power_of_2(max(n, 1))) if interpreted() else gpu


def apply_host_events(table: SlotTable, lc: DeviceLifecycle, events: StagedEvents) -> None:
    count = int(events.slots.shape[0])
    if count == 0:
        return
    triggers = events.triggers.contiguous()
    K.host_events_kernel[(triton.cdiv(count, ROW_BLOCK),)](
        events.slots, triggers, triggers.stride(0), events.reasons, count,
        table.state, table.finish_reason, table.serial, table.error, lc.rules, lc.state_class,
        **_rules(lc), CHAIN=int(triggers.shape[1]), BLOCK=ROW_BLOCK,
    )


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
            (column.data_ptr(), src.data_ptr(), dst_row, src_row, _bits(defaults[name], column.dtype)))
    tile = _row_tile(count, 1)
    for n, width in enumerate(sorted(by_width)):
        group = by_width[width]
        widest = max(spec[2] for spec in group)
        block = _block(widest, 4096 if interpreted() else 1024)
        pointers = torch.tensor(group, dtype=torch.int64)
        if slots.device.type == "cuda":  # pinned: an async upload, no host sync
            pointers = pointers.pin_memory().to(slots.device, non_blocking=True)
        K.admit_kernel[(triton.cdiv(count, tile), triton.cdiv(widest, block))](
            slots, count, table.state, table.error, lc.rules, int(admits.trigger), pointers, len(group),
            **_rules(lc), RAW=_TRITON_RAW[width], FIRE=n == 0, BLOCK_A=tile, BLOCK=block,
        )


def replay_frames(table: SlotTable, replay: ReplayFrames, frame_embed, text_step: TextStep) -> None:
    count = int(replay.slots.shape[0])
    if count == 0:
        return
    fe = frame_embed(replay.codes)
    ts = text_step(table.extra, replay.slots, replay.frame_index)
    if fe.dtype != ts.dtype:
        promoted = torch.promote_types(fe.dtype, ts.dtype)
        fe, ts = fe.to(promoted), ts.to(promoted)
    fe, ts = _rows(fe), _rows(ts)
    h = table.hidden_size
    block = _block(h)
    tile = _row_tile(count, max(1, 2048 // block))
    K.replay_kernel[(triton.cdiv(count, tile), triton.cdiv(h, block))](
        replay.slots, replay.positions, count, fe, fe.stride(0), ts, ts.stride(0), table.prompt_embeds,
        table.max_context, h, BLOCK_N=tile, BLOCK_H=block,
    )


def compose_inputs(table: SlotTable, lc: DeviceLifecycle, batch: StepBatch, text_step: TextStep):
    """Returns (inputs_embeds [T, H], positions [T], token_slots [T]; -1 = inert token)."""
    slot = batch.idx_mapping
    rows, tokens, h = batch.num_rows, batch.num_tokens, table.hidden_size
    device, dtype = table.device, table.frame_embed.dtype
    frame_index = torch.empty(rows, dtype=torch.int64, device=device)
    if rows:
        K.frame_index_kernel[(triton.cdiv(rows, ROW_BLOCK),)](slot, table.num_frames, frame_index, rows, BLOCK=ROW_BLOCK)
    text = text_step(table.extra, slot, frame_index)
    if text.dtype != dtype:
        text = text.to(dtype)
    text = _rows(text)
    inputs = torch.empty(tokens, h, dtype=dtype, device=device)
    positions = torch.empty(tokens, dtype=torch.int64, device=device)
    token_slots = torch.empty(tokens, dtype=torch.int64, device=device)
    if max(rows, tokens):
        block = _block(h)
        tile = _row_tile(max(rows, tokens), max(1, 2048 // block))
        K.compose_kernel[(triton.cdiv(max(rows, tokens), tile), triton.cdiv(h, block))](
            slot, _u8(batch.is_padding), batch.expected_serial, batch.num_scheduled, batch.token_rows,
            batch.token_offsets, rows, tokens, table.state, table.serial, table.num_computed, table.prompt_len,
            table.error, lc.state_class, table.prompt_embeds, table.frame_embed, text, text.stride(0) if text.dim() == 2 else 0,
            inputs, positions, token_slots, table.max_context, h, batch.decode_width, BLOCK_T=tile, BLOCK_H=block,
        )
    return inputs, positions, token_slots


def _vocab_block(vocab: int) -> int:
    if vocab > MAX_VOCAB:
        raise ValueError(f"the Triton sampler handles a vocabulary of up to {MAX_VOCAB} ids in one block, got {vocab}")
    return triton.next_power_of_2(vocab)


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
    block = _vocab_block(vocab)
    logits = _rows(logits)
    noise = gumbel_table(logits.device)
    hi, lo = fixed_tables(logits.device)
    tile = _row_tile(rows, 1)
    chain, shape = _chain(lc, Phase.SAMPLE)
    K.sample_cb0_kernel[(triton.cdiv(rows, tile),)](
        batch.idx_mapping, _u8(batch.is_padding), batch.expected_serial, batch.num_scheduled, rows,
        table.state, table.serial, table.num_computed, table.prompt_len, table.error, table.finish_reason,
        table.fault, table.num_frames, table.seed, table.cb0_temperature, table.cb0_top_k, table.cb0_top_p,
        lc.rules, lc.state_class, chain, logits, logits.stride(0), vocab, noise if allowed is None else _u8(allowed),
        noise, hi, lo, -1 if eos_token_id is None else int(eos_token_id), tokens,
        table.cb0_penalty, table.cb0_counts, table.cb0_counts.stride(0), table.min_frames,
        **_rules(lc), **shape, HAS_ALLOWED=allowed is not None, APPLY_FILTERS=bool(batch.cb0_filters),
        HAS_PENALTY=bool(batch.cb0_penalty), HAS_SUPPRESS=bool(batch.cb0_min_frames) and eos_token_id is not None,
        PENALTY_AFTER=table.cb0_penalty_order == PENALTY_AFTER_FILTERS,
        BLOCK_R=tile, BLOCK_V=block, num_warps=_warps(block),
    )
    return tokens


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
        block = _vocab_block(vocab)
        logits = _rows(logits)
        noise = gumbel_table(logits.device)
        hi, lo = fixed_tables(logits.device)
        tile = _row_tile(n, 1)
        columns, apply = (table.mtp_temperature, table.mtp_top_k, table.mtp_top_p), filters
        if params is not None:  # a model-owned draw (e.g. MOSS's stop head): one value for every slot
            columns = tuple(torch.full_like(c, v) for c, v in zip(columns, (params.temperature, params.top_k,
                                                                          params.top_p)))
            apply = params.filters
        K.sample_mtp_kernel[(triton.cdiv(n, tile),)](
            slot, n, table.num_frames, table.seed, *columns,
            logits, logits.stride(0), vocab, int(codebook), noise, hi, lo, tokens, faults,
            APPLY_FILTERS=apply, BLOCK_R=tile, BLOCK_V=block, num_warps=_warps(block),
        )
        return tokens

    return sample, lambda: faults


def mtp_scatter(
    table: SlotTable, lc: DeviceLifecycle, batch: StepBatch, mtp_faults: torch.Tensor, mtp_stop: torch.Tensor | None = None,
    last: bool = False,
) -> None:
    """The MTP-phase stage chain (a lifecycle without one leaves every row as it is); last:
    the step's final stage, which flags rows left in-step (reference.mtp_scatter)."""
    rows = batch.num_rows
    if rows == 0 or not lc.has_stages(Phase.MTP):
        return
    chain, shape = _chain(lc, Phase.MTP)
    K.mtp_scatter_kernel[(triton.cdiv(rows, ROW_BLOCK),)](
        batch.idx_mapping, _u8(batch.is_padding), batch.expected_serial, mtp_faults,
        mtp_faults if mtp_stop is None else _u8(mtp_stop), rows,
        table.state, table.serial, table.finish_reason, table.error, table.fault, lc.rules, lc.state_class, chain,
        **_rules(lc), **shape, HAS_STOP=mtp_stop is not None, LAST=last, BLOCK=ROW_BLOCK,
    )


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
    frame_embeds = _rows(frame_embeds)
    block = _block(h)
    tile = _row_tile(rows, max(1, 1024 // block))
    chain, shape = _chain(lc, Phase.PUBLISH)
    K.publish_kernel[(triton.cdiv(rows, tile),)](
        batch.idx_mapping, _u8(batch.is_padding), batch.expected_serial, rows, table.state, table.serial,
        table.num_frames, table.max_frames, table.num_computed, table.finish_reason, table.error, lc.rules,
        lc.state_class, chain, codes, codes.stride(0), codes.stride(1), frame_embeds, frame_embeds.stride(0),
        table.frame_codes, table.frame_log, table.frame_embed, packed, packed.stride(0),
        table.max_context, h, q, table.cb0_counts, table.cb0_counts.stride(0), table.cb0_counts.shape[1],
        -1 if eoc is None else eoc, -1 if eos is None else eos, packed if accepted is None else _u8(accepted),
        **_rules(lc), **shape, BLOCK_R=tile, BLOCK_Q=triton.next_power_of_2(q), BLOCK_H=block, DELAY=eoc is not None,
        EOS_FRAME=eos is not None, ACCEPTED=accepted is not None, LAST=last,
    )
    return packed
