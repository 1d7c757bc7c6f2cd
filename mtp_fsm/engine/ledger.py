"""The host ledger: owns the request table, the records viewing it and the queue (its `registry`
side); stages a StepPlan all-or-nothing (its host events through `host_events`, its rows checked
against the table, here on arrays for the steady decode batch, else by `row_checks`, and loaded
by `step_inputs`) and writes the step's device output into the table."""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable

import attrs
import numpy as np
import torch

from ..kernels.contract import (
    OUT_CODES, OUT_REASON, OUT_STATE, ReplayFrames, StagedAdmits, StagedEvents,
    StepBatch,
)
from ..lifecycle import HOST_TRIGGERS, CompiledLifecycle, FinishReason, Oracle
from ..model_api import TalkerModel
from ..slots import SlotTable
from .outputs import FinishedRequest
from .plan import Span, StepPlan
from .host_events import NO_EVENTS, HostEvents
from .records import RequestRecord
from .registry import RequestRegistry
from .row_checks import check_rows
from .step_inputs import LoadedRows, StepInputs

_NO_IDS: frozenset[str] = frozenset()
_NO_PREPARED = MappingProxyType({})  # the steady step admits nothing


@attrs.define
class HostStep:
    """A validated, committed plan: what the device stages receive, and host bookkeeping.
    Its rows are the step inputs' loaded rows (their views below), never a copy of them."""

    events: StagedEvents | None
    admits: StagedAdmits | None
    replay: ReplayFrames | None
    rows: LoadedRows
    ended: list[FinishedRequest]  # aborts applied at this boundary
    admitted: list[RequestRecord]  # new and resumed requests given a slot at this boundary
    preempted: tuple[str, ...] = ()
    verify_np: np.ndarray | None = None  # speculative: rows that verify drafts (decode rows), else None

    @property
    def batch(self) -> StepBatch:
        return self.rows.batch

    @property
    def row_records(self) -> list[RequestRecord | None]:
        return self.rows.records

    @property
    def row_ids(self) -> tuple[str | None, ...]:
        return self.rows.row_ids

    @property
    def row_ids_np(self) -> np.ndarray:
        return self.rows.row_ids_np

    @property
    def slots_np(self) -> np.ndarray:
        return self.rows.slots_np

    @property
    def padding_np(self) -> np.ndarray:
        return self.rows.padding_np

    @property
    def all_real(self) -> bool:
        return self.rows.all_real

    @property
    def query_start_loc(self) -> torch.Tensor:
        return self.rows.query_start_loc


