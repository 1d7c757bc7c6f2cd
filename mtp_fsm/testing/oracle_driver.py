"""Drive the lifecycle oracle from StepPlans: the expected world a test holds the engine to.

`OracleDriver` keeps, per request, a `RequestFSM` in its own `Oracle` plus the host facts
(prompt length, positions computed, frames published, predicted slot). For each StepPlan it
fires the plan's host triggers, then runs every scheduled row through the spec's stage
chains (`Oracle.run_phase`, guards evaluated by `transitions`) with that row's predicates.
What a kept sample is (a frame, the codec EOS, a sampling fault) comes from the same
request run alone by the reference interpreter (`ReferenceRuns`, cached per definition),
so comparing the engine's outputs with the driver's expectations checks states,
publication rules and request isolation at once.

A model with a conditioning feed (variant `conditioned`): the driver keeps each request's
own feed facts (rows fed so far, whether the feed is done) and applies the starvation rule
itself, independently of the engine's ConditioningFeed: at every step boundary and after
every `feed`, a slot-holding `decoding` request whose next conditioning row (index
max(num_frames - 1, 0)) is missing fires STARVE, and a `starved` one whose row is there
fires FEED; a row is there when index < rows fed or the feed is done. A starved request is
never schedulable, and a preempted one resumes only once row num_frames - 1 is there (or it
has no frames). Frames are the alone run of the request with its whole feed upfront.
"""

from __future__ import annotations

import heapq
from collections import Counter

import attrs

from ..engine import LockstepEngine, Span, StepOutput, StepPlan
from ..lifecycle import FinishReason, Oracle, Phase, Predicate, RequestFSM, State, Trigger, length_reached, prompt_done
from ..lifecycle.predicates import delay_facts, eos_frame
from ..lifecycle.spec import LifecycleSpec
from ..model_api import FEED_COUNT, FEED_DONE, ModelSpec, PreparedPrompt
from .alone import RequestDef
from .references import ReferenceRuns



class DriverRecord:
    """The expected world's own record of a request (plain fields and its own `transitions`
    model; nothing shared with the engine's request table)."""

    __slots__ = ("request", "fsm", "prepared", "slot", "prompt_len", "num_computed", "num_frames", "finish_reason")

    def __init__(self, request, fsm: RequestFSM, prepared: PreparedPrompt) -> None:
        self.request, self.fsm, self.prepared = request, fsm, prepared
        self.slot: int | None = None
        self.prompt_len = self.base_prompt_len
        self.num_computed = self.num_frames = 0
        self.finish_reason = FinishReason.NONE

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def state(self) -> State:
        return self.fsm.code

    @property
    def base_prompt_len(self) -> int:
        return int(self.prepared.prompt_embeds.shape[0])

@attrs.define
class Expected:
    """What the engine must report for one step."""

    frames: list[tuple[str, int, tuple[int, ...]]] = attrs.field(factory=list)
    valid: list[bool] = attrs.field(factory=list)
    finished: Counter = attrs.field(factory=Counter)
    row_triggers: list[tuple[str | None, tuple[Trigger, ...]]] = attrs.field(factory=list)
    num_tokens: int = 0
    # Live rows that computed a non-final prompt chunk / that finished their prompt (sampled).
    prefill_rows: int = 0
    sampling_rows: int = 0
    # Requests the step boundary moved to `starved` / back to `decoding` (conditioning feed).
    starved: list[str] = attrs.field(factory=list)
    fed: list[str] = attrs.field(factory=list)


@attrs.define
class FeedFacts:
    """The driver's own record of one request's conditioning feed."""

    count: int = 0  # rows fed so far (upfront ones included)
    done: bool = False  # no more rows will come (the model supplies its end-of-feed rows)

    def has_row(self, index: int) -> bool:
        return index < self.count or self.done


