"""Test drivers on the engine's high-level API: run requests to completion, with injected events."""

from __future__ import annotations

import copy
from typing import Callable, Iterable

import attrs

from ..engine import LockstepEngine, NewRequest, Span, StepOutput
from ..engine.scheduler import SchedulingPolicy

Frames = dict[str, list[tuple[int, tuple[int, ...]]]]
UNBOUNDED = 1 << 30


def next_rows(engine: LockstepEngine, chunk: int) -> tuple[Span, ...]:
    """One row per slot-holding live request: a prefill chunk of <= chunk tokens or a decode token."""
    rows = []
    for rid, record in engine.ledger.all_records():
        if record.slot is not None and record.state in engine.ledger.live_states:
            left = record.prompt_len - record.num_computed
            rows.append(Span(rid, min(chunk, left) if left > 0 else 1))
    return tuple(rows)


def run_to_completion(
    engine: LockstepEngine,
    requests: Iterable[NewRequest],
    *,
    chunk: int = UNBOUNDED,
    events: Callable[[int, LockstepEngine], dict] | None = None,
) -> tuple[Frames, dict[str, object]]:
    """`engine.generate` with prefill chunks of `chunk` tokens (no token budget), plus requests
    the engine already holds. events(step, engine) runs before each step and may return
    `preempts` / `aborts` for it. Returns (frames per request, finish reason per request)."""
    engine.scheduler.policy = attrs.evolve(engine.scheduler.policy, token_budget=UNBOUNDED, prefill_chunk=chunk)
    frames: Frames = {}
    reasons: dict[str, object] = {}

    def inject(step: int) -> None:
        wanted = events(step, engine) if events is not None else {}
        for rid in wanted.get("preempts", ()):
            engine.preempt(rid)
        for rid in wanted.get("aborts", ()):
            engine.abort(rid)

    def on_step(_engine: LockstepEngine, out: StepOutput) -> None:
        collect(out, frames)
        reasons.update((f.request_id, f.reason) for f in out.finished)
        inject(out.step + 1)

    inject(engine.step_count)
    engine.generate(requests, on_step=on_step)
    return frames, reasons


def collect(out: StepOutput, frames: Frames) -> None:
    for frame in out.frames:
        frames.setdefault(frame.request_id, []).append((frame.index, tuple(frame.codes.tolist())))


def frames_alone(model, request: NewRequest, *, chunk: int = UNBOUNDED, **engine_kwargs) -> list[tuple[int, tuple[int, ...]]]:
    """The frames a request produces alone in a fresh one-slot engine, on a copy of the model
    (a model's slot state belongs to one engine; the caller's may be bound to another)."""
    engine = LockstepEngine(copy.deepcopy(model), 1, policy=SchedulingPolicy(UNBOUNDED, chunk), **engine_kwargs)
    result = engine.generate([request])[request.request_id]
    return [(f.index, tuple(f.codes.tolist())) for f in result.frames]
