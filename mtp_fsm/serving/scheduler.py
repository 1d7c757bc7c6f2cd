"""Scheduler: the admission, chunked-prefill, abort and preemption policy that builds each StepPlan."""

from __future__ import annotations

from typing import Protocol

import attrs

from ..engine.plan import NewRequest, Span, StepOutput, StepPlan
from ..errors import DuplicateRequestError, MtpFsmError
from .queue import RequestQueue


class EngineView(Protocol):
    """All the scheduler reads from the engine: the slot allocator's free count."""

    @property
    def num_free_slots(self) -> int: ...


class SchedulerError(MtpFsmError):
    """The scheduler was driven out of order (update without schedule, unknown ids, ...)."""


@attrs.define
class _Tracked:
    """Host bookkeeping of one request from submit until its slot is released.

    target: positions to compute before the first sample of this residency: the prompt,
    or after a resume the prompt plus the frames already published (the engine replays
    them), which is why computed restarts at 0 on resume.
    """

    request: NewRequest
    prompt_len: int
    phase: str = "queued"  # queued | running | preempted | finished (awaiting release)
    target: int = 0
    computed: int = 0
    frames: int = 0
    admit_seq: int = -1

    @property
    def in_prefill(self) -> bool:
        return self.computed < self.target


@attrs.frozen
class _Decision:
    """What one schedule() call decided, committed by update() once the engine ran it."""

    plan: StepPlan
    admitted: tuple[str, ...]
    head: str | None  # queue head when it was blocked for lack of a slot, else None


