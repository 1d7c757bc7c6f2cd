"""The invalid plans and feed calls a LifecycleMachine sends: each must be refused whole,
with an MtpFsmError naming the request (built from the machine's staged events and expected world)."""

from __future__ import annotations

import torch

from ..engine import FeedError, Span
from ..errors import (
    AdmissionError, DuplicateRequestError, LifecycleError, PlanError, SlotTableFullError, UnknownRequestError,
)
from ..lifecycle import State
from .alone import RequestDef
from .scripted import ScriptInputs

# Refusals that exist only while a request waits for conditioning rows (drawn more often).
WAITING_KINDS = frozenset({"starved row", "release starved", "resume starved", "resume before its row"})


def bad_plans(machine) -> dict[str, tuple]:
    """kind -> (plan, expected error class, request id the message must name)."""
    p, reqs, spec = machine.pending, machine.driver.requests, machine.spec
    fresh = f"x{machine.admitted}"
    some = RequestDef(ScriptInputs((1, 2, 3)), 2) if machine.scripted else None
    out: dict[str, tuple] = {
        "unknown abort": (p.plan(aborts=["ghost"]), UnknownRequestError, "ghost"),
        "unknown release": (p.plan(releases=["ghost"]), UnknownRequestError, "ghost"),
        "unadmitted row": (p.plan([Span("ghost", 1)]), PlanError, "ghost"),
    }
    if some is not None:
        out["sampling width 2"] = (p.plan(new_requests=[some.new_request(fresh, sampling_width=2)]), AdmissionError, fresh)
        out["max_frames 0"] = (p.plan(new_requests=[some.new_request(fresh, max_frames=0)]), AdmissionError, fresh)
        long = ScriptInputs(tuple(range(spec.max_context)))
        out["prompt too long"] = (p.plan(new_requests=[some.new_request(fresh, inputs=long)]), AdmissionError, fresh)
        extra = [some.new_request(f"{fresh}_{i}") for i in range(max(machine._free_after_pending(), 0) + 1)]
        out["table full"] = (p.plan(new_requests=extra), SlotTableFullError, extra[-1].request_id)
        twice = [some.new_request(fresh), some.new_request(fresh)]
        out["duplicate in plan"] = (p.plan(new_requests=twice), DuplicateRequestError, fresh)
    if reqs and some is not None:
        rid = sorted(reqs)[0]
        out["duplicate id"] = (p.plan(new_requests=[some.new_request(rid)]), DuplicateRequestError, rid)
    for rid in machine._untouched(lambda r: r.slot is not None and r.state in machine.classes.live)[:1]:
        out["release live"] = (p.plan(releases=[rid]), LifecycleError, rid)
        out["resume live"] = (p.plan(resumes=[rid]), LifecycleError, rid)
        r = reqs[rid]
        left = max(r.prompt_len - r.num_computed, 0)
        span = Span(rid, left + 1) if left > 0 else Span(rid, 2)
        out["span too long"] = (p.plan([span]), PlanError, rid)
        out["row twice"] = (p.plan([Span(rid, 1), Span(rid, 1)]), PlanError, rid)
        out["abort and schedule"] = (p.plan([Span(rid, 1)], aborts=[rid]), PlanError, rid)
    for rid in machine._untouched(lambda r: r.state in machine.classes.terminal)[:1]:
        out["abort terminal"] = (p.plan(aborts=[rid]), LifecycleError, rid)
        out["preempt terminal"] = (p.plan(preempts=[rid]), LifecycleError, rid)
    for rid in machine._untouched(lambda r: r.state is State.PREEMPTED)[:1]:
        out["preempted row"] = (p.plan([Span(rid, 1)]), PlanError, rid)
        out["preempt twice"] = (p.plan(preempts=[rid]), LifecycleError, rid)
    for rid in machine._untouched(lambda r: r.slot is not None and r.state is State.STARVED)[:1]:
        out["starved row"] = (p.plan([Span(rid, 1)]), PlanError, rid)
        out["release starved"] = (p.plan(releases=[rid]), LifecycleError, rid)
        out["resume starved"] = (p.plan(resumes=[rid]), LifecycleError, rid)
    # A resume before the conditioning row its replay reads has arrived.
    for rid in machine._untouched(lambda r: r.state is State.PREEMPTED
                               and not machine.driver.ready_to_resume(r.request_id))[:1]:
        span = Span(rid, reqs[rid].base_prompt_len + reqs[rid].num_frames)
        out["resume before its row"] = (p.plan([span], resumes=[rid]), PlanError, rid)
    if machine.feeding:
        out.update(bad_feeds(machine))
    return out


def bad_feeds(machine) -> dict[str, tuple]:
    """kind -> (a feed call the engine must refuse whole, error class, request id)."""
    feed, rows, reqs = machine.engine.feed, machine.engine.model.feed_rows, machine.driver.requests
    width = machine.spec.feed_width or machine.spec.hidden_size

    def call(rid, value, done=False):
        return lambda: feed(rid, value, done=done)

    out: dict[str, tuple] = {"feed unknown": (call("ghost", rows([1])), FeedError, "ghost")}
    for q in machine.pending.new[:1]:  # staged, not yet admitted: not in the engine
        out["feed staged"] = (call(q.request_id, rows([1])), FeedError, q.request_id)
    for rid in machine._untouched(lambda r: r.state in machine.classes.terminal)[:1]:
        out["feed ended"] = (call(rid, rows([1]), True), FeedError, rid)
    for rid in sorted(rid for rid, r in reqs.items() if r.state not in machine.classes.terminal
                      and machine.driver.feed_done(rid))[:1]:
        out["feed after done"] = (call(rid, rows([])), FeedError, rid)
    for rid in sorted(rid for rid, r in reqs.items() if r.state not in machine.classes.terminal
                      and not machine.driver.feed_done(rid))[:1]:
        left = machine.spec.feed_capacity - machine.driver.feeds[rid].count
        out["feed over capacity"] = (call(rid, torch.zeros(left + 1, width, dtype=machine.spec.dtype)), FeedError, rid)
        out["feed bad width"] = (call(rid, torch.zeros(1, width + 1, dtype=machine.spec.dtype), True), FeedError, rid)
        out["feed NaN"] = (call(rid, torch.full((1, width), float("nan"), dtype=machine.spec.dtype)), FeedError, rid)
    return out
