"""The step-boundary stages, torch: host events' chains (release, abort, preempt), admissions
(every column re-initialised) and a resumed request's replayed frames."""

from __future__ import annotations

import torch

from ..lifecycle import CLASS_VACANT, DeviceLifecycle
from ..lifecycle.device_tables import RULE_DEST
from ..slots import ERR_ILLEGAL, SlotTable
from .contract import ReplayFrames, StagedAdmits, StagedEvents, TextStep
from .row_ops import flag, in_class


def apply_host_events(table: SlotTable, lc: DeviceLifecycle, events: StagedEvents) -> None:
    """Stage 1a: abort / preempt / release chains, one pass per chain position."""
    slots = events.slots
    state = table.state[slots]
    dest_table = lc.rules[RULE_DEST]
    for k in range(events.triggers.shape[1]):
        trig = events.triggers[:, k]
        has = trig >= 0
        dest = dest_table[trig.clamp(min=0), state.long()]
        illegal = has & (dest < 0)
        state = torch.where(has & ~illegal, dest, state)
        flag(table, slots, illegal, ERR_ILLEGAL)
    table.state[slots] = state
    table.finish_reason[slots] = torch.where(events.reasons != 0, events.reasons, table.finish_reason[slots])
    table.serial[slots] = torch.where(in_class(lc, state, CLASS_VACANT), 0, table.serial[slots])


def apply_admits(table: SlotTable, lc: DeviceLifecycle, admits: StagedAdmits) -> None:
    """Stage 1b: every column of each admitted row re-initialised, then its values written."""
    slots = admits.slots
    dest = lc.rules[RULE_DEST, admits.trigger, table.state[slots].long()]
    illegal = dest < 0
    new_state = torch.where(illegal, table.state[slots], dest)
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
