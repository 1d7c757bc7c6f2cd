"""The speculative verify loop run position by position (the engine's executor before verify positions became rows): a test reference for `SpeculativeStep.verify_positions`."""

from __future__ import annotations

import attrs
import torch

from ..kernels.contract import OUT_ERROR, OUT_NUM_COMPUTED, OUT_NUM_FRAMES, OUT_REASON, OUT_STATE, StepBatch


def position_batch(batch: StepBatch, verify: torch.Tensor, j: int) -> StepBatch:
    """The rows as verify position j's stages see them: a verify row has one token there
    (its sample position is its j-th token); at j > 0 every other row is padding (a prefill
    row samples once, at its last token, in position 0)."""
    starts = batch.query_start_loc[:-1]
    if j == 0:
        return attrs.evolve(batch, num_scheduled=torch.where(verify, 1, batch.num_scheduled),
                            last_token=torch.where(verify, starts, batch.last_token))
    return attrs.evolve(batch, is_padding=batch.is_padding | ~verify, num_scheduled=torch.ones_like(batch.num_scheduled),
                        last_token=torch.where(verify, starts + j, batch.last_token))


def verify_position_by_position(step, batch: StepBatch, verify: torch.Tensor, drafts: torch.Tensor,
                                hidden: torch.Tensor) -> torch.Tensor:
    """What `step.verify_positions(batch, verify, drafts, hidden)` computes, one position at a
    time: the head, the kernels' `sample_cb0` (the table's own counts and frame index as the
    earlier positions left them) and `publish_frames` (DRAFT_ACCEPTED from this position's
    token) per position; every position's row columns filled after the loop."""
    table, kern, lc, k = step.table, step.kernels, step._lc, drafts.shape[1]
    slot = batch.idx_mapping
    packed = []
    for j in range(k + 1):
        sub = position_batch(batch, verify, j)
        tokens = kern.sample_cb0(table, lc, sub, step._cb0_logits(hidden[sub.last_token]),
                                 eos_token_id=step.spec.eos_token_id, allowed=step._allowed)
        accepted = verify & (tokens == drafts[:, j]) if j < k else torch.zeros_like(verify)
        codes = tokens[:, None]
        packed.append(kern.publish_frames(table, lc, sub, codes, step._frame_embed(codes), accepted=accepted.contiguous(),
                                          last=False))
    out = torch.stack(packed, dim=1)
    for column, values in ((OUT_STATE, table.state), (OUT_REASON, table.finish_reason), (OUT_ERROR, table.error),
                           (OUT_NUM_FRAMES, table.num_frames), (OUT_NUM_COMPUTED, table.num_computed)):
        out[:, :, column] = values[slot].to(out.dtype)[:, None]
    return out.reshape(-1, out.shape[-1])
