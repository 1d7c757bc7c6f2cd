"""Side-by-side step timing of the designs at one batch size, interleaved across repetitions."""

from __future__ import annotations

import gc
import time
from typing import Sequence

from .._util.stats import percentile
from .drivers import DRIVERS, check_same_frames, make_requests
from .null_model import NullConfig, NullInputs, NullTalker

PROMPT_LEN = 4


def summary_ms(times_s: Sequence[float]) -> dict:
    ms = [1e3 * t for t in times_s]
    return {"median_ms": percentile(ms, 50), "p10_ms": percentile(ms, 10), "p90_ms": percentile(ms, 90), "n": len(ms)}


def bench_batch(
    config: NullConfig,
    batch: int,
    designs: Sequence[str],
    *,
    budget_s: float,
    min_reps: int = 3,
    max_reps: int = 30,
    log=print,
) -> dict:
    """Time one decode step of every design at `batch`, alternating designs in each repetition.

    All designs get the same requests (seeds, sampling) and the same precomputed model
    outputs; every step's published frames (request, index, codes) are checked identical.
    Repetitions = budget_s / (sum of one warm step of each design), within [min_reps, max_reps].
    """
    requests = make_requests(batch, NullInputs(PROMPT_LEN))
    drivers, setup_s, admit_s, first = {}, {}, {}, {}
    for name in designs:
        t0 = time.perf_counter()
        drivers[name] = DRIVERS[name](NullTalker(config), requests)
        setup_s[name] = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = drivers[name].admit()
        admit_s[name] = time.perf_counter() - t0
        first[name] = drivers[name].frames(out)
    check_same_frames(first)
    warm = {}
    outs = {}
    for name in designs:
        t0 = time.perf_counter()
        out = drivers[name].step()
        warm[name] = time.perf_counter() - t0
        outs[name] = drivers[name].frames(out)
    check_same_frames(outs)
    room = config.max_context - PROMPT_LEN - 3  # decode steps the slot table has room for
    reps = max(min_reps, min(max_reps, room, int(budget_s / max(sum(warm.values()), 1e-9))))
    times: dict[str, list[float]] = {name: [] for name in designs}
    per_step_frames: dict[str, set[int]] = {name: set() for name in designs}
    gc.collect()
    gc.disable()
    try:
        for rep in range(reps):
            order = list(designs[rep % len(designs):]) + list(designs[: rep % len(designs)])
            outs = {}
            for name in order:
                t0 = time.perf_counter()
                out = drivers[name].step()
                times[name].append(time.perf_counter() - t0)
                outs[name] = out
            frames = {name: drivers[name].frames(outs[name]) for name in designs}
            for name, count in check_same_frames(frames).items():
                per_step_frames[name].add(count)
    finally:
        gc.enable()
    engine_median = percentile(times[designs[0]], 50)
    result = {"batch": batch, "reps": reps, "designs": {}}
    for name in designs:
        s = summary_ms(times[name])
        s["ratio_vs_engine"] = percentile(times[name], 50) / engine_median
        s["frames_per_step"] = sorted(per_step_frames[name])
        s["setup_ms"] = 1e3 * setup_s[name]
        s["admit_prefill_step_ms"] = 1e3 * admit_s[name]
        result["designs"][name] = s
    result["frames_identical"] = True  # check_same_frames raised otherwise
    log("  B=%-5d reps=%-3d %s" % (batch, reps, "  ".join(
        f"{n} {result['designs'][n]['median_ms']:.2f}ms" + ("" if n == designs[0] else f" (x{result['designs'][n]['ratio_vs_engine']:.1f})")
        for n in designs)))
    return result


def bench_sweep(
    config: NullConfig,
    batch_sizes: Sequence[int],
    designs: Sequence[str] = tuple(DRIVERS),
    *,
    budget_s: float = 8.0,
    naive_max_batch: int | None = None,
    log=print,
) -> dict:
    """bench_batch at every size; naive designs above `naive_max_batch` are skipped (recorded)."""
    out = {}
    for b in batch_sizes:
        names = [d for d in designs if d == "engine" or naive_max_batch is None or b <= naive_max_batch]
        res = bench_batch(config, b, names, budget_s=budget_s, log=log)
        for d in designs:
            if d not in names:
                res["designs"][d] = {"skipped": f"not run above batch {naive_max_batch} (time budget)"}
        out[b] = res
    return out


def bench_engine_scaling(config: NullConfig, batch_sizes: Sequence[int], *, reps: int = 20, log=print) -> dict:
    """Engine decode step at several batch sizes, stepped alternately (paired in time), so the
    ratio between sizes is not skewed by load that changes between the sweep's batch sizes."""
    from .drivers import EngineDriver

    drivers = {}
    for b in batch_sizes:
        drivers[b] = EngineDriver(NullTalker(config), make_requests(b, NullInputs(PROMPT_LEN)))
        drivers[b].admit()
        drivers[b].step()
    reps = min(reps, config.max_context - PROMPT_LEN - 3)
    times: dict[int, list[float]] = {b: [] for b in batch_sizes}
    gc.collect()
    gc.disable()
    try:
        for _ in range(reps):
            for b in batch_sizes:
                t0 = time.perf_counter()
                drivers[b].step()
                times[b].append(time.perf_counter() - t0)
    finally:
        gc.enable()
    out = {b: summary_ms(t) for b, t in times.items()}
    base = batch_sizes[0]
    ratios = [t / s for t, s in zip(times[batch_sizes[-1]], times[base])]
    out["paired_ratio_last_vs_first"] = percentile(ratios, 50)
    log(f"  engine alone, alternating B={list(batch_sizes)}: " + ", ".join(f"B={b} {out[b]['median_ms']:.2f}ms" for b in batch_sizes)
        + f"; B={batch_sizes[-1]}/B={base} = {out['paired_ratio_last_vs_first']:.2f} (median of paired ratios)")
    return out
