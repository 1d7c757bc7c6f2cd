"""Torch reference kernels: one function per transition stage, guard-masked over all rows.

This is the CPU path and the contract the Triton kernels are tested against. Each stage
reads the transition table for its state updates (never a hand-written next state),
applies its guard as a mask over every row (no per-request Python loop) and never reads
a device value on the host.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..lifecycle import FinishReason, State, Trigger
from ..sampling import frame_key, gumbel_noise_codebooks, sample_tokens
from ..slots import ERR_IDENTITY, ERR_ILLEGAL, ERR_SPAN, SlotTable
from .contract import ReplayFrames, StagedAdmits, StagedEvents, StepBatch

TextStep = Callable[[dict, torch.Tensor, torch.Tensor], torch.Tensor]

# Draw a frame's MTP noise in one pass (fewer, larger ops) up to this many elements.
BATCHED_NOISE_ELEMENTS = 1 << 17  # measured: larger blocks fall out of cache and lose

# Layout of the packed per-row output (one device-to-host copy per step).
OUT_VALID, OUT_FRAME_INDEX, OUT_STATE, OUT_REASON, OUT_ERROR, OUT_NUM_FRAMES, OUT_CODES = range(7)


def fire(trans: torch.Tensor, trigger: Trigger, state: torch.Tensor, mask: torch.Tensor):
    """Apply `trigger` to rows in `mask`: (new state, illegal mask). Illegal rows keep state."""
    dest = trans[int(trigger)][state.long()]
    illegal = mask & (dest < 0)
    return torch.where(mask & ~illegal, dest, state), illegal


def _is_live(state: torch.Tensor) -> torch.Tensor:
    return (state == State.WAITING) | (state == State.PREFILLING) | (state == State.DECODING)


def _is_terminal(state: torch.Tensor) -> torch.Tensor:
    return (state == State.FINISHED) | (state == State.ABORTED)


def _owned(table: SlotTable, batch: StepBatch) -> torch.Tensor:
    """Rows whose slot still belongs to the request the host scheduled (identity guard)."""
    return ~batch.is_padding & (table.serial[batch.idx_mapping] == batch.expected_serial)


def _flag(table: SlotTable, slots: torch.Tensor, mask: torch.Tensor, bit: int) -> None:
    table.error[slots] = table.error[slots] | torch.where(mask, bit, 0).to(torch.int32)


def apply_host_events(table: SlotTable, trans: torch.Tensor, events: StagedEvents) -> None:
    """Stage 1a: abort / preempt / release chains, one pass per chain position."""
    slots = events.slots
    state = table.state[slots]
    for k in range(events.triggers.shape[1]):
        trig = events.triggers[:, k]
        has = trig >= 0
        dest = trans[trig.clamp(min=0), state.long()]
        illegal = has & (dest < 0)
        state = torch.where(has & ~illegal, dest, state)
        _flag(table, slots, illegal, ERR_ILLEGAL)
    table.state[slots] = state
    table.finish_reason[slots] = torch.where(events.reasons != 0, events.reasons, table.finish_reason[slots])
    table.serial[slots] = torch.where(state == State.FREE, 0, table.serial[slots])


def apply_admits(table: SlotTable, trans: torch.Tensor, admits: StagedAdmits) -> None:
    """Stage 1b: every column of each admitted row re-initialised, then its values written."""
    slots = admits.slots
    new_state, illegal = fire(trans, Trigger.ADMIT, table.state[slots], torch.ones_like(slots, dtype=torch.bool))
    defaults = table.column_defaults()
    for name, column in table.columns().items():
        if name in ("state", "error"):
            continue
        column[slots] = defaults[name]  # a host scalar: no per-column device copy
        value = admits.values.get(name)
        if value is None:
            continue
        if value.shape[1:] == column.shape[1:]:
            column[slots] = value.to(column.dtype)
        else:  # a shorter leading dimension (variable-length sequences)
            length = value.shape[1]
            positions = torch.arange(length, device=column.device)
            column[slots[:, None], positions[None, :]] = value.to(column.dtype)
    table.error[slots] = torch.where(illegal, ERR_ILLEGAL, 0).to(torch.int32)
    table.state[slots] = new_state


def replay_frames(table: SlotTable, replay: ReplayFrames, frame_embed, text_step: TextStep) -> None:
    """Resume: rebuild the inputs that carried already-published frames into the prompt rows."""
    embeds = frame_embed(replay.codes) + text_step(table.extra, replay.slots, replay.frame_index)
    table.prompt_embeds[replay.slots, replay.positions] = embeds.to(table.prompt_embeds.dtype)


def compose_inputs(table: SlotTable, batch: StepBatch, text_step: TextStep):
    """Stage 2: prefill tokens take their prompt rows; decode rows take frame embed + text step.

    Returns (inputs_embeds [T, H], positions [T], token_slots [T]; -1 = inert token).
    """
    slot = batch.idx_mapping
    state = table.state[slot]
    owned = _owned(table, batch)
    live = owned & _is_live(state)
    computed = table.num_computed[slot]
    prompt_len = table.prompt_len[slot]
    prefill = computed < prompt_len
    # Phase comes from num_computed < prompt_len, never from the span length.
    bad_span = live & torch.where(
        prefill, computed + batch.num_scheduled > prompt_len, (batch.num_scheduled != 1) | (state != State.DECODING)
    )
    _flag(table, slot, bad_span, ERR_SPAN)
    _flag(table, slot, ~batch.is_padding & ~owned, ERR_IDENTITY)
    frame_index = (table.num_frames[slot] - 1).clamp(min=0)
    decode_input = table.frame_embed[slot] + text_step(table.extra, slot, frame_index).to(table.frame_embed.dtype)
    rows = batch.token_rows
    positions = computed[rows] + batch.token_offsets
    prompt_input = table.prompt_embeds[slot[rows], positions.clamp(max=table.max_context - 1)]
    inputs = torch.where(prefill[rows, None], prompt_input, decode_input[rows])
    usable = live & ~bad_span
    token_slots = torch.where(usable[rows], slot[rows], -1)
    return inputs, positions, token_slots


def sample_cb0(
    table: SlotTable,
    trans: torch.Tensor,
    batch: StepBatch,
    logits: torch.Tensor,
    *,
    eos_token_id: int | None,
    allowed: torch.Tensor | None,
) -> torch.Tensor:
    """Stage 4: counters, CB0 sampling with the EOS guard, and the state update, fused.

    Non-final prefill chunks fire `prefill`; final chunks and decode rows fire `sample`
    (then `eos` when CB0 is the codec EOS); a non-finite row aborts with reason error; a
    terminal row scheduled again fires `overrun` and is otherwise inert.
    """
    slot = batch.idx_mapping
    state = table.state[slot]
    owned = _owned(table, batch)
    live = owned & _is_live(state)
    computed = table.num_computed[slot] + torch.where(live, batch.num_scheduled, 0)
    kept = live & (computed >= table.prompt_len[slot])
    tokens, bad = sample_tokens(
        logits, table.cb0_temperature[slot], table.cb0_top_k[slot], table.cb0_top_p[slot],
        table.seed[slot], table.num_frames[slot], 0, allowed=allowed, apply_filters=batch.cb0_filters,
        top_k_max=batch.cb0_top_k_max, any_top_p=batch.cb0_any_top_p,
    )
    ok = kept & ~bad
    new, ill_prefill = fire(trans, Trigger.PREFILL, state, live & ~kept)
    sampled, ill_sample = fire(trans, Trigger.SAMPLE, state, ok)
    new = torch.where(ok, sampled, new)
    eos = ok & (tokens == eos_token_id) if eos_token_id is not None else torch.zeros_like(ok)
    new, ill_eos = fire(trans, Trigger.EOS, new, eos)
    new, ill_abort = fire(trans, Trigger.ABORT, new, kept & bad)
    new, ill_overrun = fire(trans, Trigger.OVERRUN, new, owned & _is_terminal(state) & (batch.num_scheduled > 0))
    reason = table.finish_reason[slot]
    reason = torch.where(eos, int(FinishReason.EOS), reason)
    reason = torch.where(kept & bad, int(FinishReason.ERROR), reason).to(torch.int32)
    table.num_computed[slot] = computed
    table.state[slot] = new
    table.finish_reason[slot] = reason
    table.last_cb0[slot] = torch.where(ok, tokens, table.last_cb0[slot])
    _flag(table, slot, ill_prefill | ill_sample | ill_eos | ill_abort | ill_overrun, ERR_ILLEGAL)
    return tokens


def mtp_sampler(table: SlotTable, batch: StepBatch):
    """The CodebookSampler handed to the model's MTP hook, plus its per-row bad flags."""
    slot = batch.idx_mapping
    bad = torch.zeros(slot.shape, dtype=torch.bool, device=slot.device)
    temperature, top_k, top_p = table.mtp_temperature[slot], table.mtp_top_k[slot], table.mtp_top_p[slot]
    seed, frame_index = table.seed[slot], table.num_frames[slot]
    key = frame_key(seed, frame_index)  # shared by the frame's Q-1 codebooks
    drawn: dict[int, torch.Tensor | None] = {}  # vocab -> noise of codebooks 1..Q-1

    def noise_for(codebook: int, vocab: int) -> torch.Tensor | None:
        count = table.num_codebooks - 1
        if vocab not in drawn:
            # Decided by the table's size, never the step's row count, so a step's work
            # (and its op count) does not depend on how many rows it has.
            fits = count * (table.max_slots + 1) * vocab <= BATCHED_NOISE_ELEMENTS
            drawn[vocab] = gumbel_noise_codebooks(key, 1, count, vocab) if fits else None
        block = drawn[vocab]
        return block[codebook - 1] if block is not None and 1 <= codebook <= count else None

    def sample(logits: torch.Tensor, codebook: int) -> torch.Tensor:
        tokens, row_bad = sample_tokens(
            logits, temperature, top_k, top_p, seed, frame_index, codebook, apply_filters=batch.mtp_filters,
            key=key, top_k_max=batch.mtp_top_k_max, any_top_p=batch.mtp_any_top_p,
            noise=noise_for(codebook, logits.shape[-1]),
        )
        bad.logical_or_(row_bad)
        return tokens

    return sample, bad


