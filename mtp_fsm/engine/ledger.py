"""The host ledger: owns the request table, the records viewing it and the queue; stages a
StepPlan all-or-nothing (its host events through `host_events`, its rows checked here against
the table, vectorised, and loaded by `step_inputs`) and writes the step's device output into
the table."""

from __future__ import annotations

from typing import Callable

import attrs
import numpy as np
import torch

from ..errors import DuplicateRequestError, PlanError, UnknownRequestError
from ..kernels.contract import (
    OUT_CODES, OUT_REASON, OUT_STATE, ReplayFrames, StagedAdmits, StagedEvents,
    StepBatch,
)
from ..lifecycle import (
    CLASS_LIVE, CLASS_TERMINAL, CLASS_VACANT, HOST_TRIGGERS, CompiledLifecycle, FinishReason, Oracle, State, Trigger,
)
from ..lifecycle.device_tables import RULE_DEST
from ..model_api import TalkerModel
from ..slots import SlotAllocator, SlotTable
from .outputs import FinishedRequest
from .plan import NewRequest, Span, StepPlan
from .admission import Admission
from .host_events import NO_EVENTS, HostEvents
from .records import RequestRecord, RequestTable
from .step_inputs import LoadedRows, StepInputs

_NO_IDS: frozenset[str] = frozenset()
_NO_PREPARED: dict = {}  # read only


@attrs.define
class HostStep:
    """A validated, committed plan: what the device stages receive, and host bookkeeping."""

    events: StagedEvents | None
    admits: StagedAdmits | None
    replay: ReplayFrames | None
    batch: StepBatch
    row_records: list[RequestRecord | None]
    row_ids: tuple[str | None, ...]
    row_ids_np: np.ndarray  # row_ids as an object array (the output's request ids)
    slots_np: np.ndarray  # slot per row (scratch for padding), host copy
    padding_np: np.ndarray
    all_real: bool  # no padding row (the common step)
    ended: list[FinishedRequest]  # aborts applied at this boundary
    admitted: list[RequestRecord]  # new and resumed requests given a slot at this boundary
    preempted: tuple[str, ...] = ()
    query_start_loc: torch.Tensor | None = None  # host copy of batch.query_start_loc (shared: clone to publish)
    verify_np: np.ndarray | None = None  # speculative: rows that verify drafts (decode rows), else None


