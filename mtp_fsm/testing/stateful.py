"""A Hypothesis rule-based state machine that drives a LockstepEngine against the oracle.

Rules stage host events (admit, abort, preempt, resume, release) and run steps with a
random subset of the requests (random prefill chunks, random row order, padding rows,
finished-but-unreleased rows as async overruns), or send plans that must be rejected
whole. After every rule the engine must agree with an `OracleDriver`: device states equal
the per-request oracle's, slots are owned exactly once and never leak, the sticky error
column is clear, and every published frame equals the frame the same request produces
when run alone (so mixing between requests, or any dependence on row order, slot,
padding or batch composition, fails).

With a conditioned talker (a conditioning feed, variant `conditioned`) each request starts
with only part of its feed (a drawn `feed_upfront`), a `feed` rule hands a random request
more rows between steps (the last call declaring the feed done), and the driver models the
`starved` rest state itself; frames must still equal the request's whole-feed alone run.

    run_state_machine_as_test(lambda: LifecycleMachine(scripted_single), settings=...)
    TestMTP = lifecycle_test_case(scripted_mtp, max_slots=3)
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from typing import Any, Callable

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ..engine import LockstepEngine, Span, StepPlan
from ..lifecycle import State
from ..model_api import ModelSpec
from .alone import ModelFactory, RequestDef, scripted_mtp, scripted_single
from .bad_inputs import WAITING_KINDS, bad_plans
from .oracle_driver import OracleDriver
from .references import reference_runs
from .strategies import Pending, scripted_requests

# Accumulated over every machine run in this process (per lifecycle variant name).
COVERAGE: dict[str, Counter] = defaultdict(Counter)
STATS: dict[str, Counter] = defaultdict(Counter)


class LifecycleMachine(RuleBasedStateMachine):
    """The engine under random schedules, checked against the oracle after every rule."""

    def __init__(
        self,
        model_factory: ModelFactory = scripted_mtp,
        *,
        max_slots: int = 3,
        max_requests: int = 24,
        requests: Callable[[ModelSpec], st.SearchStrategy[RequestDef]] | None = None,
        **engine_kwargs: Any,
    ) -> None:
        super().__init__()
        engine_kwargs.setdefault("kernels", "torch")
        self.engine = LockstepEngine(model_factory(), max_slots, **engine_kwargs)
        self.spec = self.engine.spec
        self.classes = self.engine.lifecycle.classes
        self.refs = reference_runs(model_factory, engine_kwargs.get("lifecycle"))
        self.driver = OracleDriver(self.spec, max_slots, self.refs, self.engine.lifecycle)
        self.request_defs = (requests or scripted_requests)(self.spec)
        self.scripted = requests is None
        # Conditioning feed (scripted conditioned talker): the ids each request has still to
        # be fed, and whether its last feed call declares the feed done.
        self.feeding = self.spec.has_feed and self.scripted
        self.unfed: dict[str, list[int]] = {}
        self.feed_ends: dict[str, bool] = {}
        self.max_requests = max_requests
        self.pending = Pending()
        self.admitted = 0
        self._steps_since_rejected = 0
        self.stats = STATS[self.engine.lifecycle.name]
        self._started = time.perf_counter()

    # -- helpers ------------------------------------------------------------------------

    def _free_after_pending(self) -> int:
        p, reqs = self.pending, self.driver.requests
        freed = len(p.releases) + len(p.preempts) + sum(reqs[rid].slot is not None for rid in p.aborts)
        return self.driver.num_free + freed - len(p.new) - len(p.resumes)

    def _untouched(self, predicate) -> list[str]:
        touched = self.pending.touched()
        return sorted(r.request_id for r in self.driver.requests.values() if r.request_id not in touched and predicate(r))

    def _run(self, plan: StepPlan) -> None:
        out = self.engine.step(plan)
        expected = self.driver.apply(plan)
        self.driver.check_output(out, expected, plan)
        self.pending = Pending()
        self._steps_since_rejected += 1
        self.stats["steps"] += 1
        self.stats["frames"] += len(expected.frames)
        self.stats["batched_steps"] += len(expected.frames) >= 2  # isolation is really at stake
        self.stats["starves"] += len(expected.starved)
        self.stats["feeds"] += len(expected.fed)
        self.stats["mixed_steps"] += expected.sampling_rows > 0 and (
            expected.prefill_rows > 0 or any(r is None for r in plan.rows))

    # -- host events (staged for the next plan) ------------------------------------------

    @precondition(lambda self: self.admitted < self.max_requests and self._free_after_pending() > 0)
    @rule(data=st.data())
    def admit(self, data):
        """Stage 1..(free slots) new requests."""
        room = min(self._free_after_pending(), self.max_requests - self.admitted)
        for _ in range(data.draw(st.integers(1, room), label="admissions")):
            definition = data.draw(self.request_defs, label="request")
            rid, inputs = f"r{self.admitted}", definition.inputs
            if self.feeding:  # only part of the feed is there at admission; the rest comes by `feed`
                upfront = data.draw(st.just(0) | st.integers(0, len(inputs.feed)), label="feed upfront")
                inputs = attrs.evolve(inputs, feed_upfront=upfront)
                self.unfed[rid], self.feed_ends[rid] = list(inputs.feed[upfront:]), inputs.feed_done
            self.pending.new.append(definition.new_request(rid, inputs=inputs))
            self.admitted += 1

    def _abortable(self):
        return self._untouched(lambda r: r.state in self.classes.live or r.state in (State.PREEMPTED, State.STARVED))

    def _preemptable(self):
        return self._untouched(lambda r: r.slot is not None and (r.state in self.classes.live
                                                                 or r.state is State.STARVED))

    def _resumable(self):
        if self._free_after_pending() <= 0:
            return []
        return self._untouched(lambda r: r.state is State.PREEMPTED and self.driver.ready_to_resume(r.request_id))

    def _releasable(self):
        return self._untouched(lambda r: r.slot is not None and r.state in self.classes.terminal)

    @precondition(lambda self: self._abortable())
    @rule(data=st.data())
    def abort(self, data):
        self.pending.aborts.append(data.draw(st.sampled_from(self._abortable()), label="abort"))

    @precondition(lambda self: self._preemptable())
    @rule(data=st.data())
    def preempt(self, data):
        self.pending.preempts.append(data.draw(st.sampled_from(self._preemptable()), label="preempt"))

    @precondition(lambda self: self._preemptable())
    @rule(data=st.data())
    def preempt_and_resume(self, data):
        """Preempt a request, run a step without it, then (maybe) stage its resume."""
        rid = data.draw(st.sampled_from(self._preemptable()), label="preempt")
        self.pending.preempts.append(rid)
        self.step_all(data)
        if rid in self._resumable() and data.draw(st.booleans(), label="resume now"):
            self.pending.resumes.append(rid)

    @precondition(lambda self: self._resumable())
    @rule(data=st.data())
    def resume(self, data):
        self.pending.resumes.append(data.draw(st.sampled_from(self._resumable()), label="resume"))

    @precondition(lambda self: self._releasable())
    @rule(data=st.data())
    def release(self, data):
        self.pending.releases.append(data.draw(st.sampled_from(self._releasable()), label="release"))

    # -- the conditioning feed (applied at once, between steps) ---------------------------

    def _feedable(self) -> list[str]:
        """Requests in the engine, not ended, with rows still to come or a `done` to declare."""
        return sorted(rid for rid, r in self.driver.requests.items()
                      if r.state not in self.classes.terminal and not self.driver.feed_done(rid)
                      and (self.unfed[rid] or self.feed_ends[rid]))

    def _feed(self, rid: str, n: int) -> None:
        rest = self.unfed[rid]
        done = self.feed_ends[rid] and n == len(rest)
        self.engine.feed(rid, self.engine.model.feed_rows(rest[:n]), done=done)
        self.stats["feeds"] += self.driver.feed(rid, n, done)
        self.stats["fed_rows"] += n
        del rest[:n]

    def _feed_waiting(self, data) -> None:
        """A host that keeps up: each request waiting for a row maybe gets at least one more
        row (or its `done`)."""
        for rid in self._waiting_rows():
            if data.draw(st.booleans(), label=f"feed {rid}"):
                left = len(self.unfed[rid])
                self._feed(rid, data.draw(st.integers(min(left, 1), left), label="rows"))
                self.driver.check_engine(self.engine)

    @precondition(lambda self: self.feeding and self._feedable())
    @rule(data=st.data())
    def feed(self, data):
        """Conditioning rows for one request (starved, decoding, prefilling, preempted, or
        staged for a host event): a random prefix of the rest, maybe none; the call that
        brings the last row of a complete feed declares it done."""
        rid = data.draw(st.sampled_from(self._feedable()), label="feed")
        self._feed(rid, data.draw(st.integers(0, len(self.unfed[rid])), label="rows"))

    # -- steps --------------------------------------------------------------------------

    def _rows(self, data, candidates, full: bool) -> list[Span | None]:
        if full:
            order = data.draw(st.permutations(range(len(candidates))), label="row order")
        elif candidates:
            order = data.draw(st.lists(st.sampled_from(range(len(candidates))), unique=True), label="rows")
        else:
            order = []
        rows: list[Span | None] = []
        for i in order:
            rid, left = candidates[i]
            if left is None and full and not data.draw(st.booleans(), label="overrun"):
                continue
            if left:  # prefill: a chunk of 1..left tokens (the whole rest, mostly, when `full`)
                n = left if full and data.draw(st.booleans(), label="whole") else data.draw(st.integers(1, left))
            else:  # decode row, or a finished/aborted row scheduled once more (async overrun)
                n = 1
            rows.append(Span(rid, n))
        for _ in range(data.draw(st.integers(0, 2), label="padding")):
            rows.insert(data.draw(st.integers(0, len(rows)), label="pad at"), None)
        return rows

    def _busy(self) -> bool:
        """Something staged or holding a slot (an empty engine's no-op step is a regression test)."""
        return bool(self.pending.touched()) or any(r.slot is not None for r in self.driver.requests.values())

    @precondition(_busy)
    @rule(data=st.data())
    def step(self, data):
        """Host events plus a random subset of the schedulable rows, in random order."""
        plan = self.pending.plan()
        self._run(self.pending.plan(self._rows(data, self.driver.schedulable(plan), full=False)))

    @precondition(_busy)
    @rule(data=st.data())
    def step_all(self, data):
        """A scheduler-like step: every live request advances (random order, random chunks);
        each finished/aborted request is either released now or scheduled as an overrun;
        a request waiting for a conditioning row may get it first."""
        self._feed_waiting(data)
        for rid in self._releasable():
            if data.draw(st.booleans(), label=f"release {rid}"):
                self.pending.releases.append(rid)
        plan = self.pending.plan()
        self._run(self.pending.plan(self._rows(data, self.driver.schedulable(plan), full=True)))

    @precondition(_busy)
    @rule(padding=st.integers(0, 2))
    def boundary(self, padding):
        """Only the staged host events (and maybe padding rows): a step that keeps no sample."""
        self._run(self.pending.plan([None] * padding))

    def _waiting_rows(self) -> list[str]:
        """Requests waiting for a conditioning row: starved, or preempted and not ready to resume."""
        if not self.feeding:
            return []
        return [rid for rid in self._feedable() if self.driver.requests[rid].state is State.STARVED
                or (self.driver.requests[rid].state is State.PREEMPTED and not self.driver.ready_to_resume(rid))]

    @precondition(lambda self: self.driver.live() or self._waiting_rows())
    @rule(data=st.data(), steps=st.integers(2, 5))
    def burst(self, data, steps):
        """Several scheduler-like steps in a row, so requests run to their end (with a
        conditioning feed, rows for waiting requests may arrive before each step)."""
        for _ in range(steps):
            if not self.driver.live() and not self.pending.touched() and not self._waiting_rows():
                break
            self.step_all(data)
            self.driver.check_engine(self.engine)

    # -- plans the engine must reject whole ---------------------------------------------

    # Refusals of a request waiting for a conditioning row (rare states: drawn half the time when present).
    def _snapshot(self):
        ledger = self.engine.ledger
        columns = {k: v.clone() for k, v in self.engine.table.columns().items()}
        synced = ledger.records.items()
        records = {rid: (r.slot, r.serial, r.num_computed, r.num_frames, r.state, r.feed_count, r.feed_done)
                   for rid, r in synced}
        cache = getattr(self.engine.model, "cache", None)
        free = sorted(set(range(self.engine.max_slots)) - ledger.allocator.in_use())
        return columns, records, free, None if cache is None else cache.clone()

    @precondition(lambda self: self._steps_since_rejected >= 2)  # cheap, but keep steps the bulk
    @rule(data=st.data())
    def rejected_plan(self, data):
        """An invalid plan (mixed with the staged valid events) changes nothing at all."""
        self._steps_since_rejected = 0
        bad = bad_plans(self)
        waiting = sorted(k for k in bad if k in WAITING_KINDS)
        if waiting and data.draw(st.booleans(), label="waiting kind"):
            kind = data.draw(st.sampled_from(waiting), label="bad plan")
        else:
            kind = data.draw(st.sampled_from(sorted(bad)), label="bad plan")
        plan, error, rid = bad[kind]
        before = self._snapshot()
        try:
            plan() if callable(plan) else self.engine.step(plan)
        except error as exc:
            assert rid in str(exc), f"{kind}: error does not name {rid!r}: {exc}"
        else:
            raise AssertionError(f"{kind}: engine accepted an invalid plan {plan}")
        after = self._snapshot()
        cols0, cols1 = before[0], after[0]
        changed = [k for k in cols0 if not _same(cols0[k], cols1[k])]
        assert not changed, f"{kind}: rejected plan changed slot-table columns {changed}"
        assert before[1:3] == after[1:3], f"{kind}: rejected plan changed the ledger or the allocator"
        assert _same(before[3], after[3]), f"{kind}: rejected plan touched the model cache"
        self.stats["rejected"] += 1

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def engine_matches_oracle(self):
        self.driver.check_engine(self.engine)

    def teardown(self):
        COVERAGE[self.engine.lifecycle.name].update(self.driver.oracle.fired)
        self.stats["examples"] += 1
        self.stats["seconds_x1000"] += int(1000 * (time.perf_counter() - self._started))


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and bool(((a == b) | (a != a) & (b != b)).all())


def lifecycle_test_case(model_factory: ModelFactory = scripted_mtp, *, settings=None, **kwargs: Any):
    """A unittest TestCase running LifecycleMachine(model_factory, **kwargs) (pytest collects it)."""

    class BoundMachine(LifecycleMachine):
        def __init__(self) -> None:
            super().__init__(model_factory, **kwargs)

    BoundMachine.__name__ = BoundMachine.__qualname__ = f"LifecycleMachine_{getattr(model_factory, '__name__', 'model')}"
    case = BoundMachine.TestCase
    if settings is not None:
        case.settings = settings
    return case


__all__ = [
    "COVERAGE", "STATS", "LifecycleMachine", "Pending", "lifecycle_test_case", "scripted_requests",
    "scripted_mtp", "scripted_single",
]
