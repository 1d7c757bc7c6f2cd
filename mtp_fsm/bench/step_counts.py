"""Whole-step counts of the bench's designs and of the engine at every batch size (uses `counters`)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .counters import StepCounter, StepCounts


def count_call(fn: Callable[[], object]) -> StepCounts:
    """Counts of any callable with no tracking beforehand (tensors that exist already count
    as device tensors)."""
    return StepCounter().count(fn)


def count_design_step(driver_factory: Callable[[], object], warm_steps: int = 1) -> tuple[object, StepCounts]:
    """Build a driver and admit its requests while tracking, run `warm_steps` tracked
    steps, then count one steady step: (driver, counts)."""
    counter = StepCounter()
    with counter.tracking():
        driver = driver_factory()
        driver.admit()
        for _ in range(warm_steps):
            driver.step()
    return driver, counter.count(driver.step, getattr(driver, "engine", None))


def engine_counts_by_batch(
    model_factory: Callable[[], object], batch_sizes: Sequence[int], inputs: object
) -> dict[int, dict[str, StepCounts]]:
    """Per batch size: whole-step counts of the admit+prefill step and of a steady decode step.

    Every batch runs on an engine of the same size (the largest batch), so what varies
    is only the number of rows in the step: the engine's per-step work must not."""
    from ..engine import Span, StepPlan
    from ..sampling.noise import gumbel_table
    from .drivers import EngineDriver, make_requests

    out = {}
    max_slots = max(batch_sizes)
    for b in batch_sizes:
        gumbel_table(torch.device("cpu"))  # built lazily on first use: not part of any step
        counter = StepCounter()
        with counter.tracking():
            driver = EngineDriver(model_factory(), make_requests(b, inputs), max_slots=max_slots)
        lengths = [int(driver.engine.model.prepare(r.inputs).prompt_embeds.shape[0]) for r in driver.requests]
        admit_plan = StepPlan(
            new_requests=tuple(r.to_new() for r in driver.requests),
            rows=tuple(Span(r.request_id, n) for r, n in zip(driver.requests, lengths)),
        )
        admit = counter.count(lambda: driver.engine.step(admit_plan), driver.engine)
        with counter.tracking():
            driver.step()  # the first decode step after prefill, then count a steady one
        decode = counter.count(driver.step, driver.engine)
        out[b] = {"admit": admit, "decode": decode}
    return out


def constant_in_batch(counts: dict[int, dict[str, StepCounts]], phase: str = "decode") -> tuple[bool, list[str]]:
    """Whether `phase` counts are identical at every batch size; else what differs."""
    sizes = sorted(counts)
    base = counts[sizes[0]][phase]
    diffs = []
    for b in sizes[1:]:
        other = counts[b][phase]
        if other.key() != base.key():
            stages = set(base.by_stage) | set(other.by_stage)
            moved = {s: (base.by_stage.get(s, 0), other.by_stage.get(s, 0)) for s in sorted(stages)
                     if base.by_stage.get(s, 0) != other.by_stage.get(s, 0)}
            diffs.append(f"B={sizes[0]} vs B={b}: ops {base.kernels}->{other.kernels}, H2D {base.h2d}->{other.h2d}, "
                         f"D2H {base.d2h}->{other.d2h}, syncs {base.syncs}->{other.syncs}, stages {moved}")
    return not diffs, diffs
