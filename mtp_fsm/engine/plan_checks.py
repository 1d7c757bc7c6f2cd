"""Plan validation, all-or-nothing, for the host ledger: every host trigger through the
lifecycle's machine, every row against the request table (vectorised; the steady decode
batch, a plan whose rows equal the last validated one, on arrays alone), and a message
naming the request, its state and what is wrong when anything fails."""

from __future__ import annotations

import attrs
import numpy as np

from ..errors import DuplicateRequestError, LifecycleError, PlanError, SlotTableFullError
from ..lifecycle import State, Trigger
from .plan import Span, StepPlan
from .records import RequestRecord


@attrs.frozen
class StagedRows:
    """The host staging of a steady batch's rows (Ledger.stage), reused while it stays steady."""

    records: list  # RequestRecord | None per row
    counts: list  # tokens per row
    batch: object  # the StepBatch on the device
    slots_np: np.ndarray
    query_start_loc: object  # host tensor
    row_ids: tuple
    row_ids_np: np.ndarray


@attrs.define
class SteadyRows:
    """What validating and staging `rows` produced, reused while `generation` (bumped by
    every admission, release, abort, preemption, resume and failed step) is unchanged: then
    the same request ids hold the same records and slots, and a decode row stays one."""

    rows: tuple
    generation: int
    slots: np.ndarray  # int64 [B], the rows' slots (scratch for padding)
    tokens: np.ndarray  # int64 [B], tokens per row (0 for padding)
    real: np.ndarray  # bool [B], not padding
    staged: StagedRows | None = None

    def matches(self, rows: tuple, generation: int) -> bool:
        return generation == self.generation and rows == self.rows

    def states_ok(self, slot_state: np.ndarray, is_live: np.ndarray, is_terminal: np.ndarray,
                  decode_width: int) -> bool:
        """Every real row is live with a decode row's width, or ended with one overrun token."""
        state = slot_state[self.slots[self.real]]
        tokens = self.tokens[self.real]
        live, terminal = is_live[state], is_terminal[state]
        return bool(np.all(np.where(live, tokens == decode_width, terminal & (tokens == 1))))


class PlanChecks:
    """The Ledger's validation half (a mixin: it reads the ledger's records, slot mirror,
    oracle, allocator and admission, and changes nothing but the steady-batch cache)."""

    def _check_host_trigger(self, record: RequestRecord, trigger: Trigger) -> None:
        if not self.oracle.may(record, trigger):
            raise LifecycleError(record.request_id, record.state, trigger)

    def _validate(self, plan: StepPlan) -> dict[str, object]:
        touched: dict[str, str] = {}

        def once(request_id: str, what: str) -> None:
            if request_id in touched:
                raise PlanError(request_id, None, f"named twice in one plan ({touched[request_id]} and {what})")
            touched[request_id] = what

        freed = 0
        for rid in plan.releases:
            once(rid, "release")
            record = self.record(rid, "release")
            self._check_host_trigger(record, Trigger.RELEASE)
            if record.slot is None:
                raise PlanError(rid, record.state.label, "holds no slot to release (a preempted request is resumed "
                                "or aborted, not released)")
            freed += 1
        for rid in plan.aborts:
            once(rid, "abort")
            record = self.record(rid, "abort")
            self._check_host_trigger(record, Trigger.ABORT)
            freed += record.slot is not None
        for rid in plan.preempts:
            once(rid, "preempt")
            self._check_host_trigger(self.record(rid, "preempt"), Trigger.PREEMPT)
            freed += 1
        for rid in plan.resumes:
            once(rid, "resume")
            record = self.record(rid, "resume")
            self._check_host_trigger(record, Trigger.RESUME)
            if not self.ready_to_resume(record):
                raise PlanError(rid, record.state.label, f"cannot resume before conditioning row {record.num_frames - 1} "
                                "arrives (its replayed frames read it; engine.feed)")
        prepared = {}
        for req in plan.new_requests:
            rid = req.request_id
            queued = self.queued.get(rid)
            if queued is not None and queued.request is req:  # enqueued earlier: validated then
                prepared[rid] = queued.prepared
                continue
            if rid in prepared:
                raise DuplicateRequestError(rid, "named twice among this plan's new requests", "new")
            if rid in self.records or rid in self.queued:
                known = self.records.get(rid) or self.queued.get(rid)
                raise DuplicateRequestError(rid, "a request with this id is already in the engine", known.state.label)
            prepared[rid] = self.admission.admissible(req)
        wanted = len(plan.resumes) + len(plan.new_requests)
        available = self.allocator.num_free + freed
        if wanted > available:
            late = [*plan.resumes, *(r.request_id for r in plan.new_requests)][available]
            raise SlotTableFullError(
                late, f"no free slot: {wanted} admissions for {available} free of {self.table.max_slots} slots; "
                "queue it until a request finishes",
            )
        gone = set(plan.aborts) | set(plan.preempts) | set(plan.releases)
        self._validate_rows(plan.rows, gone, prepared)
        return prepared

    def _validate_rows(self, rows: tuple[Span | None, ...], gone: set[str], prepared: dict) -> None:
        """Rows of requests that already hold a slot are checked vectorised against the
        mirror (the steady-state decode batch); anything else, or any row that fails, goes
        through the per-span check, which names the request and what is wrong. Rows equal
        to the last steady batch's, in the same generation, are checked on arrays alone."""
        steady, special = self._steady, gone or self._resuming or prepared
        if not special and steady is not None and steady.matches(rows, self.generation) and steady.states_ok(
                self.rows.state, self._is_live, self._is_terminal, self.decode_width):
            return
        self._steady = None
        spans = [s for s in rows if s is not None]
        special = gone | self._resuming | prepared.keys()
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
            if not bad and not special and (remaining <= 0).all():  # every row decodes or overruns
                self._steady = self._steady_of(rows)
        seen: set[str] = set()
        for i, span in enumerate(spans):
            if i in bad:
                self._validate_span(span, gone, seen, prepared)
            elif span.request_id in seen:
                raise PlanError(span.request_id, None, "scheduled in two rows of one step")
            else:
                seen.add(span.request_id)

    def _steady_of(self, rows: tuple[Span | None, ...]) -> SteadyRows:
        scratch = self.table.max_slots
        slots = np.array([scratch if s is None else self.records[s.request_id].slot for s in rows], dtype=np.int64)
        tokens = np.array([0 if s is None else s.num_tokens for s in rows], dtype=np.int64)
        return SteadyRows(rows, self.generation, slots, tokens, np.array([s is not None for s in rows], dtype=bool))

    def _validate_span(self, span: Span, gone: set[str], seen: set[str], prepared: dict) -> None:
        rid = span.request_id
        record = self.records.get(rid)
        if rid in seen:
            raise PlanError(rid, None, "scheduled in two rows of one step")
        seen.add(rid)
        if rid in prepared:  # admitted by this very plan
            state, remaining = self._admitted_state, int(prepared[rid].prompt_embeds.shape[0])
        elif record is None:
            raise PlanError(rid, None, "scheduled but not in the engine (never admitted, or already released or aborted)")
        elif rid in gone or (record.slot is None and rid not in self._resuming):
            raise PlanError(rid, record.state.label, "scheduled but it holds no slot in this step")
        else:
            state = State(self._dest[Trigger.RESUME, record.state]) if rid in self._resuming else record.state
            remaining = self.resume_prompt_len(record) if rid in self._resuming else record.prompt_len - record.num_computed
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
