"""The torch stages' shared row primitives: slot-column gathers and writes, the identity guard,
one phase's lifecycle move and its record in the table, and the CB0 draw of plain rows and
verify positions alike.

At a handful of rows a stage is dozens of tiny ops whose cost is the dispatcher's, not the
data's: `index_select` / `index_copy_` skip `Tensor.__getitem__`'s index parsing, and constant
operands are cached 0-dim device tensors (a Python number is wrapped into a tensor on every
op), which measured about half the cost of each such op on the CPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..lifecycle import DeviceLifecycle, Phase, Predicate
from ..lifecycle.phase_fold import PUBLISH_SENSITIVE
from ..sampling import sample_tokens
from ..sampling.penalties import PENALTY_BEFORE_TEMPERATURE, apply_repetition_penalty, suppress_eos
from ..slots import PROGRESS_SERIAL, WORD_ERROR, WORD_FAULT, WORD_REASON, SlotTable
from .contract import StepBatch


class PhaseResult(NamedTuple):
    """One phase's outcome per row: views of one gather from the phase's packed table."""

    state: torch.Tensor  # int32 new state
    reason: torch.Tensor  # int32 finish reason recorded by a fired edge (0 = none)
    published: torch.Tensor  # int32 1 where a fired edge emits a frame, else 0
    # int32 ERR_ILLEGAL where a total stage moved nothing or the row rests in an in-step state, else 0
    illegal: torch.Tensor


@functools.lru_cache(maxsize=None)
def const(value: int | float | bool, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A constant operand as a cached 0-dim device tensor (made before any graph capture: the
    engine's warm-up step runs every stage). The cache is functools' C one: a hit runs no
    Python frame. Under torch.compile dynamo traces the wrapped function, so the constant is
    the graph's own."""
    return torch.tensor(value, dtype=dtype, device=device)


