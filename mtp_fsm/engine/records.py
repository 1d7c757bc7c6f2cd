"""Host-side request records: the oracle FSM, slot ownership and the published-frame log."""

from __future__ import annotations

import torch

from ..lifecycle import FinishReason, RequestFSM, State
from ..model_api import FEED_COUNT, FEED_DONE, FEED_ROWS, PreparedPrompt
from .plan import NewRequest


class RequestRecord:
    """What the host knows of one request: its oracle FSM, its slot, the host-computed
    counters, and what resume needs (the prepared prompt, and the published frames'
    codes captured from the device log at preemption). State and frame counts of a
    request holding a slot are synced from the ledger's mirror of the device."""

    __slots__ = (
        "request", "fsm", "prepared", "slot", "serial", "prompt_len", "num_computed",
        "num_frames", "finish_reason", "replay_codes", "feed", "feed_done", "sampling", "min_frames",
    )

    def __init__(self, request: NewRequest, fsm: RequestFSM, prepared: PreparedPrompt) -> None:
        self.request = request
        self.fsm = fsm
        self.prepared = prepared
        self.slot: int | None = None
        self.serial = 0
        self.prompt_len = int(prepared.prompt_embeds.shape[0])
        self.num_computed = 0
        self.num_frames = 0
        self.finish_reason = FinishReason.NONE
        self.replay_codes: torch.Tensor | None = None  # [n, Q] frames published before preemption
        # Conditioning rows received so far (host copy: a resumed request re-uploads them).
        self.feed: torch.Tensor | None = prepared.feed
        self.feed_done = bool(prepared.feed_done)
        # What the rows run with, resolved against the model once (staging.resolved).
        self.sampling: tuple | None = None
        self.min_frames = 0

    @property
    def feed_count(self) -> int:
        return 0 if self.feed is None else int(self.feed.shape[0])

    def has_feed_row(self, index: int) -> bool:
        """Whether the text step reading conditioning row `index` can run."""
        return index < self.feed_count or self.feed_done

    def column_value(self, name: str) -> torch.Tensor | None:
        """A slot column's value at admission: the engine-owned feed columns from this
        record, the model's own from the prepared prompt."""
        if name == FEED_ROWS:
            return self.feed
        if name == FEED_COUNT:
            return torch.tensor(self.feed_count)
        if name == FEED_DONE:
            return torch.tensor(int(self.feed_done))
        return self.prepared.columns.get(name)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def state(self) -> State:
        return self.fsm.code

    @property
    def base_prompt_len(self) -> int:
        """The request's own prompt (prompt_len adds the frames a resume replays)."""
        return int(self.prepared.prompt_embeds.shape[0])

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prompt_len

    def __repr__(self) -> str:
        return (
            f"RequestRecord({self.request_id!r}, state={self.state.label}, slot={self.slot}, serial={self.serial}, "
            f"computed={self.num_computed}/{self.prompt_len}, frames={self.num_frames})"
        )
