"""The torch stages' CB0 draw: sample rows with the model's history rules, for plain rows and verify positions alike."""

from __future__ import annotations

import torch

from ..sampling import sample_tokens
from ..sampling.penalties import PENALTY_BEFORE_TEMPERATURE, apply_repetition_penalty, suppress_eos
from ..slots import SlotTable
from .contract import StepBatch
from .row_ops import at


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