class Ledger:
    """Host truth about requests: the request table (per-slot columns, refreshed from each
    step's single output copy) and the records viewing it, slot ownership, the queue."""

    def __init__(self, model: TalkerModel, table: SlotTable, oracle: Oracle, compiled: CompiledLifecycle,
                 decode_width: int = 1) -> None:
        self.model, self.table, self.oracle, self.compiled = model, table, oracle, compiled
        # Tokens of a decode row: 1, or 1 + k drafts under speculative decoding.
        self.decode_width = decode_width
        self.live_states = compiled.states_in(CLASS_LIVE)
        self.terminal_states = compiled.states_in(CLASS_TERMINAL)
        # Per state code: live / terminal (a lookup, not np.isin, which costs tens of µs a call).
        self._is_live = _class_lookup(self.live_states)
        self._is_terminal = _class_lookup(self.terminal_states)
        self._dest = compiled.rules[RULE_DEST].numpy()  # [trigger, state] -> state
        # Every in-step edge that ends a request records a reason (true of every shipped
        # lifecycle): then a step whose rows all read reason 0 ended none of them.
        terminal = set(self.terminal_states)
        self._ends_record_reason = all(
            t.reason != FinishReason.NONE for t in oracle.spec.transitions
            if t.trigger not in HOST_TRIGGERS and t.dest in terminal and not set(t.sources) <= terminal)
        # Where an admitted row starts: admission from the (one) vacant state.
        (vacant,) = compiled.states_in(CLASS_VACANT)
        self.vacant_state = int(vacant)
        self._admitted_state = State(self._dest[Trigger.ADMIT, vacant])
        self.spec = model.spec
        self.allocator = SlotAllocator(table.max_slots)
        self.records: dict[str, RequestRecord] = {}
        self.next_serial = 1  # serials are never reused: a stale row cannot pass the identity guard
        self.admission = Admission(model, deferred=oracle.spec.deferred)
        # The rows each step hands the device, in persistent buffers (one upload per step).
        self.inputs = StepInputs(table.max_slots, self.spec, table.device, decode_width)
        self.queued: dict[str, RequestRecord] = {}  # enqueued, not yet admitted (state free, no slot)
        # The one owner of every request's state and counters on the host (records view it).
        self.rows = RequestTable(table.max_slots + 1)
        # Bumped whenever a request gains or loses a record or a slot: rows held as loaded by
        # the step inputs are the steady batch (checked on arrays) only within one generation.
        self.generation = 0
        self._rows_steady = False  # set by validation: the plan's rows may be reused as loaded
        self.events = HostEvents(self)

    def record(self, request_id: str, what: str) -> RequestRecord:
        """The record of a known request; UnknownRequestError saying what was attempted."""
        record = self.records.get(request_id) or self.queued.get(request_id)
        if record is None:
            raise UnknownRequestError(request_id, what)
        return record

    def all_records(self):
        """(request id, record) for every request the engine holds, queued ones last."""
        return [*self.records.items(), *self.queued.items()]

    # -- requests queued by the engine's built-in policy ----------------------------------

    def enqueue(self, req: NewRequest) -> RequestRecord:
        """Validate a request now and hold its record (state free, no slot) until a plan admits it."""
        rid = req.request_id
        if rid in self.records or rid in self.queued:
            known = self.records.get(rid) or self.queued[rid]
            raise DuplicateRequestError(rid, "a request with this id is already in the engine", known.state.label)
        record = RequestRecord(req, self.rows, self.admission.admissible(req))
        self.queued[rid] = record
        return record

    def drop_queued(self, request_id: str) -> RequestRecord | None:
        record = self.queued.pop(request_id, None)
        if record is not None:
            self.admission.forget(record.request)
        return record

    def ready_to_resume(self, record: RequestRecord) -> bool:
        """A resume replays the published frames with their text steps: with a conditioning
        feed, every row they read must have arrived."""
        return not self.spec.has_feed or record.num_frames == 0 or record.has_feed_row(record.num_frames - 1)

    def resume_prompt_len(self, record: RequestRecord) -> int:
        return record.base_prompt_len + record.num_frames

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
        slots_np = rows.slots_np
        return HostStep(
            committed.events, committed.admits, committed.replay, rows.batch, rows.records, rows.row_ids,
            rows.row_ids_np, slots_np, rows.padding_np, rows.all_real, list(committed.ended), list(committed.admitted),
            tuple(plan.preempts), rows.query_start_loc, self._verify_rows(slots_np),
        )

    # -- the plan's rows, checked against the request table (nothing changes but `_rows_steady`) --

    def _validate_rows(self, rows: tuple[Span | None, ...], gone: set[str], resuming: set[str],
                       prepared: dict) -> LoadedRows | None:
        """Rows of requests that already hold a slot are checked vectorised against the
        request table; anything else, or any row that fails, goes through the per-span check,
        which names the request and what is wrong. The steady decode batch (the rows the step
        inputs hold as loaded, in the same generation) is checked on arrays alone.
        Sets `_rows_steady`: every row decodes or overruns and the plan has no host event.
        Returns the step inputs' loaded rows when they are this steady batch, else None."""
        special = gone or resuming or prepared
        held = None if special else self.inputs.holds(rows, self.generation)
        if held is not None and self._states_ok(held.slots_np, held.tokens_np, held.all_real):
            self._rows_steady = True
            return held
        self._rows_steady = False
        spans = [s for s in rows if s is not None]
        special = gone | resuming | prepared.keys()
        records = [self.records.get(s.request_id) for s in spans]
        simple = [
            i for i, (s, r) in enumerate(zip(spans, records))
            if r is not None and r.slot is not None and s.request_id not in special and type(s.num_tokens) is int
        ]
        bad: set[int] = set(range(len(spans))) - set(simple)
        if simple:
            slots = np.fromiter((records[i].slot for i in simple), np.int64, len(simple))
            tokens = np.fromiter((spans[i].num_tokens for i in simple), np.int64, len(simple))
            remaining = self.rows.prompt_len[slots] - self.rows.num_computed[slots]
            state = self.rows.state[slots]
            live, terminal = self._is_live[state], self._is_terminal[state]
            wrong = (tokens < 1) | (~live & ~terminal)
            wrong |= live & np.where(remaining > 0, tokens > remaining, tokens != self.decode_width)
            wrong |= terminal & (tokens != 1)
            bad.update(simple[i] for i in np.flatnonzero(wrong))
            if len(np.unique(slots)) != len(slots):
                bad.update(simple)  # a request in two rows: let the slow path name it
            self._rows_steady = not bad and not special and bool((remaining <= 0).all())
        seen: set[str] = set()
        for i, span in enumerate(spans):
            if i in bad:
                self._validate_span(span, gone, resuming, seen, prepared)
            elif span.request_id in seen:
                raise PlanError(span.request_id, None, "scheduled in two rows of one step")
            else:
                seen.add(span.request_id)
        return None

    def _states_ok(self, slots: np.ndarray, tokens: np.ndarray, all_real: bool) -> bool:
        """Every real row (tokens > 0) is live with a decode row's width, or ended with one overrun token."""
        if all_real and self._is_live[self.rows.state[slots]].all():  # the common step: every row decodes
            return bool((tokens == self.decode_width).all())
        real = tokens > 0
        state = self.rows.state[slots[real]]
        live, terminal = self._is_live[state], self._is_terminal[state]
        return bool(np.all(np.where(live, tokens[real] == self.decode_width, terminal & (tokens[real] == 1))))

    def _validate_span(self, span: Span, gone: set[str], resuming: set[str], seen: set[str],
                       prepared: dict) -> None:
        rid = span.request_id
        record = self.records.get(rid)
        if rid in seen:
            raise PlanError(rid, None, "scheduled in two rows of one step")
        seen.add(rid)
        if rid in prepared:  # admitted by this very plan
            state, remaining = self._admitted_state, int(prepared[rid].prompt_embeds.shape[0])
        elif record is None:
            raise PlanError(rid, None, "scheduled but not in the engine (never admitted, or already released or aborted)")
        elif rid in gone or (record.slot is None and rid not in resuming):
            raise PlanError(rid, record.state.label, "scheduled but it holds no slot in this step")
        else:
            state = State(self._dest[Trigger.RESUME, record.state]) if rid in resuming else record.state
            remaining = self.resume_prompt_len(record) if rid in resuming else record.prompt_len - record.num_computed
        if type(span.num_tokens) is not int or span.num_tokens < 1:
            raise PlanError(rid, state.label, f"a span needs >= 1 token, got {span.num_tokens!r}")
        if state in self.live_states:
            if remaining > 0 and span.num_tokens > remaining:
                raise PlanError(rid, state.label, f"span of {span.num_tokens} tokens exceeds the {remaining} prompt tokens left")
            if remaining <= 0 and span.num_tokens != self.decode_width:
                what = "1 token" if self.decode_width == 1 else f"{self.decode_width} tokens (its last and the drafts)"
                raise PlanError(rid, state.label, f"a decode row takes exactly {what}, got {span.num_tokens}")
        elif state in self.terminal_states:  # a legal overrun (async scheduling): one token, like decode
            if span.num_tokens != 1:
                raise PlanError(rid, state.label, f"an overrun row of an ended request takes exactly 1 token, "
                                f"got {span.num_tokens}")
        elif state is State.STARVED:
            raise PlanError(rid, state.label, f"waits for conditioning row {max(record.num_frames - 1, 0)} "
                            "(engine.feed); it cannot be scheduled until it arrives")
        else:
            raise PlanError(rid, state.label, "cannot be scheduled in this state")

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


def _class_lookup(states) -> np.ndarray:
    """bool per state code (every code a slot-state byte can hold): member of `states`."""
    lookup = np.zeros(256, dtype=bool)
    lookup[[int(s) for s in states]] = True
    return lookup


def _scatter(mask: np.ndarray, values: np.ndarray) -> np.ndarray:
    out = np.zeros(mask.shape, dtype=bool)
    out[mask] = values
    return out