class Ledger(RequestRegistry):
    """Host truth about requests: the request table (per-slot columns, refreshed from each
    step's single output copy) and the records viewing it, slot ownership, the queue (its
    `registry` side); stages each step's plan and writes the step's output back."""

    def __init__(self, model: TalkerModel, table: SlotTable, oracle: Oracle, compiled: CompiledLifecycle,
                 decode_width: int = 1) -> None:
        super().__init__(model, table, compiled, deferred=oracle.spec.deferred)
        self.oracle = oracle
        # Tokens of a decode row: 1, or 1 + k drafts under speculative decoding.
        self.decode_width = decode_width
        # Every in-step edge that ends a request records a reason (true of every shipped
        # lifecycle): then a step whose rows all read reason 0 ended none of them.
        terminal = set(self.terminal_states)
        self._ends_record_reason = all(
            t.reason != FinishReason.NONE for t in oracle.spec.transitions
            if t.trigger not in HOST_TRIGGERS and t.dest in terminal and not set(t.sources) <= terminal)
        # The rows each step hands the device, in persistent buffers (one upload per step).
        self.inputs = StepInputs(table.max_slots, self.spec, table.device, decode_width)
        self._rows_steady = False  # set by validation: the plan's rows may be reused as loaded
        self.events = HostEvents(self)

    def stage(self, plan: StepPlan) -> HostStep:
        """Validate the whole plan (raising leaves everything as it was), then commit it."""
        if plan.has_events:
            resuming = set(plan.resumes)
            prepared = self.events.validate(plan)
            self._validate_rows(plan.rows, set(plan.aborts) | set(plan.preempts) | set(plan.releases), resuming,
                                prepared)
            committed, held = self.events.commit(plan, prepared), None
        else:  # the steady decode step: its rows alone
            held = self._validate_rows(plan.rows, _NO_IDS, _NO_IDS, _NO_PREPARED)
            committed = NO_EVENTS
        # The steady decode batch is held as loaded: no per-row Python, no upload.
        rows = held or self.inputs.holds(plan.rows, self.generation) or self.inputs.load(
            plan.rows, [None if s is None else self.records[s.request_id] for s in plan.rows], self.generation,
            self._rows_steady)
        return HostStep(committed.events, committed.admits, committed.replay, rows, list(committed.ended),
                        list(committed.admitted), tuple(plan.preempts), self._verify_rows(rows.slots_np))

    # -- the plan's rows, checked against the request table (nothing changes but `_rows_steady`) --

    def _validate_rows(self, rows: tuple[Span | None, ...], gone: set[str], resuming: set[str],
                       prepared: dict) -> LoadedRows | None:
        """The steady decode batch (the rows the step inputs hold as loaded, in the same
        generation, with no host event) is checked on arrays alone; any other rows go through
        `row_checks`, which names the request and what is wrong.
        Sets `_rows_steady`: every row decodes or overruns and the plan has no host event.
        Returns the step inputs' loaded rows when they are this steady batch, else None."""
        held = None if gone or resuming or prepared else self.inputs.holds(rows, self.generation)
        if held is not None and self._states_ok(held.slots_np, held.tokens_np, held.all_real):
            self._rows_steady = True
            return held
        self._rows_steady = check_rows(self, rows, gone, resuming, prepared)
        return None

    def _states_ok(self, slots: np.ndarray, tokens: np.ndarray, all_real: bool) -> bool:
        """Every real row (tokens > 0) is live with a decode row's width, or ended with one overrun token."""
        if all_real and self._is_live[self.rows.state[slots]].all():  # the common step: every row decodes
            return bool((tokens == self.decode_width).all())
        real = tokens > 0
        state = self.rows.state[slots[real]]
        live, terminal = self._is_live[state], self._is_terminal[state]
        return bool(np.all(np.where(live, tokens[real] == self.decode_width, terminal & (tokens[real] == 1))))

    def _verify_rows(self, slots: np.ndarray) -> np.ndarray | None:
        """The rows that verify drafts (a speculative lifecycle's decode rows: live, prompt
        done); None for other lifecycles. num_computed itself comes back in the step's output."""
        if not self.oracle.spec.verify_loop:
            return None
        rows = self.rows
        return self._is_live[rows.state[slots]] & (rows.num_computed[slots] >= rows.prompt_len[slots])

    # -- after the step ------------------------------------------------------------------

    def observe(
        self, host: HostStep, packed: np.ndarray, explain: Callable[[list[int]], list[str]] | None = None,
    ) -> list[FinishedRequest]:
        """Write the step's copied output [B, OUT_CODES + Q] into the request table; returns
        the requests that ended this step (the boundary's aborts first). `explain(slots)` gives
        the detail of the requests that ended with reason error (read only when some did, so
        the common step costs nothing). Vectorised: the only Python loop runs over the ended.
        """
        ended = list(host.ended)
        if host.all_real:  # the common step: no padding row to leave out
            real, slots, out = None, host.slots_np, packed
        else:
            real = ~host.padding_np
            if not real.any():
                return ended
            slots, out = host.slots_np[real], packed[real]
        rows = self.rows
        # The common step: no row has ended (count_nonzero is numpy's cheapest test at a few rows).
        if self._ends_record_reason and not np.count_nonzero(out[:, OUT_REASON]):
            rows.device_written[slots] = out[:, OUT_STATE:OUT_CODES]
            return ended
        was_terminal = self._is_terminal[rows.state[slots]]
        rows.device_written[slots] = out[:, OUT_STATE:OUT_CODES]
        now_terminal = self._is_terminal[packed[:, OUT_STATE]]
        if real is None:
            newly = np.flatnonzero(now_terminal & ~was_terminal)
        else:
            newly = np.flatnonzero(now_terminal & real & ~_scatter(real, was_terminal))
        errors = [int(host.slots_np[row]) for row in newly if packed[row, OUT_REASON] == int(FinishReason.ERROR)]
        details = iter(explain(errors) if errors and explain is not None else ())
        for row in newly:
            record = host.row_records[row]
            detail = next(details, "") if record.finish_reason is FinishReason.ERROR else ""
            ended.append(FinishedRequest(record.request_id, record.finish_reason, record.num_frames, detail))
        return ended


def _scatter(mask: np.ndarray, values: np.ndarray) -> np.ndarray:
    out = np.zeros(mask.shape, dtype=bool)
    out[mask] = values
    return out