class OracleDriver:
    """The expected world: per-request oracle FSMs, host counters and the slot allocator."""

    def __init__(self, spec: ModelSpec, max_slots: int, refs: ReferenceRuns, lifecycle: LifecycleSpec) -> None:
        self.spec, self.max_slots, self.refs = spec, max_slots, refs
        self.oracle = Oracle(lifecycle)
        self.lifecycle, self.classes = lifecycle, lifecycle.classes
        self._stop_in_mtp = Predicate.MTP_STOP in lifecycle.predicates_read()
        self.requests: dict[str, DriverRecord] = {}
        self._free = list(range(max_slots))  # lowest free slot first, like the engine must
        self.steps = 0
        self.has_feed = spec.has_feed
        self.feeds: dict[str, FeedFacts] = {}  # per request (conditioned models only)
        self._whole: dict[RequestDef, RequestDef] = {}  # definition -> its whole-feed reference key

    # -- queries ------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    def _next_row(self, r: DriverRecord) -> int:
        """The conditioning row the request's next decode step reads: its text step carries
        the last published frame."""
        return max(r.num_frames - 1, 0)

    def ready_to_resume(self, rid: str) -> bool:
        """A resume replays the published frames with their text steps (rows 0..num_frames-1)."""
        r = self.requests[rid]
        return not self.has_feed or r.num_frames == 0 or self.feeds[rid].has_row(r.num_frames - 1)

    def feed_done(self, rid: str) -> bool:
        return not self.has_feed or self.feeds[rid].done

    def schedulable(self, plan: StepPlan) -> list[tuple[str, int | None]]:
        """Rows that may follow `plan`'s host events: (rid, prompt tokens left; 0 = decode,
        None = terminal, schedulable only as an overrun)."""
        gone = set(plan.aborts) | set(plan.preempts) | set(plan.releases)
        out: list[tuple[str, int | None]] = []
        for r in self.requests.values():
            if r.request_id in plan.resumes:
                out.append((r.request_id, r.base_prompt_len + r.num_frames))
            elif r.request_id in gone or r.slot is None:
                continue
            elif r.state in self.classes.terminal:
                out.append((r.request_id, None))
            elif r.state is State.STARVED:
                continue  # waits for a conditioning row: the engine refuses its rows
            else:
                out.append((r.request_id, max(r.prompt_len - r.num_computed, 0)))
        out += [(q.request_id, self.refs.prompt_len(q.inputs)) for q in plan.new_requests]
        return out

    # -- the plan -----------------------------------------------------------------------

    def apply(self, plan: StepPlan) -> Expected:
        """Fire every trigger the (valid) plan implies; return what the engine must report."""
        exp, fire = Expected(), self.oracle.fire
        for rid in plan.releases:
            r = self.requests.pop(rid)
            self.feeds.pop(rid, None)
            fire(r.fsm, Trigger.RELEASE)
            self._release(r)
        for rid in plan.aborts:
            r = self.requests.pop(rid)
            self.feeds.pop(rid, None)
            fire(r.fsm, Trigger.ABORT)
            if r.slot is not None:
                fire(r.fsm, Trigger.RELEASE)
                self._release(r)
            exp.finished[(rid, FinishReason.ABORT, r.num_frames)] += 1
        for rid in plan.preempts:
            r = self.requests[rid]
            fire(r.fsm, Trigger.PREEMPT)
            # The slot row (not the request) is released: PREEMPTED -> FREE on the device.
            fire(RequestFSM(rid + "#row", State.PREEMPTED), Trigger.RELEASE)
            self._release(r)
        admitted = []
        for rid in plan.resumes:
            r = self.requests[rid]
            fire(r.fsm, Trigger.RESUME)
            r.prompt_len, r.num_computed = r.base_prompt_len + r.num_frames, 0
            admitted.append(r)
        for q in plan.new_requests:
            # The expected world's own record of the request (same type as the engine's, not shared).
            prepared = self.refs.prepared(q.inputs)
            r = DriverRecord(q, self.oracle.new(q.request_id), prepared)
            fire(r.fsm, Trigger.ADMIT)
            self.requests[r.request_id] = r
            if self.has_feed:
                rows = 0 if prepared.feed is None else int(prepared.feed.shape[0])
                self.feeds[r.request_id] = FeedFacts(rows, bool(prepared.feed_done))
            admitted.append(r)
        for r in admitted:
            r.slot = heapq.heappop(self._free)
        for span in plan.rows:
            self._row(span, exp)
        self.steps += 1
        exp.starved, exp.fed = self._refresh(list(self.requests.values()))
        return exp

    # -- the conditioning feed ------------------------------------------------------------

    def feed(self, rid: str, num_rows: int, done: bool) -> bool:
        """`engine.feed(rid, <num_rows rows>, done=done)` was accepted: the request's feed
        grows, and that request alone is refreshed at once. True when it fired FEED."""
        r, facts = self.requests[rid], self.feeds[rid]
        assert r.state not in self.classes.terminal and not facts.done, f"driver: {rid!r} cannot be fed"
        facts.count += num_rows
        facts.done = bool(done)
        return bool(self._refresh([r])[1])

    def _refresh(self, records: list[DriverRecord]) -> tuple[list[str], list[str]]:
        """STARVE for slot-holding decoding requests missing their next row, FEED for starved
        ones that have it (request ids starved, fed)."""
        starved: list[str] = []
        fed: list[str] = []
        if not self.has_feed:
            return starved, fed
        for r in records:
            if r.slot is None:
                continue
            ready = self.feeds[r.request_id].has_row(self._next_row(r))
            if r.state is State.DECODING and not ready:
                self.oracle.fire(r.fsm, Trigger.STARVE)
                starved.append(r.request_id)
            elif r.state is State.STARVED and ready:
                self.oracle.fire(r.fsm, Trigger.FEED)
                fed.append(r.request_id)
        return starved, fed

    def _release(self, r: DriverRecord) -> None:
        heapq.heappush(self._free, r.slot)
        r.slot = None

    def _row(self, span: Span | None, exp: Expected) -> None:
        if span is None:
            exp.valid.append(False)
            exp.row_triggers.append((None, ()))
            return
        exp.num_tokens += span.num_tokens
        r = self.requests[span.request_id]
        live = r.state in self.classes.live
        done = prompt_done(r.num_computed, span.num_tokens, r.prompt_len)
        if live:
            r.num_computed += span.num_tokens
            exp.sampling_rows += done
            exp.prefill_rows += not done
        outcome = self._outcome(r) if live and done else {}
        edges: list[tuple[Trigger, State]] = []  # every edge the row fired: (trigger, source)
        for phase in Phase:
            def facts(stage, fired, phase=phase) -> dict[Predicate, bool]:
                # An eos ending is sampled by CB0, or decided by the MTP stage where the spec says so.
                eos = outcome.get("eos", False)
                if phase is Phase.SAMPLE:
                    return {Predicate.PROMPT_DONE: done, Predicate.CB0_FAULT: outcome.get("cb0", False),
                            Predicate.EOS_SAMPLED: eos and not self._stop_in_mtp}
                if phase is Phase.MTP:
                    return {Predicate.MTP_FAULT: outcome.get("mtp", False), Predicate.MTP_STOP: eos and self._stop_in_mtp}
                frames = r.num_frames + sum(self._publishes(e) for e in (*edges, *fired))  # counted once published
                return {Predicate.LENGTH_REACHED: length_reached(
                    frames, r.request.max_frames, r.num_computed, self.spec.max_context), **self._frame_facts(r)}

            for edge in self.oracle.run_phase_edges(r.fsm, phase, facts):
                edges.append(edge)
        published = any(self._publishes(e) for e in edges)
        if published:
            exp.frames.append((r.request_id, r.num_frames, self._alone(r).frames[r.num_frames]))
            r.num_frames += 1
        for edge in edges:
            reason = self.lifecycle.transition(*edge).reason
            if reason is not FinishReason.NONE:
                self._end(r, reason, exp)
        exp.valid.append(published)
        exp.row_triggers.append((r.request_id, tuple(t for t, _ in edges)))

    def _alone(self, r: DriverRecord):
        """The request's alone run with its whole conditioning feed upfront: rows fed late
        must not change a frame."""
        d = RequestDef.of(r.request)
        key = self._whole.get(d)
        if key is None:
            whole = getattr(d.inputs, "whole_feed", None)
            key = self._whole[d] = d if whole is None else attrs.evolve(d, inputs=whole())
        return self.refs.get(key)

    def _frame_facts(self, r: DriverRecord) -> dict[Predicate, bool]:
        """The facts about the frame the row would publish (its alone run's next one): the
        delay pattern's, and whether it is a stop frame."""
        pattern, alone = self.spec.delay_pattern, self._alone(r).frames
        codes = alone[r.num_frames] if r.num_frames < len(alone) else ()
        eoc = None if pattern is None or not codes else pattern.eoc
        previous = alone[r.num_frames - 1] if 0 < r.num_frames <= len(alone) else None
        return {Predicate.EOS_FRAME: eos_frame(codes, self.spec.eos_token_id),
                **delay_facts(r.num_frames, codes, self.spec.num_codebooks, eoc, previous)}

    def _publishes(self, edge) -> bool:
        return self.lifecycle.transition(*edge).publishes

    def _outcome(self, r: DriverRecord) -> dict[str, bool]:
        """What the kept sample at the request's next frame index is, per the alone run."""
        f, run = r.num_frames, self._alone(r)
        if f < len(run.frames):
            return {}
        if f > len(run.frames) or run.reason in (FinishReason.LENGTH, FinishReason.NONE):
            raise AssertionError(
                f"oracle: request {r.request_id!r} samples frame {f} but its alone run ended after "
                f"{len(run.frames)} frames with reason {run.reason.label}"
            )
        if run.reason is FinishReason.EOS:
            return {"eos": True}
        return {run.error_kind: True}

    def _end(self, r: DriverRecord, reason: FinishReason, exp: Expected) -> None:
        r.finish_reason = reason
        exp.finished[(r.request_id, reason, r.num_frames)] += 1

    # -- checks -------------------------------------------------------------------------

    def check_output(self, out: StepOutput, exp: Expected, plan: StepPlan) -> None:
        """The step's frames, row validity, row codes and ended requests equal the oracle's."""
        got = [(f.request_id, f.index, tuple(int(c) for c in f.codes)) for f in out.frames]
        if got != exp.frames:
            raise AssertionError(self._explain_frames(got, exp, plan))
        valid = [bool(v) for v in out.rows.valid]
        if valid != exp.valid:
            raise AssertionError(f"step {self.steps - 1}: row validity {valid} != oracle {exp.valid}; rows {exp.row_triggers}")
        codes = out.rows.codes
        for i, ok in enumerate(exp.valid):
            if not ok and bool(codes[i].any()):
                raise AssertionError(f"step {self.steps - 1}: row {i} {exp.row_triggers[i]} carries codes "
                                     f"{codes[i].tolist()} but publishes nothing (stale data leaks)")
        ended = Counter((f.request_id, f.reason, f.num_frames) for f in out.finished)
        if ended != exp.finished:
            raise AssertionError(f"step {self.steps - 1}: ended requests {sorted(ended)} != oracle {sorted(exp.finished)}")
        if out.num_tokens != exp.num_tokens:
            raise AssertionError(f"step {self.steps - 1}: num_tokens {out.num_tokens} != {exp.num_tokens}")

    def _explain_frames(self, got, exp: Expected, plan: StepPlan) -> str:
        lines = [f"step {self.steps - 1}: published frames differ from the oracle (alone runs)"]
        want = {(rid, i): c for rid, i, c in exp.frames}
        have = {(rid, i): c for rid, i, c in got}
        triggers = {rid: t for rid, t in exp.row_triggers if rid is not None}
        for key in sorted(set(want) | set(have), key=str):
            rid, index = key
            if key not in want and rid is None:
                lines.append(f"  a padding row published frame {index} {have[key]}: padding rows are inert")
            elif key not in want:
                why = ", ".join(t.label for t in triggers.get(rid, ())) or "not scheduled"
                lines.append(f"  {rid!r} frame {index} {have[key]} published but the oracle fired [{why}]: "
                             "no frame from a non-final prefill chunk, an EOS sample, a terminal row or another request")
            elif key not in have:
                lines.append(f"  {rid!r} frame {index} {want[key]} missing")
            elif want[key] != have[key]:
                lines.append(f"  {rid!r} frame {index}: engine {have[key]} != alone run {want[key]} "
                             "(request isolation / determinism broken)")
        if [(r, i) for r, i, _ in got] != [(r, i) for r, i, _ in exp.frames]:
            lines.append(f"  order/indices: engine {[(r, i) for r, i, _ in got]} oracle {[(r, i) for r, i, _ in exp.frames]}")
        lines.append(f"  rows: {[None if s is None else (s.request_id, s.num_tokens) for s in plan.rows]}")
        return "\n".join(lines)

    def check_engine(self, engine: LockstepEngine) -> None:
        """Slot ownership, no leaks, device states = oracle states, no sticky error bits."""
        table, ledger = engine.table, engine.ledger
        n = table.max_slots
        state = table.state[:n].tolist()
        errors = table.error[:n].tolist()
        if any(errors):
            raise AssertionError(f"sticky error column set: {errors}")
        if set(engine.requests()) != set(self.requests):
            raise AssertionError(f"engine knows {sorted(engine.requests())}, oracle {sorted(self.requests)}")
        owned: dict[int, str] = {}
        for r in self.requests.values():
            record = ledger.records[r.request_id]
            if record.slot != r.slot:
                raise AssertionError(f"{r.request_id!r} holds slot {record.slot}, deterministic allocation says {r.slot}")
            if engine.request_state(r.request_id) is not r.state:
                raise AssertionError(f"{r.request_id!r}: host mirror {engine.request_state(r.request_id).label} != oracle {r.state.label}")
            if self.has_feed:
                facts = self.feeds[r.request_id]
                if (record.feed_count, record.feed_done) != (facts.count, facts.done):
                    raise AssertionError(f"{r.request_id!r}: engine holds {record.feed_count} conditioning rows, "
                                         f"done={record.feed_done}; oracle {facts.count}, done={facts.done}")
                if r.slot is not None:
                    cols = table.extra
                    got = (int(cols[FEED_COUNT][r.slot]), bool(int(cols[FEED_DONE][r.slot])))
                    if got != (facts.count, facts.done):
                        raise AssertionError(f"{r.request_id!r} slot {r.slot}: device feed count/done {got} != "
                                             f"oracle {(facts.count, facts.done)}")
            if r.slot is None:
                continue
            if r.slot in owned:
                raise AssertionError(f"slot {r.slot} owned by {owned[r.slot]!r} and {r.request_id!r}")
            owned[r.slot] = r.request_id
            if state[r.slot] != r.state:
                raise AssertionError(f"{r.request_id!r} slot {r.slot}: device state {State(state[r.slot]).label} "
                                     f"!= oracle {r.state.label}")
            row_frames, row_reason = int(table.num_frames[r.slot]), int(table.finish_reason[r.slot])
            if row_frames != r.num_frames or row_reason != r.finish_reason:
                raise AssertionError(f"{r.request_id!r} slot {r.slot}: device frames/reason {row_frames}/"
                                     f"{FinishReason(row_reason).label} != oracle {r.num_frames}/{r.finish_reason.label}")
            if int(table.serial[r.slot]) != record.serial or record.serial == 0:
                raise AssertionError(f"{r.request_id!r} slot {r.slot}: serial {int(table.serial[r.slot])} != {record.serial}")
        in_use = set(ledger.allocator.in_use())
        if in_use != set(owned) or ledger.allocator.num_free + len(owned) != n:
            raise AssertionError(f"slot leak: allocator in use {sorted(in_use)} free {ledger.allocator.num_free}, "
                                 f"owned {sorted(owned)} of {n}")
        for slot in range(n):
            if slot not in owned and State(state[slot]) not in self.classes.vacant:
                raise AssertionError(f"slot {slot} owned by nobody is in state {State(state[slot]).label}")
            if state[slot] in self.classes.in_step:
                raise AssertionError(f"slot {slot} rests in within-step state {State(state[slot]).label}")

    def live(self) -> list[DriverRecord]:
        return [r for r in self.requests.values() if r.slot is not None and r.state in self.classes.live]

