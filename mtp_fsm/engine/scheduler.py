"""The built-in scheduling policy: FCFS admission, a token budget with chunked prefill, preemption
(its knobs: `scheduling_policy`)."""

from __future__ import annotations

import numpy as np

from ..errors import SchedulerStallError  # re-exported (with SchedulingPolicy) where callers found them
from ..lifecycle import Trigger
from .client_requests import ClientRequests
from .ledger import Ledger
from .outputs import StepOutput
from .plan import NewRequest, Span, StepPlan
from .records import RequestRecord
from .scheduling_policy import SchedulingPolicy


class Scheduler(ClientRequests):
    """vLLM-style: decode rows first (1 token each, 1 + k when speculating), then prefill chunks, then resumes of
    preempted requests (oldest first), then new admissions, all under one token budget.

    Holds only policy state (pending client aborts and preemptions and the preemption order,
    its `client_requests` side; how long the queue head has waited); every fact about a
    request is read from its one host record in the ledger. schedule() changes no request;
    update() commits a step's plan.
    """

    def __init__(self, ledger: Ledger, policy: SchedulingPolicy) -> None:
        super().__init__(ledger)
        self.policy = policy
        self._wait_head: str | None = None
        self._head_wait = 0
        self._planned: tuple[StepPlan, str | None] | None = None  # last plan built, and its blocked head
        self.num_preemptions = 0

    @property
    def idle(self) -> bool:
        return not self.ledger.queued and not self.ledger.records and not self._aborts

    # -- planning ------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        ledger, columns = self.ledger, self.ledger.rows
        records = ledger.records
        ids, held = list(records), list(records.values())
        # The slot holders' facts, read from the request table's columns in one pass (a record
        # is a view of its row: reading field by field would cost a call per request and field).
        slot = np.fromiter((-1 if r.slot is None else r.slot for r in held), np.int64, len(held))
        at = np.where(slot >= 0, slot, ledger.table.max_slots)
        code = columns.state[at]
        holds = slot >= 0
        terminal, live = holds & ledger._is_terminal[code], holds & ledger._is_live[code]
        order = np.argsort(columns.serial[at], kind="stable")  # admission order
        aborts = tuple(rid for rid in self._aborts if rid in records and records[rid].state not in ledger.terminal_states)
        gone = set(aborts)
        releases = tuple(ids[i] for i in np.flatnonzero(terminal).tolist() if ids[i] not in gone)
        running = [i for i in order[live[order]].tolist() if ids[i] not in gone]
        # Free slots, from the table just read: every slot not held by a request.
        free = ledger.table.max_slots - int(holds.sum())
        free += len(releases) + sum(records[rid].slot is not None for rid in aborts)
        # Requests resting with a slot (starved: waiting for conditioning rows) are preempted
        # first under pressure: they hold a slot and compute nothing.
        resting = [i for i in order[(holds & ~live & ~terminal)[order]].tolist()
                   if ids[i] not in gone and ledger.oracle.may(held[i], Trigger.PREEMPT)]
        preempts = [ids[i] for i in (*running, *resting) if ids[i] in self._preempts]
        waiting_resumes = [rid for rid in self._preempted if rid not in gone and ledger.ready_to_resume(records[rid])]
        head = next(iter(ledger.queued), None)
        blocked = head is not None and free + len(preempts) <= 0 and not waiting_resumes
        limit = self.policy.preempt_after_steps
        if blocked and limit is not None and self._head_waits(head) > limit and not preempts and (resting or running):
            preempts.append(ids[(resting or running)[-1]])  # a resting one, else the most recently admitted
            blocked = False
        free += len(preempts)
        gone.update(preempts)

        budget, rows = self.policy.token_budget, []
        remaining = (columns.prompt_len[at] - columns.num_computed[at]).tolist()
        live_rows = [i for i in running if ids[i] not in gone]
        width = ledger.decode_width  # 1, or the last token plus the drafts of a speculative engine
        for i in live_rows:  # decode rows first: they carry audio a listener is waiting for
            if remaining[i] <= 0 and budget >= width:
                rows.append(Span(ids[i], width))
                budget -= width
        for i in live_rows:
            if remaining[i] > 0 and budget > 0:
                budget -= self._chunk(rows, ids[i], remaining[i], budget)
        resumes = []
        for rid in waiting_resumes:
            if free <= 0 or budget <= 0:
                break
            resumes.append(rid)
            free -= 1
            budget -= self._chunk(rows, rid, ledger.resume_prompt_len(records[rid]), budget)
        admitted: list[NewRequest] = []
        if len(resumes) == len(waiting_resumes):  # preempted requests go first
            for record in ledger.queued.values():
                # The request a preemption made room for is admitted even with no budget left.
                if free <= 0 or (budget <= 0 and not (preempts and not admitted)):
                    break
                admitted.append(record.request)
                free -= 1
                budget -= self._chunk(rows, record.request_id, record.prompt_len, budget)
        plan = StepPlan(new_requests=tuple(admitted), rows=tuple(rows), aborts=aborts, preempts=tuple(preempts),
                        resumes=tuple(resumes), releases=releases)
        self._planned = (plan, head if blocked else None)
        return plan

    def _chunk(self, rows: list[Span], request_id: str, remaining: int, budget: int) -> int:
        n = min(self.policy.prefill_chunk, remaining, budget)
        if n > 0:
            rows.append(Span(request_id, n))
        return n

    def _head_waits(self, head_id: str) -> int:
        """Steps the head has been blocked so far, counting the one being planned."""
        return (self._head_wait if head_id == self._wait_head else 0) + 1

    # -- commit --------------------------------------------------------------------------

    def update(self, plan: StepPlan, output: StepOutput) -> None:
        """Commit a plan the engine ran (schedule()'s, or an embedder's own)."""
        for rid in plan.aborts:
            self._aborts.pop(rid, None)
            if rid in self._preempted:
                self._preempted.remove(rid)
        for rid in plan.preempts:
            self._preempts.pop(rid, None)
            self._preempted.append(rid)
            self.num_preemptions += 1
        for rid in plan.resumes:
            if rid in self._preempted:
                self._preempted.remove(rid)
        for finished in output.finished:  # e.g. a request the model failed while an abort was pending
            self._aborts.pop(finished.request_id, None)
            self._preempts.pop(finished.request_id, None)
        # The head's wait counts only steps that ran this policy's own plan.
        blocked = self._planned[1] if self._planned is not None and self._planned[0] is plan else None
        self._planned = None
        if blocked is None:
            self._wait_head, self._head_wait = None, 0
        else:
            self._head_wait, self._wait_head = self._head_waits(blocked), blocked


def is_empty(plan: StepPlan) -> bool:
    return not (plan.rows or plan.new_requests or plan.aborts or plan.preempts or plan.resumes or plan.releases)


__all__ = ["RequestRecord", "Scheduler", "SchedulerStallError", "SchedulingPolicy", "is_empty"]
