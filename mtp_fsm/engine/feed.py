"""The conditioning feed (Qwen3-Omni thinker rows): rows arriving over time, and the
`starved` rest state of a decoding request whose next row has not arrived."""

from __future__ import annotations

import torch

from ..errors import PlanError
from ..kernels.contract import StagedEvents
from ..lifecycle import FinishReason, State, Trigger
from ..model_api import FEED_COUNT, FEED_DONE, FEED_ROWS
from .ledger import Ledger
from .records import RequestRecord


class FeedError(PlanError):
    """A feed call that cannot be applied (unknown or ended request, bad rows, over capacity);
    nothing was changed."""


def needed_row(record: RequestRecord) -> int:
    """The conditioning row a request's next decode step reads: its text step carries the
    last published frame, frame_index = num_frames - 1 (see compose_inputs)."""
    return max(record.num_frames - 1, 0)


class ConditioningFeed:
    """Appends fed rows (host copy + the slot's device columns) and moves requests between
    `decoding` and `starved` through the lifecycle's STARVE / FEED host triggers."""

    def __init__(self, ledger: Ledger, kernels, lifecycle) -> None:
        self.ledger, self.kernels, self.lc = ledger, kernels, lifecycle
        spec = ledger.spec
        self.enabled = spec.has_feed
        self.capacity, self.width = spec.feed_capacity, spec.feed_width or spec.hidden_size

    def feed(self, request_id: str, rows: torch.Tensor | None, done: bool) -> None:
        if not self.enabled:
            raise FeedError(request_id, None, f"model {self.ledger.spec.name!r} takes no conditioning feed")
        ledger = self.ledger
        record = ledger.records.get(request_id) or ledger.queued.get(request_id)
        if record is None:
            raise FeedError(request_id, None, "fed but not in the engine (never added, or already ended and released)")
        state = record.state
        if state in ledger.terminal_states:
            raise FeedError(request_id, state.label, "fed after it ended")
        if record.feed_done:
            raise FeedError(request_id, state.label, "fed after its feed was declared done")
        rows = self._checked_rows(record, rows)
        start = record.feed_count
        record.feed = rows if record.feed is None else torch.cat([record.feed, rows])
        record.feed_done = bool(done)
        if record.slot is not None:  # between steps: the slot's columns take the rows now
            extra = ledger.table.extra
            extra[FEED_ROWS][record.slot, start: start + len(rows)] = rows.to(extra[FEED_ROWS].device)
            extra[FEED_COUNT][record.slot] = record.feed_count
            extra[FEED_DONE][record.slot] = int(record.feed_done)
        self.refresh([record])

    def _checked_rows(self, record: RequestRecord, rows: torch.Tensor | None) -> torch.Tensor:
        rid, state = record.request_id, record.state.label
        if rows is None:
            rows = torch.zeros(0, self.width)
        if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.shape[1] != self.width:
            shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
            raise FeedError(rid, state, f"conditioning rows must be a tensor [n, {self.width}], got {shape}")
        if not rows.is_floating_point() or not bool(torch.isfinite(rows).all()):
            raise FeedError(rid, state, "conditioning rows must be finite floating-point values")
        if record.feed_count + len(rows) > self.capacity:
            raise FeedError(rid, state, f"{record.feed_count} + {len(rows)} conditioning rows exceed the model's "
                            f"capacity of {self.capacity}")
        return rows.detach().to("cpu", self.ledger.spec.dtype).clone()

    def refresh(self, records=None) -> None:
        """Fire STARVE for decoding requests missing their next row and FEED for starved ones
        that have it, at a step boundary (host mirror and device row, through the table)."""
        if not self.enabled:
            return
        ledger = self.ledger
        slots, triggers = [], []
        for record in ledger.records.values() if records is None else records:
            if record.slot is None:
                continue
            # Which one, if any, may fire from the request's state is the spec's to say.
            trigger = Trigger.FEED if record.has_feed_row(needed_row(record)) else Trigger.STARVE
            if not ledger.oracle.may(record, trigger):
                continue
            ledger.oracle.fire(record, trigger)  # writes the request table's row
            slots.append(record.slot)
            triggers.append([int(trigger), -1])
        if slots:
            device = ledger.table.device
            self.kernels.apply_host_events(ledger.table, self.lc, StagedEvents(
                torch.tensor(slots, dtype=torch.int64, device=device),
                torch.tensor(triggers, dtype=torch.int64, device=device),
                torch.full((len(slots),), int(FinishReason.NONE), dtype=torch.int32, device=device),
            ))

    def num_starved(self) -> int:
        ledger = self.ledger
        starved = sum(r.state is State.STARVED for r in ledger.records.values() if r.slot is not None)
        waiting = sum(not ledger.ready_to_resume(r) for r in ledger.records.values() if r.slot is None)
        return starved + waiting
