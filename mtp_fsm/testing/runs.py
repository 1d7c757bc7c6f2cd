"""Reference drivers for tests: run requests to completion, alone or batched, with events."""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from ..engine import LockstepEngine, NewRequest, Span, StepOutput, StepPlan

Frames = dict[str, list[tuple[int, tuple[int, ...]]]]


def next_rows(engine: LockstepEngine, chunk: int, order: Callable[[list[str]], list[str]] | None = None) -> tuple[Span, ...]:
    """One row per slot-holding live request: a prefill chunk of <= chunk tokens or a decode token."""
    rows = []
    for rid, record in engine.ledger.records.items():
        engine.ledger.sync(record)
        if record.slot is None or record.state not in engine.ledger.live_states:
            continue
        left = record.prompt_len - record.num_computed
        rows.append(Span(rid, min(chunk, left) if left > 0 else 1))
    if order is not None:
        by_id = {r.request_id: r for r in rows}
        rows = [by_id[rid] for rid in order(list(by_id))]
    return tuple(rows)


def collect(out: StepOutput, frames: Frames) -> None:
    for frame in out.frames:
        frames.setdefault(frame.request_id, []).append((frame.index, tuple(frame.codes.tolist())))


def run_to_completion(
    engine: LockstepEngine,
    requests: Iterable[NewRequest],
    *,
    chunk: int = 1 << 30,
    events: Callable[[int, LockstepEngine], dict] | None = None,
    max_steps: int = 10_000,
) -> tuple[Frames, dict[str, object]]:
    """Admit all requests (as slots allow), step until none is live; release finished ones.

    events(step, engine) may return `preempts` / `aborts` for that step; preempted
    requests are resumed, before any new admission, as soon as a slot is free.
    Returns (frames per request, finish reason per request).
    """
    pending = list(requests)
    preempted: list[str] = []
    frames: Frames = {}
    reasons: dict[str, object] = {}
    to_release: list[str] = []
    for step in range(max_steps):
        extra = events(step, engine) if events else {}
        aborts = [rid for rid in extra.get("aborts", ()) if rid in engine.ledger.records]
        preempted = [rid for rid in preempted if rid not in aborts]
        held = [rid for rid in aborts if engine.ledger.records[rid].slot is not None]
        room = engine.num_free_slots + len(to_release) + len(extra.get("preempts", ())) + len(held)
        resumes, preempted = preempted[:room], preempted[room:]
        room -= len(resumes)
        admit, pending = pending[:room], pending[room:]
        preempted += list(extra.get("preempts", ()))
        plan = StepPlan(
            new_requests=tuple(admit), releases=tuple(to_release), resumes=tuple(resumes),
            preempts=tuple(extra.get("preempts", ())), aborts=tuple(aborts),
        )
        # Stage the boundary first so rows see this step's admissions and events.
        rows = _rows_after(engine, plan, chunk)
        out = engine.step(StepPlan(**{**_fields(plan), "rows": rows}))
        collect(out, frames)
        to_release = []
        for fin in out.finished:
            reasons[fin.request_id] = fin.reason
            if fin.request_id in engine.ledger.records:
                to_release.append(fin.request_id)
        live = [r for _, r in engine.ledger.all_records() if r.state not in engine.ledger.terminal_states]
        if not pending and not live and not to_release and not preempted:
            return frames, reasons
    raise RuntimeError(f"requests did not finish within {max_steps} steps")


def _fields(plan: StepPlan) -> dict:
    return {k: getattr(plan, k) for k in ("new_requests", "aborts", "preempts", "resumes", "releases")}


def _rows_after(engine: LockstepEngine, plan: StepPlan, chunk: int) -> tuple[Span, ...]:
    """Rows for live requests as they will be after the plan's boundary events."""
    gone = set(plan.aborts) | set(plan.preempts) | set(plan.releases)
    rows = [r for r in next_rows(engine, chunk) if r.request_id not in gone]
    for rid in plan.resumes:
        record = engine.ledger.records[rid]
        prompt = int(record.prepared.prompt_embeds.shape[0]) + record.num_frames
        rows.append(Span(rid, min(chunk, prompt)))
    for req in plan.new_requests:
        prompt = int(engine.model.prepare(req.inputs).prompt_embeds.shape[0])
        rows.append(Span(req.request_id, min(chunk, prompt)))
    return tuple(rows)


def frames_alone(model, request: NewRequest, *, chunk: int = 1 << 30, **engine_kwargs) -> list[tuple[int, tuple[int, ...]]]:
    """The frames a request produces alone in a fresh one-slot engine (the isolation reference)."""
    engine = LockstepEngine(model, 1, **engine_kwargs)
    frames, _ = run_to_completion(engine, [request], chunk=chunk)
    return frames.get(request.request_id, [])


def codes_tensor(frames: list[tuple[int, tuple[int, ...]]]) -> torch.Tensor:
    return torch.tensor([c for _, c in frames], dtype=torch.int64)