def at(column: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """column[slot] (rows of a slot column)."""
    return column.index_select(0, slot)


def put(column: torch.Tensor, slot: torch.Tensor, value: torch.Tensor) -> None:
    """column[slot] = value (padding rows share the scratch row, whose content nothing reads)."""
    column.index_copy_(0, slot, value if value.dtype == column.dtype else value.to(column.dtype))


def progress_at(table: SlotTable, slot: torch.Tensor) -> torch.Tensor:
    """The rows' progress (serial, prompt_len, num_computed, num_frames, max_frames; int64
    [5, B], rows PROGRESS_*): one gather for every counter a stage tests."""
    return table.progress.index_select(1, slot)


def owns(progress: torch.Tensor, batch: StepBatch) -> torch.Tensor:
    """owned_rows from the rows' gathered progress."""
    return progress[PROGRESS_SERIAL] == batch.owner_serial


def owned_rows(table: SlotTable, batch: StepBatch) -> torch.Tensor:
    """Rows whose slot still belongs to the request the host scheduled (identity guard;
    a padding row's owner serial is one no slot holds)."""
    return at(table.progress[PROGRESS_SERIAL], batch.idx_mapping) == batch.owner_serial


def in_class(lc: DeviceLifecycle, state: torch.Tensor, class_bit: int) -> torch.Tensor:
    return lc.class_masks[class_bit].index_select(0, state)


def run_phase(lc: DeviceLifecycle, phase: Phase, state: torch.Tensor, owned: torch.Tensor,
              facts: dict[Predicate, torch.Tensor], after_publish: dict[Predicate, torch.Tensor] | None = None,
              *, last: bool = False) -> PhaseResult:
    """Every stage of `phase` over every row: one lookup of the phase's folded outcome
    (`lifecycle.phase_fold`) at (state, owned, predicate word). facts: the phase's predicate
    masks (one left out reads false); after_publish: the publish-sensitive predicates' values once a stage has published
    the row's frame (a later stage sees the frame counted); last: the phase ends the step, so
    a row resting in an in-step state is stuck. A publish-sensitive predicate without an
    after-publish value keeps its value through the phase."""
    given = after_publish or {}
    after = {p: given.get(p, facts[p]) for p in PUBLISH_SENSITIVE if p in facts or p in given}
    weights, _ = lc.weights[tuple(facts), tuple(after)]
    # The masks stacked alone (one dtype: a mixed stack promotes at a cost) into the predicate
    # word; the state indexes the table's own axis (no flat index to build: one advanced index
    # measured ~4.5 against ~8 us for multiply, add and index_select at one row).
    word = (torch.stack([owned, *facts.values(), *after.values()], dim=1) * weights).sum(dim=1)
    return PhaseResult(*lc.phase_rows[phase, last][:, state, word].unbind(0))


def words_at(table: SlotTable, slot: torch.Tensor) -> torch.Tensor:
    """The rows' lifecycle words (state, finish_reason, error, fault; int32 [4, B], rows WORD_*)."""
    return table.lifecycle_words.index_select(1, slot)


def record(table: SlotTable, slot: torch.Tensor, result: PhaseResult, words: torch.Tensor,
           fault: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A phase's moves into the table, given the rows' words as the phase read them
    (`words_at`): state, the finish reason an edge recorded, the sticky ERR_ILLEGAL bit of a
    stuck row and, given the phase's fault words, the `fault` column (a row's first fault
    word, kept where the phase ended the row on a bad sample, only while the column is still
    0), all four in one scatter. Returns the rows' (finish_reason, error) as written."""
    zero = const(0, torch.int32, slot.device)
    ended = result.reason != zero  # a row the step does not own records no reason
    reason = torch.where(ended, result.reason, words[WORD_REASON])
    error = words[WORD_ERROR] | result.illegal
    old_fault = words[WORD_FAULT]
    if fault is not None:  # where fault is 0, writing it keeps old's 0
        old_fault = torch.where(ended & (old_fault == zero), fault.to(torch.int32), old_fault)
    table.lifecycle_words.index_copy_(1, slot, torch.stack([result.state, reason, error, old_fault]))
    return reason, error


def flag(table: SlotTable, slot: torch.Tensor, mask: torch.Tensor, bit: int) -> None:
    """Set a sticky error bit on the rows where mask holds."""
    bits = torch.where(mask, const(bit, torch.int32, slot.device), const(0, torch.int32, slot.device))
    put(table.error, slot, at(table.error, slot) | bits)


def draw_cb0_rows(table: SlotTable, batch: StepBatch, logits: torch.Tensor, slots: torch.Tensor,
                  frame_index: torch.Tensor, counts: torch.Tensor | None, *, eos_token_id: int | None,
                  allowed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row i of `logits` draws frame frame_index[i] of the request in slots[i] (its sampling
    columns, counter noise and min_frames), with counts[i] as the repetition penalty's history
    (None: no row penalises, batch.cb0_penalty is False). The penalty goes where the model's
    order puts it (table.cb0_penalty_order, `sampling.penalties`). Returns (tokens, faults)."""
    suppress = batch.cb0_min_frames and eos_token_id is not None
    early = batch.cb0_penalty and table.cb0_penalty_order == PENALTY_BEFORE_TEMPERATURE

    def penalise(x: torch.Tensor) -> torch.Tensor:
        return apply_repetition_penalty(x, counts, at(table.cb0_penalty, slots))

    def rules(x: torch.Tensor) -> torch.Tensor:
        if early:
            x = penalise(x)
        if suppress:
            x = suppress_eos(x, eos_token_id, frame_index, at(table.min_frames, slots))
        return x

    return sample_tokens(
        logits, at(table.cb0_temperature, slots), at(table.cb0_top_k, slots), at(table.cb0_top_p, slots),
        at(table.seed, slots), frame_index, 0, allowed=allowed, apply_filters=batch.cb0_filters,
        top_k_max=batch.cb0_top_k_max, any_top_p=batch.cb0_any_top_p, top_k_min=batch.cb0_top_k_min,
        rules=rules if early or suppress else None, late=penalise if batch.cb0_penalty and not early else None,
    )
