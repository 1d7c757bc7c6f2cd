"""The host request table (per-slot numpy columns, the one owner of every request's state and
counters on the host) and the request records, which are views of their row."""

from __future__ import annotations

import numpy as np
import torch

from ..lifecycle import FinishReason, State
from ..model_api import FEED_COUNT, FEED_DONE, FEED_ROWS, PreparedPrompt
from .plan import NewRequest

_LABELS = tuple(s.label for s in State)
_CODES = {s.label: int(s) for s in State}
# The counters a row holds (its state too): per slot in the table, parked in the record when it holds none.
COUNTERS = ("state", "serial", "prompt_len", "num_computed", "num_frames", "reason")
# The columns each step's device output writes, in the packed output's order (contract.OUT_STATE
# onwards): one block of the table, so `Ledger.observe` takes them in one assignment.
DEVICE_WRITTEN = ("state", "reason", "num_frames", "num_computed")


class RequestTable:
    """One row per slot (the last is the scratch row of padding tokens), numpy columns.

    Writers, one per phase of a step (README, "One owner for each field"):
      state       host events through the `transitions` machine (its model is a record, whose
                  `state` is this column), then the step's device output (`Ledger.observe`);
      serial, prompt_len
                  admission and resume (`Ledger.stage`);
      num_computed, num_frames, reason
                  the step's device output (`Ledger.observe`), set at admission / resume.
    A request without a slot (queued, preempted) keeps the same fields parked in its record."""

    def __init__(self, rows: int) -> None:
        # [rows, len(DEVICE_WRITTEN)]: the device-written columns are views of this block.
        self.device_written = np.zeros((rows, len(DEVICE_WRITTEN)), dtype=np.int64)
        for i, name in enumerate(DEVICE_WRITTEN):
            setattr(self, name, self.device_written[:, i])
        for name in COUNTERS:
            if name not in DEVICE_WRITTEN:
                setattr(self, name, np.zeros(rows, dtype=np.int64))


class _Counter:
    """A record's counter: its table row's column while it holds a slot, else its parked value."""

    def __set_name__(self, owner, name: str) -> None:
        self.column = name

    def __get__(self, record, owner=None):
        return self if record is None else record._get(self.column)

    def __set__(self, record, value: int) -> None:
        record._set(self.column, value)


class RequestRecord:
    """What the host knows of one request: its table row (or its parked counters while it
    holds no slot) and what resume needs (the prepared prompt, the published frames' codes
    captured from the device log at preemption, the conditioning rows fed so far).

    It is also the `transitions` model of its host events (the engine's machine reads and
    writes its `label`): the label is the row's state column, so the machine and the table
    can never disagree."""

    __slots__ = ("request", "prepared", "table", "slot", "_parked", "replay_codes", "feed", "feed_done", "sampling",
                 "min_frames")

    def __init__(self, request: NewRequest, table: RequestTable, prepared: PreparedPrompt) -> None:
        self.request = request
        self.prepared = prepared
        self.table = table
        self.slot: int | None = None
        prompt_len = int(prepared.prompt_embeds.shape[0])
        self._parked = {"state": int(State.FREE), "serial": 0, "prompt_len": prompt_len, "num_computed": 0,
                        "num_frames": 0, "reason": int(FinishReason.NONE)}
        self.replay_codes: torch.Tensor | None = None  # [n, Q] frames published before preemption
        # Conditioning rows received so far (host copy: a resumed request re-uploads them).
        self.feed: torch.Tensor | None = prepared.feed
        self.feed_done = bool(prepared.feed_done)
        # What the rows run with, resolved against the model once (admission.resolved).
        self.sampling: tuple | None = None
        self.min_frames = 0

    # -- the row ---------------------------------------------------------------------------

    def _get(self, name: str) -> int:
        return int(getattr(self.table, name)[self.slot]) if self.slot is not None else self._parked[name]

    def _set(self, name: str, value: int) -> None:
        if self.slot is not None:
            getattr(self.table, name)[self.slot] = value
        else:
            self._parked[name] = int(value)

    def attach(self, slot: int) -> None:
        """Move the parked counters into `slot`'s row (admission, resume)."""
        for name in COUNTERS:
            getattr(self.table, name)[slot] = self._parked[name]
        self.slot = slot

    def detach(self, vacant: int) -> None:
        """Park the row's counters here and leave the row `vacant` (release, abort, preemption)."""
        slot = self.slot
        self._parked = {name: int(getattr(self.table, name)[slot]) for name in COUNTERS}
        for name in COUNTERS:
            getattr(self.table, name)[slot] = 0
        self.table.state[slot] = vacant
        self.slot = None

    @property
    def label(self) -> str:  # the transitions model attribute (Oracle(model_attribute="label"))
        return _LABELS[self._get("state")]

    @label.setter
    def label(self, value: str) -> None:
        self._set("state", _CODES[value])

    @property
    def state(self) -> State:
        return State(self._get("state"))

    code = state
    serial = _Counter()
    prompt_len = _Counter()
    num_computed = _Counter()
    num_frames = _Counter()

    @property
    def finish_reason(self) -> FinishReason:
        return FinishReason(self._get("reason"))

    # -- request facts ---------------------------------------------------------------------

    @property
    def request_id(self) -> str:
        return self.request.request_id

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
    def base_prompt_len(self) -> int:
        """The request's own prompt (prompt_len adds the frames a resume replays)."""
        return int(self.prepared.prompt_embeds.shape[0])

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prompt_len

    def __repr__(self) -> str:
        return (
            f"RequestRecord({self.request_id!r}, state={self.label}, slot={self.slot}, serial={self.serial}, "
            f"computed={self.num_computed}/{self.prompt_len}, frames={self.num_frames})"
        )
