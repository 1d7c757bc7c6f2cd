"""Side-by-side step timing of the designs at one batch size, interleaved across repetitions.

Every repetition steps each design once (the order rotates), so all designs see the same
machine load; lifecycle overhead is the median over repetitions of the paired difference
(design step - floor step, both from that repetition), which cancels load that drifts
between repetitions. Each step records wall time and the thread's CPU time: with torch
limited to one intra-op thread the whole step runs on this thread, so CPU time leaves out
the time other processes on a shared machine take the core away.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Sequence

from .._util.stats import percentile
from .counters import StepCounter
from .drivers import DRIVERS, check_same_frames, driver_class, make_requests
from .null_model import NullConfig, NullInputs, NullTalker

PROMPT_LEN = 4
FLOOR = "floor"
CLOCKS = ("wall", "cpu")


def summary_ms(times_s: Sequence[float]) -> dict:
    ms = [1e3 * t for t in times_s]
    return {"median_ms": percentile(ms, 50), "p10_ms": percentile(ms, 10), "p90_ms": percentile(ms, 90), "n": len(ms)}


def paired(times: dict[str, list[float]], name: str, base: str) -> dict:
    """Overhead (median of design - base per repetition, ms) and ratio (median of
    design / base per repetition) over the repetitions both designs ran."""
    pairs = list(zip(times[name], times[base]))
    return {"overhead_ms": percentile([1e3 * (d - f) for d, f in pairs], 50),
            "ratio": percentile([d / f for d, f in pairs], 50)}


def bench_batch(
    config: NullConfig,
    batch: int,
    designs: Sequence[str],
    *,
    budget_s: float,
    min_reps: int = 3,
    max_reps: int = 30,
    count: bool = True,
    log=print,
) -> dict:
    """Time one decode step of every design at `batch`, alternating designs in each repetition.

    All designs get the same requests (seeds, sampling) and the same precomputed model
    outputs; every step's published frames (request, index, codes) are checked identical.
    Before the timed steps each design is built, admitted and stepped once under the op
    counter (tracking), then one steady step is counted (ops, copies, syncs; `count`); a
    design whose driver is not `countable` (compiled code) is timed only.
    Repetitions run until `budget_s` of timed steps is spent, within [min_reps, max_reps]
    and the slot table's room. The first design is the reference of the paired overheads
    (the floor, when it runs).
    """
    requests = make_requests(batch, NullInputs(PROMPT_LEN))
    drivers, counters, setup_s, admit_s, first = {}, {}, {}, {}, {}
    tracked = {name: getattr(driver_class(name), "countable", True) for name in designs}

    def tracking(name: str):
        return counters[name].tracking() if tracked[name] else contextlib.nullcontext()

    for name in designs:
        counters[name] = StepCounter()
        with tracking(name):
            model = NullTalker(config)
            t0 = time.perf_counter()
            drivers[name] = driver_class(name)(model, requests)
            setup_s[name] = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = drivers[name].admit()
            admit_s[name] = time.perf_counter() - t0
        first[name] = drivers[name].frames(out)
    check_same_frames(first)
    outs = {}
    for name in designs:  # the first decode step after prefill: tracked, untimed
        with tracking(name):
            outs[name] = drivers[name].frames(drivers[name].step())
    check_same_frames(outs)
    counts = {}
    if count:
        for name in designs:
            out = [None]
            step = drivers[name].step
            if tracked[name]:
                counts[name] = counters[name].count(lambda: out.__setitem__(0, step()), getattr(drivers[name], "engine", None))
            else:  # stepped uncounted, so every design stays on the same step
                out[0] = step()
            outs[name] = drivers[name].frames(out[0])
        check_same_frames(outs)
    room = config.max_context - PROMPT_LEN - 3 - (2 if count else 1)  # decode steps the slot table has room for
    max_reps = max(1, min(max_reps, room))
    wall: dict[str, list[float]] = {name: [] for name in designs}
    cpu: dict[str, list[float]] = {name: [] for name in designs}
    per_step_frames: dict[str, set[int]] = {name: set() for name in designs}
    spent = 0.0
    gc.collect()
    gc.disable()
    try:
        rep = 0
        while rep < max_reps and (rep < min_reps or spent < budget_s):
            order = list(designs[rep % len(designs):]) + list(designs[: rep % len(designs)])
            outs = {}
            for name in order:
                c0, t0 = time.thread_time(), time.perf_counter()
                out = drivers[name].step()
                t1, c1 = time.perf_counter(), time.thread_time()
                wall[name].append(t1 - t0)
                cpu[name].append(c1 - c0)
                spent += t1 - t0
                outs[name] = out
            frames = {name: drivers[name].frames(outs[name]) for name in designs}
            for name, n in check_same_frames(frames).items():
                per_step_frames[name].add(n)
            rep += 1
    finally:
        gc.enable()
    base = designs[0]
    result = {"batch": batch, "reps": rep, "reference": base, "designs": {}}
    for name in designs:
        s = summary_ms(wall[name])
        s["cpu"] = summary_ms(cpu[name])
        s.update({f"{k}_wall": v for k, v in paired(wall, name, base).items()})
        s.update({f"{k}_cpu": v for k, v in paired(cpu, name, base).items()})
        s["times_ms"] = {"wall": [round(1e3 * t, 4) for t in wall[name]], "cpu": [round(1e3 * t, 4) for t in cpu[name]]}
        s["frames_per_step"] = sorted(per_step_frames[name])
        s["setup_ms"] = 1e3 * setup_s[name]
        s["admit_prefill_step_ms"] = 1e3 * admit_s[name]
        if name in counts:
            s["counts"] = counts[name].to_dict()
        result["designs"][name] = s
    result["frames_identical"] = True  # check_same_frames raised otherwise
    log("  B=%-5d reps=%-3d %s" % (batch, rep, "  ".join(
        f"{n} {result['designs'][n]['median_ms']:.2f}ms"
        + ("" if n == base else f" (+{result['designs'][n]['overhead_ms_wall']:.2f} wall, "
                                f"+{result['designs'][n]['overhead_ms_cpu']:.2f} cpu)")
        for n in designs)))
    return result


# Timed seconds per batch size at budget 1.0 (scaled by --budget), and the repetition bounds:
# small batches are cheap and noisy (many reps), batch 1024 at the real vocabularies is
# seconds per step today (few reps). The totals keep `make bench` within minutes.
BUDGET_SHARE = {1: 0.10, 8: 0.10, 64: 0.15, 256: 0.25, 1024: 0.40}
REPS = {1: (10, 40), 8: (10, 40), 64: (5, 30), 256: (3, 20), 1024: (3, 10)}


def reps_bounds(batch: int) -> tuple[int, int]:
    """(min, max) repetitions at a batch size (the nearest listed size at or above)."""
    for b in sorted(REPS):
        if batch <= b:
            return REPS[b]
    return REPS[max(REPS)]


def budget_share(batch: int) -> float:
    for b in sorted(BUDGET_SHARE):
        if batch <= b:
            return BUDGET_SHARE[b]
    return BUDGET_SHARE[max(BUDGET_SHARE)]


def bench_sweep(
    config: NullConfig,
    batch_sizes: Sequence[int],
    designs: Sequence[str] = tuple(DRIVERS),
    *,
    budget_s: float = 120.0,
    naive_max_batch: int | None = None,
    count: bool = True,
    log=print,
) -> dict:
    """bench_batch at every size (budget_s: timed seconds of the whole sweep, shared out by
    BUDGET_SHARE); naive designs above `naive_max_batch` are skipped (recorded)."""
    out = {}
    for b in batch_sizes:
        names = [d for d in designs if d in (FLOOR, "engine", "engine_compiled") or naive_max_batch is None
                 or b <= naive_max_batch]
        lo, hi = reps_bounds(b)
        res = bench_batch(config, b, names, budget_s=budget_s * budget_share(b), min_reps=lo, max_reps=hi,
                          count=count, log=log)
        for d in designs:
            if d not in names:
                res["designs"][d] = {"skipped": f"not run above batch {naive_max_batch} (time budget)"}
        out[b] = res
    return out
