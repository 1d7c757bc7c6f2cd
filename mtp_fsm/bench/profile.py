"""Where an engine step's time goes: exclusive time per stage, and a cProfile of the step."""

from __future__ import annotations

import collections
import cProfile
import io
import os
import pstats
import statistics
import time

from .._util.stats import percentile
from .instrument import GLUE, HOST_OUTPUT, HOST_STAGE, instrument_engine


class StageTimer:
    """Exclusive time per stage label (nested stages are charged to the innermost) on
    `clock` (time.perf_counter: wall; time.thread_time: this thread's CPU time)."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.stack: list[str] = []
        self.totals: collections.Counter[str] = collections.Counter()
        self._mark = clock()

    def _charge(self) -> None:
        now = self.clock()
        self.totals[self.stack[-1] if self.stack else GLUE] += now - self._mark
        self._mark = now

    def enter(self, label: str) -> None:
        self._charge()
        self.stack.append(label)

    def leave(self, label: str) -> None:
        self._charge()
        self.stack.pop()

    def start(self) -> None:
        self.totals.clear()
        self._mark = self.clock()

    def stop(self) -> dict[str, float]:
        self._charge()
        return dict(self.totals)


def group_of(label: str) -> str:
    """host_stage (Ledger.stage), host_output (_build_output + Ledger.observe), sampling
    (CB0 and MTP samplers, the FSM guards fused with CB0), model (model hooks), fsm (other
    kernels), glue (engine code between stages, incl. the output copy)."""
    if label == HOST_STAGE:
        return "host_stage"
    if label == HOST_OUTPUT:
        return "host_output"
    if label in ("kernel:sample_cb0", "kernel:mtp_sample"):
        return "sampling"
    if label.startswith("model:"):
        return "model"
    if label.startswith("kernel:"):
        return "fsm_kernels"
    return "glue"


def stage_split(driver, steps: int, clock=time.perf_counter) -> dict:
    """Mean exclusive ms per stage label and per group over `steps` decode steps."""
    timer = StageTimer(clock)
    per_label: dict[str, list[float]] = collections.defaultdict(list)
    totals = []
    with instrument_engine(driver.engine, timer.enter, timer.leave):
        for _ in range(steps):
            timer.start()
            t0 = clock()
            driver.step()
            totals.append(clock() - t0)
            split = timer.stop()
            for label in set(per_label) | set(split):
                per_label[label].append(split.get(label, 0.0))
    # Means, so the parts add up to the step (medians of parts would not).
    labels = {k: 1e3 * statistics.fmean(v) for k, v in per_label.items()}
    groups: dict[str, float] = collections.Counter()
    for k, v in labels.items():
        groups[group_of(k)] += v
    return {"step_ms": 1e3 * statistics.fmean(totals), "step_ms_median": 1e3 * percentile(totals, 50),
            "groups_ms": dict(groups), "labels_ms": labels}


def cprofile_steps(driver, steps: int, top: int = 15) -> dict:
    """cProfile of `steps` decode steps: top functions by own time, and named cumulative times."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        driver.step()
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = []
    for (path, line, name), (cc, nc, tt, ct, _callers) in stats.stats.items():
        rows.append((tt, ct, nc, f"{_short(path)}:{line}({name})"))
    rows.sort(reverse=True)
    named = {}
    for (path, line, name), (cc, nc, tt, ct, _callers) in stats.stats.items():
        short = _short(path)
        if short.startswith("mtp_fsm/") and not short.startswith("mtp_fsm/bench/"):
            named[f"{short}:{name}"] = {"cum_ms_per_step": 1e3 * ct / steps, "calls_per_step": nc / steps}
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(25)
    return {
        "steps": steps,
        "top_own_time": [
            {"function": f, "own_ms_per_step": 1e3 * tt / steps, "cum_ms_per_step": 1e3 * ct / steps,
             "calls_per_step": nc / steps}
            for tt, ct, nc, f in rows[:top]
        ],
        "mtp_fsm_functions": dict(sorted(named.items(), key=lambda kv: -kv[1]["cum_ms_per_step"])),
    }


def _short(path: str) -> str:
    marker = os.sep + "mtp_fsm" + os.sep
    if marker in path:
        return "mtp_fsm/" + path.split(marker, 1)[1].replace(os.sep, "/")
    return os.path.basename(path)


class _Timed:
    """A callable proxy accumulating the time spent in the wrapped callable on `clock`."""

    def __init__(self, fn, sink: list[float], clock=time.perf_counter) -> None:
        self.fn, self.sink, self.clock = fn, sink, clock

    def __call__(self, *args, **kwargs):
        t0 = self.clock()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.sink[0] += self.clock() - t0


NAIVE_HOOKS = ("run_phase", "on_frame")  # the naive drivers' lifecycle hooks


def _timed_sampler(base, sink: list[float], clock):
    """A subclass of the driver's StepSampler whose sampling calls add their time to sink."""

    class TimedSampler(base):
        def cb0(self, *args, **kwargs):
            return _Timed(super().cb0, sink, clock)(*args, **kwargs)

        def mtp(self, *args, **kwargs):
            return _Timed(super().mtp, sink, clock)(*args, **kwargs)

    return TimedSampler


def naive_breakdown(driver, steps: int, clock=time.perf_counter) -> dict:
    """Mean ms per step of a naive driver split into batched sampling (the engine's sampler,
    the floor's work too), lifecycle hooks (the transitions triggers or the dict updates and
    guards) and the rest (model calls, gathering per-row inputs, per-row Python).
    Instrumented steps, run apart from the timed ones."""
    sampling, hooks = [0.0], [0.0]
    driver.sampler_class = _timed_sampler(type(driver).sampler_class, sampling, clock)
    for name in NAIVE_HOOKS:
        setattr(driver, name, _Timed(getattr(driver, name), hooks, clock))
    total = 0.0
    try:
        for _ in range(steps):
            t0 = clock()
            driver.step()
            total += clock() - t0
    finally:
        del driver.sampler_class
        for name in NAIVE_HOOKS:
            delattr(driver, name)
    scale = 1e3 / steps
    return {"step_ms": total * scale, "sampling_ms": sampling[0] * scale, "lifecycle_hooks_ms": hooks[0] * scale,
            "rest_ms": (total - sampling[0] - hooks[0]) * scale}