class Scheduler:
    """FCFS, vLLM-style: decode rows first (1 token each), then prefill chunks, then
    resumes of preempted requests, then new admissions, all under one token budget.

    Usage per step: plan = schedule(engine); out = engine.step(plan); update(out).
    schedule() changes nothing, so a plan the engine refuses can be rebuilt after
    reject(). With preempt_after_steps=N, a queue head blocked for lack of a slot for
    more than N consecutive steps preempts the most recently admitted running request
    (recompute-style: it re-prefills its prompt plus published frames on resume).
    """

    def __init__(
        self, max_slots: int, token_budget: int, prefill_chunk: int, *, preempt_after_steps: int | None = None
    ) -> None:
        for name, value in (("max_slots", max_slots), ("token_budget", token_budget), ("prefill_chunk", prefill_chunk)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Scheduler {name} must be an int >= 1, got {value!r}")
        if preempt_after_steps is not None and (not isinstance(preempt_after_steps, int) or preempt_after_steps < 0):
            raise ValueError(f"preempt_after_steps must be None or an int >= 0, got {preempt_after_steps!r}")
        self.max_slots, self.token_budget, self.prefill_chunk = max_slots, token_budget, prefill_chunk
        self.preempt_after_steps = preempt_after_steps
        self.queue = RequestQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._running: list[str] = []  # admission order; the tail is the preemption victim
        self._preempted: list[str] = []  # resumed in this order (oldest preemption first)
        self._pending_aborts: dict[str, None] = {}  # ordered set
        self._to_release: dict[str, None] = {}
        self._decision: _Decision | None = None
        self._admit_seq = 0
        self._wait_head: str | None = None
        self._head_wait = 0
        self.num_preemptions = 0

    # -- client side ---------------------------------------------------------------------

    def add(self, request: NewRequest, prompt_len: int) -> None:
        """Queue a request whose prompt the model prepares to `prompt_len` positions."""
        rid = request.request_id
        if rid in self._tracked:
            raise DuplicateRequestError(rid, "a request with this id is still in service", self._tracked[rid].phase)
        # 0 is let through: the engine's admission check names the empty prompt itself.
        if not isinstance(prompt_len, int) or prompt_len < 0:
            raise ValueError(f"request {rid!r}: prompt_len must be an int >= 0, got {prompt_len!r}")
        self.queue.submit(request)
        self._tracked[rid] = _Tracked(request, prompt_len, target=prompt_len)

    def abort(self, request_id: str) -> str:
        """'dropped' (was queued: gone now), 'scheduled' (the next plan aborts it in the
        engine) or 'ignored' (already finished, already aborting, or unknown)."""
        if self.queue.abort(request_id) is not None:
            del self._tracked[request_id]
            return "dropped"
        tracked = self._tracked.get(request_id)
        if tracked is None or tracked.phase == "finished" or request_id in self._pending_aborts:
            return "ignored"
        self._pending_aborts[request_id] = None
        return "scheduled"

    def reject(self, request_id: str) -> NewRequest:
        """Forget a queued request the engine refused at admission; the next schedule()
        builds the plan again without it."""
        tracked = self._tracked.get(request_id)
        if tracked is None or tracked.phase != "queued":
            phase = "unknown" if tracked is None else tracked.phase
            raise SchedulerError(f"request {request_id!r} ({phase}): only a queued request can be rejected")
        self.queue.abort(request_id)
        del self._tracked[request_id]
        self._decision = None
        return tracked.request

    # -- introspection -------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not self._tracked and not self._pending_aborts

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_preempted(self) -> int:
        return len(self._preempted)

    def phase(self, request_id: str) -> str | None:
        tracked = self._tracked.get(request_id)
        return None if tracked is None else tracked.phase

    def progress(self, request_id: str) -> tuple[int, int, int]:
        """(computed, target, frames) of a tracked request, as the scheduler believes them."""
        t = self._tracked.get(request_id)
        if t is None:
            raise SchedulerError(f"request {request_id!r} is not tracked by the scheduler")
        return t.computed, t.target, t.frames

    # -- planning ------------------------------------------------------------------------

    def schedule(self, engine: EngineView) -> StepPlan:
        """Build the next StepPlan from the bookkeeping and the engine's free slots."""
        releases = tuple(self._to_release)
        aborts = tuple(self._pending_aborts)
        holding_aborts = sum(self._tracked[rid].phase == "running" for rid in aborts)
        freed = len(releases) + holding_aborts
        holding = len(self._running) + len(self._to_release) - freed
        free = min(engine.num_free_slots + freed, self.max_slots - holding)
        gone = set(aborts)
        waiting_resumes = [rid for rid in self._preempted if rid not in gone]

        preempts: tuple[str, ...] = ()
        head = self.queue.peek()
        blocked = head is not None and free <= 0 and not waiting_resumes
        if blocked and self.preempt_after_steps is not None and self._head_waits(head.request_id) > self.preempt_after_steps:
            victims = [rid for rid in self._running if rid not in gone]
            if victims:
                preempts = (victims[-1],)
                gone.add(victims[-1])
                free += 1
                blocked = False

        budget = self.token_budget
        rows: list[Span] = []
        live = [self._tracked[rid] for rid in self._running if rid not in gone]
        for t in live:  # decode rows first: they carry audio a listener is waiting for
            if not t.in_prefill and budget > 0:
                rows.append(Span(t.request.request_id, 1))
                budget -= 1
        for t in live:
            if t.in_prefill and budget > 0:
                budget -= self._chunk(rows, t, t.target - t.computed, budget)

        resumes: list[str] = []
        for rid in waiting_resumes:
            if free <= 0 or budget <= 0:
                break
            t = self._tracked[rid]
            resumes.append(rid)
            free -= 1
            budget -= self._chunk(rows, t, t.prompt_len + t.frames, budget)

        admitted: list[NewRequest] = []
        if len(resumes) == len(waiting_resumes):  # preempted requests go first
            for req in self.queue:
                # The request a preemption made room for is admitted even with no budget left.
                if free <= 0 or (budget <= 0 and not (preempts and not admitted)):
                    break
                admitted.append(req)
                free -= 1
                budget -= self._chunk(rows, self._tracked[req.request_id], self._tracked[req.request_id].prompt_len, budget)

        plan = StepPlan(
            new_requests=tuple(admitted), rows=tuple(rows), aborts=aborts, preempts=preempts,
            resumes=tuple(resumes), releases=releases,
        )
        self._decision = _Decision(plan, tuple(r.request_id for r in admitted), head.request_id if blocked else None)
        return plan

    def _chunk(self, rows: list[Span], t: _Tracked, remaining: int, budget: int) -> int:
        n = min(self.prefill_chunk, remaining, budget)
        if n > 0:
            rows.append(Span(t.request.request_id, n))
        return n

    def _head_waits(self, head_id: str) -> int:
        """Steps the head has been blocked so far, counting the one being planned."""
        return (self._head_wait if head_id == self._wait_head else 0) + 1

    # -- commit --------------------------------------------------------------------------

    def update(self, output: StepOutput) -> None:
        """Commit the last schedule() now that the engine ran its plan and returned `output`."""
        decision, self._decision = self._decision, None
        if decision is None:
            raise SchedulerError(f"update() for engine step {output.step} without a schedule() before it")
        plan = decision.plan
        for rid in plan.releases:
            del self._to_release[rid]
            del self._tracked[rid]
        for rid in plan.aborts:
            del self._pending_aborts[rid]
            tracked = self._tracked.pop(rid)
            (self._running if tracked.phase == "running" else self._preempted).remove(rid)
        for rid in plan.preempts:
            t = self._tracked[rid]
            self._running.remove(rid)
            self._preempted.append(rid)
            t.phase, t.computed = "preempted", 0
            self.num_preemptions += 1
        for rid in plan.resumes:
            t = self._tracked[rid]
            self._preempted.remove(rid)
            t.target, t.computed = t.prompt_len + t.frames, 0
            self._enter_running(t)
        for rid in decision.admitted:
            popped = self.queue.pop()
            if popped.request_id != rid:
                raise SchedulerError(f"queue head {popped.request_id!r} is not the admitted request {rid!r}")
            self._enter_running(self._tracked[rid])
        for span in plan.rows:
            t = self._tracked[span.request_id]
            if t.in_prefill:
                t.computed += span.num_tokens
        for rid in output.frames.request_ids:
            self._tracked[rid].frames += 1
        aborted = set(plan.aborts)
        for finished in output.finished:
            if finished.request_id in aborted:
                continue  # the engine released its slot at the boundary already
            t = self._tracked[finished.request_id]
            self._running.remove(finished.request_id)
            t.phase = "finished"
            self._to_release[finished.request_id] = None
        if decision.head is None:
            self._wait_head, self._head_wait = None, 0
        else:
            self._head_wait = self._head_waits(decision.head)
            self._wait_head = decision.head

    def _enter_running(self, t: _Tracked) -> None:
        t.phase, t.admit_seq = "running", self._admit_seq
        self._admit_seq += 1
        self._running.append(t.request.request_id)