def mtp_scatter(table: SlotTable, trans: torch.Tensor, batch: StepBatch, mtp_bad: torch.Tensor) -> None:
    """Stage 5: rows whose CB0 was kept get their frame (`mtp`) or abort on a bad MTP row."""
    slot = batch.idx_mapping
    state = table.state[slot]
    sampled = _owned(table, batch) & (state == State.SAMPLED)
    new, ill_mtp = fire(trans, Trigger.MTP, state, sampled & ~mtp_bad)
    new, ill_abort = fire(trans, Trigger.ABORT, new, sampled & mtp_bad)
    table.state[slot] = new
    table.finish_reason[slot] = torch.where(sampled & mtp_bad, int(FinishReason.ERROR), table.finish_reason[slot]).to(
        torch.int32
    )
    _flag(table, slot, ill_mtp | ill_abort, ERR_ILLEGAL)


def publish_frames(
    table: SlotTable, trans: torch.Tensor, batch: StepBatch, codes: torch.Tensor, frame_embeds: torch.Tensor
) -> torch.Tensor:
    """Stage 5b: frame cache, counters, publication into the packed output, length check.

    Returns the packed per-row output [B, OUT_CODES + Q] (int64) for the single copy.
    """
    slot = batch.idx_mapping
    state = table.state[slot]
    ready = _owned(table, batch) & (state == State.FRAME_READY)
    frame_index = table.num_frames[slot]
    num_frames = frame_index + ready.long()
    new, ill_publish = fire(trans, Trigger.PUBLISH, state, ready)
    # The next input would sit at position num_computed: stop when it no longer fits.
    length = ready & ((num_frames >= table.max_frames[slot]) | (table.num_computed[slot] >= table.max_context))
    new, ill_length = fire(trans, Trigger.FINISH_LENGTH, new, length)
    table.frame_codes[slot] = torch.where(ready[:, None], codes, table.frame_codes[slot])
    log_at = frame_index.clamp(max=table.max_context - 1)
    table.frame_log[slot, log_at] = torch.where(ready[:, None], codes, table.frame_log[slot, log_at])
    table.frame_embed[slot] = torch.where(ready[:, None], frame_embeds.to(table.frame_embed.dtype), table.frame_embed[slot])
    table.num_frames[slot] = num_frames
    table.state[slot] = new
    table.finish_reason[slot] = torch.where(length, int(FinishReason.LENGTH), table.finish_reason[slot]).to(torch.int32)
    _flag(table, slot, ill_publish | ill_length, ERR_ILLEGAL)
    columns = [ready.long(), frame_index, new.long(), table.finish_reason[slot].long(), table.error[slot].long(), num_frames]
    return torch.cat([torch.stack(columns, dim=1), torch.where(ready[:, None], codes, 0)], dim=1)
