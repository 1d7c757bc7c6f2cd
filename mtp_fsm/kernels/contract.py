"""The device-side inputs every kernel backend shares: a step's batch and staged events."""

from __future__ import annotations

from typing import Callable

import attrs
import torch

# The model's text step, as the stages call it: (model columns, slots, frame index) -> [B, H].
TextStep = Callable[[dict, torch.Tensor, torch.Tensor], torch.Tensor]

# Layout of the packed per-row output every backend writes (one device-to-host copy per step).
# OUT_STATE..OUT_CODES are the host request table's device-written columns in its own order
# (records.DEVICE_WRITTEN), so the host takes them in one block assignment per step.
OUT_VALID, OUT_FRAME_INDEX, OUT_ERROR, OUT_STATE, OUT_REASON, OUT_NUM_FRAMES, OUT_NUM_COMPUTED, OUT_CODES = range(8)


@attrs.frozen
class StagedEvents:
    """Host events applied at the step boundary: up to two triggers per slot, in order."""

    slots: torch.Tensor  # int64 [E]
    triggers: torch.Tensor  # int64 [E, 2], -1 = none
    reasons: torch.Tensor  # int32 [E], finish reason to record (0 = keep)


@attrs.frozen
class StagedAdmits:
    """Rows to (re)initialise: every column reset, then the given leading slices written,
    and `trigger` (the host's admission trigger, read from the table) fired on each row."""

    slots: torch.Tensor  # int64 [A]
    values: dict[str, torch.Tensor]  # column name -> [A, ...] (leading slice of the column)
    trigger: int


@attrs.frozen
class ReplayFrames:
    """Published frames of resumed requests, to be re-embedded into their prompt rows."""

    slots: torch.Tensor  # int64 [N]
    frame_index: torch.Tensor  # int64 [N]
    positions: torch.Tensor  # int64 [N], prompt position that carries the frame
    codes: torch.Tensor  # int64 [N, Q]


@attrs.frozen
class StepBatch:
    """One step's rows. Rows map to slots via idx_mapping; padding rows point at the
    scratch row (index max_slots) and have live=False; rows are never reordered."""

    idx_mapping: torch.Tensor  # int64 [B], slot per row, scratch row for padding
    is_padding: torch.Tensor  # bool [B]
    expected_serial: torch.Tensor  # int64 [B]
    num_scheduled: torch.Tensor  # int64 [B]
    query_start_loc: torch.Tensor  # int64 [B + 1]
    token_rows: torch.Tensor  # int64 [T], row of each token
    token_offsets: torch.Tensor  # int64 [T], offset within the row's span
    last_token: torch.Tensor  # int64 [B], index of the row's last token (0 for empty rows)
    cb0_filters: bool  # some row restricts CB0 top-k/top-p (host-known: no sync)
    mtp_filters: bool
    # Host-known shortcuts for the sampler (never change a result): the largest top_k of
    # the rows, and whether any row uses top-p. None / True mean "unknown": full sort.
    cb0_top_k_max: int | None = None
    cb0_any_top_p: bool = True
    mtp_top_k_max: int | None = None
    mtp_any_top_p: bool = True
    # The smallest top_k among rows that sample (sampler.sample_tokens' top_k_min; None = unknown).
    cb0_top_k_min: int | None = None
    mtp_top_k_min: int | None = None
    # Host-known: some row has a CB0 repetition penalty != 1 / a min_frames > 0 (False
    # skips that work; True is always correct).
    cb0_penalty: bool = True
    cb0_min_frames: bool = True
    # Tokens of a decode row: 1, or 1 + k under speculative decoding (the last accepted
    # token, then k drafts at the following positions).
    decode_width: int = 1
    # Host-known: some row may still be in its prompt (False lets compose skip the prompt
    # gather of an all-decode batch; True is always correct).
    has_prefill: bool = True
    # Host-known: token i is row i's only token (token_rows is arange(B), token_offsets 0);
    # True lets compose skip its per-token gathers, False is always correct.
    tokens_are_rows: bool = False
    # Tokens in the step (token_rows' length), host-known: stored once, read every step.
    num_tokens: int = attrs.field(init=False)
    # Derived once per batch (a steady decode batch is one object over many steps), so a
    # stage tests ownership in two ops: not padding (bool [B]), and the serial a row's slot
    # must hold for the row to own it (int64 [B]; -1, which no slot holds, on padding rows).
    scheduled: torch.Tensor = attrs.field(init=False)
    owner_serial: torch.Tensor = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "num_tokens", int(self.token_rows.shape[0]))
        object.__setattr__(self, "scheduled", ~self.is_padding)
        object.__setattr__(self, "owner_serial", torch.where(self.is_padding, -1, self.expected_serial))

    @property
    def num_rows(self) -> int:
        return int(self.idx_mapping.shape[0])
