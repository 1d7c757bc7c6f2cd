"""Engine decode step of every talker in `models/` at batch 1 and 64 (tiny seeded demo sizes).

Each model is resolved by name at run time (`mtp_fsm.serving.model_loader`, pkgutil import
strings): mtp_fsm never imports `models` statically, and a model package that fails to import
or build is reported as skipped with the reason instead of stopping the bench.

Per model: one `LockstepEngine(model, max_slots=64, kernels="torch")` per batch size, each on
its own model instance (a model binds to one live engine), filled with requests built by the
package's `text_inputs` from different texts, prefilled first; then the engines' `step()` are
timed alternately (paired in time, so machine load hits both sizes alike). Only decode-only
steps are timed: every request held is in `decoding`. A request that ends (EOS, its budget,
the context) is replaced by a fresh one so the batch stays full; the replacement's admission
and prefill step is run untimed. Conditioned talkers get their whole conditioning feed
upfront (`model.initial_feed(inputs)`); a request found `starved` is fed done=True (counted).
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from typing import Any, Callable, Sequence

import attrs

from .._util.stats import percentile
from .timing import summary_ms

MODEL_BATCH_SIZES = (1, 64)
# Resting states whose rows are one-token decode rows (the delay pattern's ramp-up and wind-down too).
DECODE_STATES = ("decoding", "ramp_up", "wind_down")
MAX_SLOTS = 64
KERNELS = "torch"
TEXT_CHARS = 60  # per request; shortened while the prompt exceeds half the model's context
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven small voices read numbers aloud in a quiet "
    "room near the old harbour under grey autumn skies and a kettle sings softly beside the window"
).split()


# Not in the per-model table: mtp_lm's tiny EOS wiring is position-based (it ends a bench-length
# prompt at once), and as a plain one-token LM it runs chatterbox's lifecycle; its bench is the
# speculative one (issue 13).
NOT_BENCHED = ("mtp_lm",)


def model_names() -> tuple[str, ...]:
    """The short names of the talkers in `models/` (the serving loader's table) the bench times."""
    from ..serving.model_loader import MODEL_NAMES

    return tuple(name for name in MODEL_NAMES if name not in NOT_BENCHED)


def bench_texts(n: int, chars: int) -> list[str]:
    """n different deterministic texts of about `chars` characters."""
    texts = []
    for i in range(n):
        words, k = [], (7 * i) % len(WORDS)
        while len(" ".join(words)) < chars:
            words.append(WORDS[k % len(WORDS)])
            k += 1 + i % 5
        texts.append(" ".join(words)[:chars].strip())
    return texts


def lifecycle_shape(variant: str) -> dict:
    """The lifecycle variant's declared states and edges (trigger, source, dest)."""
    from ..lifecycle import compile_lifecycle, lifecycle_for

    spec = lifecycle_for(variant)
    return {"variant": variant, "states": len(spec.states), "edges": len(compile_lifecycle(spec).edges())}


def _problem(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


@attrs.define
class _Filled:
    """One engine kept full of decoding requests of one model."""

    engine: Any
    model: Any
    make_inputs: Callable[[str], Any]
    texts: list[str]
    max_frames: int
    batch: int
    issued: int = 0
    refills: int = 0
    max_refills: int = 0
    starved_fed: int = 0
    feed_rows: int = 0
    finish_reasons: Counter = attrs.field(factory=Counter)
    prompt_lens: list[int] = attrs.field(factory=list)

    def add(self) -> None:
        from ..engine import NewRequest

        i = self.issued
        self.issued += 1
        inputs = self.make_inputs(self.texts[i % len(self.texts)])
        rid = f"r{i}"
        request = NewRequest(rid, inputs, max_frames=self.max_frames, seed=1000 + i)
        prepared = self.engine.prepare(request)  # kept and reused at admission
        if len(self.prompt_lens) < len(self.texts):
            self.prompt_lens.append(int(prepared.prompt_embeds.shape[0]))
        self.engine.add_request(request)
        if getattr(self.model.spec, "feed_capacity", 0) > 0:
            self._feed_all(rid, inputs, prepared)

    def _feed_all(self, rid: str, inputs: Any, prepared: Any) -> None:
        """The request's whole conditioning feed, upfront: the rows its prepared prompt
        carries, else the model's initial_feed; the feed is declared done either way."""
        given = getattr(prepared, "feed", None)
        if given is not None:
            self.feed_rows += int(given.shape[0])
            done = bool(getattr(prepared, "feed_done", False))
        elif hasattr(self.model, "initial_feed"):
            rows, done = self.model.initial_feed(inputs)
            self.engine.feed(rid, rows, done=bool(done))
            self.feed_rows += int(rows.shape[0])
        else:
            done = False
        if not done:
            self.engine.feed(rid, None, done=True)

    def states(self) -> dict[str, str]:
        return self.engine.requests()

    def unstarve(self) -> None:
        for rid, state in self.states().items():
            if state == "starved":
                self.engine.feed(rid, None, done=True)
                self.starved_fed += 1

    def decode_only(self) -> tuple[bool, int]:
        """(every request held is decoding and at least one is, how many are)."""
        states = list(self.states().values())
        decoding = sum(s in DECODE_STATES for s in states)
        return decoding > 0 and decoding == len(states), decoding

    def step(self):
        self.unstarve()
        out = self.engine.step()
        if out is not None:
            for fin in out.finished:
                self.finish_reasons[fin.reason.label] += 1
                if self.refills < self.max_refills:
                    self.refills += 1
                    self.add()
        return out


def _fill(name: str, batch: int, *, seed: int, max_prefill_steps: int) -> _Filled:
    from ..engine import LockstepEngine, SchedulingPolicy
    from ..serving.model_loader import load_talker

    loaded = load_talker(name, seed=seed)
    model = loaded.model
    max_ctx = int(model.spec.max_context)
    chars = TEXT_CHARS
    while chars > 8 and int(model.prepare(loaded.text_inputs(bench_texts(1, chars)[0])).prompt_embeds.shape[0]) > max_ctx // 2:
        chars = chars * 3 // 4
    texts = bench_texts(max(batch, 8), chars)
    # Prefill everything in as few steps as the context allows; the budget ends at the context anyway.
    policy = SchedulingPolicy(token_budget=max(512, batch * max_ctx), prefill_chunk=max_ctx)
    engine = LockstepEngine(model, max_slots=MAX_SLOTS, kernels=KERNELS, policy=policy)
    filled = _Filled(engine, model, loaded.text_inputs, texts, max_frames=max_ctx, batch=batch,
                     max_refills=4 * batch + 8)
    for _ in range(batch):
        filled.add()
    for _ in range(max_prefill_steps):
        if filled.decode_only()[0] or filled.step() is None:
            break
    return filled


def bench_model(
    name: str,
    batch_sizes: Sequence[int] = MODEL_BATCH_SIZES,
    *,
    budget_s: float = 6.0,
    min_steps: int = 5,
    max_steps: int = 20,
    warmup: int = 2,
    seed: int = 0,
    log=print,
) -> dict:
    """Decode step of talker `name` (a short name or 'pkg.module:factory') at each batch size,
    stepped alternately; timed steps per size = budget_s / (one warm step of every size), within
    [min_steps, max_steps]. {"skipped": reason} when the model cannot be imported or built, and
    a per-batch "problem" when no decode-only step could be timed."""
    from ..serving.model_loader import MODEL_NAMES

    out: dict = {"import": MODEL_NAMES.get(name, name), "kernels": KERNELS, "max_slots": MAX_SLOTS}
    t0 = time.perf_counter()
    try:
        filled = {b: _fill(name, b, seed=seed, max_prefill_steps=64) for b in batch_sizes}
    except Exception as exc:  # a model package mid-edit must not stop the bench
        out["skipped"] = _problem(exc)
        log(f"  {name}: skipped ({out['skipped']})")
        return out
    out["load_prefill_s"] = time.perf_counter() - t0
    first = filled[batch_sizes[0]]
    spec = first.model.spec
    out |= {"spec_name": spec.name, "max_context": int(spec.max_context), "max_frames": first.max_frames,
            "has_mtp": bool(spec.has_mtp), **lifecycle_shape(spec.lifecycle)}
    out["prompt_len_median"] = percentile(first.prompt_lens, 50)
    times: dict[int, list[float]] = {b: [] for b in batch_sizes}
    rows: dict[int, list[int]] = {b: [] for b in batch_sizes}
    frames: dict[int, list[int]] = {b: [] for b in batch_sizes}
    untimed = {b: 0 for b in batch_sizes}
    warm: dict[int, float] = {}
    paired: list[float] = []
    errors: dict[int, str] = {}
    steps = max_steps
    gc.collect()
    gc.disable()
    try:
        for rep in range(warmup + 3 * max_steps):
            if rep == warmup:
                steps = max(min_steps, min(max_steps, int(budget_s / max(sum(warm.values()), 1e-9))))
            if rep >= warmup and all(len(times[b]) >= steps or b in errors for b in batch_sizes):
                break
            order = list(batch_sizes) if rep % 2 == 0 else list(reversed(batch_sizes))
            this_rep: dict[int, tuple[float, int]] = {}
            for b in order:
                f = filled[b]
                if b in errors or f.engine.idle or (rep >= warmup and len(times[b]) >= steps):
                    continue
                ok, decoding = f.decode_only()
                try:
                    t1 = time.perf_counter()
                    res = f.step()
                    dt = time.perf_counter() - t1
                except Exception as exc:
                    errors[b] = _problem(exc)
                    continue
                if res is None:
                    continue
                if rep < warmup or not ok:
                    if ok:
                        warm[b] = dt
                    untimed[b] += 1
                    continue
                n = len(res.frames.request_ids)
                times[b].append(dt)
                rows[b].append(decoding)
                frames[b].append(n)
                this_rep[b] = (dt, n)
            lo, hi = batch_sizes[0], batch_sizes[-1]
            if lo in this_rep and hi in this_rep and this_rep[lo][1] and this_rep[hi][1]:
                paired.append((this_rep[hi][0] / this_rep[hi][1]) / (this_rep[lo][0] / this_rep[lo][1]))
    finally:
        gc.enable()
        for f in filled.values():
            f.engine.close()
    out["steps"] = steps
    out["batches"] = {}
    for b in batch_sizes:
        f = filled[b]
        row: dict = {"batch": b, "untimed_steps": untimed[b], "refills": f.refills, "starved_fed": f.starved_fed,
                     "finish_reasons": dict(f.finish_reasons)}
        if f.feed_rows:
            row["feed_rows"] = f.feed_rows
        if times[b]:
            total_s, total_frames = sum(times[b]), sum(frames[b])
            row |= summary_ms(times[b])
            row |= {
                "rows_decoding": {"min": min(rows[b]), "median": percentile(rows[b], 50), "max": max(rows[b])},
                "frames_per_step": total_frames / len(times[b]),
                "frames_per_s": total_frames / total_s if total_s else 0.0,
                "per_frame_ms": 1e3 * total_s / total_frames if total_frames else None,
            }
        else:
            states = Counter(f.states().values())
            row["problem"] = errors.get(b) or (
                f"no decode-only step to time (request states {dict(states)}, finishes {dict(f.finish_reasons)})")
        out["batches"][b] = row
    lo, hi = out["batches"][batch_sizes[0]], out["batches"][batch_sizes[-1]]
    if lo.get("per_frame_ms") and hi.get("per_frame_ms"):
        out["per_frame_ratio"] = hi["per_frame_ms"] / lo["per_frame_ms"]
    if paired:
        out["paired_per_frame_ratio"] = percentile(paired, 50)
    log(f"  {name} ({out['variant']}, {out['states']} states, {out['edges']} edges, {steps} steps): " + ", ".join(
        f"B={b} " + (f"{r['median_ms']:.2f} ms/step, {r['frames_per_s']:.0f} frames/s, "
                     f"{r['rows_decoding']['median']:g} rows decoding" if "median_ms" in r else f"PROBLEM {r['problem']}")
        for b, r in out["batches"].items())
        + (f"; per-frame B={batch_sizes[-1]}/B={batch_sizes[0]} = {out['per_frame_ratio']:.3f}" if "per_frame_ratio" in out else ""))
    return out


def bench_models(
    names: Sequence[str] | None = None,
    batch_sizes: Sequence[int] = MODEL_BATCH_SIZES,
    *,
    budget_s: float = 6.0,
    min_steps: int = 5,
    max_steps: int = 20,
    warmup: int = 2,
    log=print,
) -> dict:
    """bench_model for every talker (default: all of `models/`), one after another."""
    names = tuple(names) if names is not None else model_names()
    out = {"batch_sizes": list(batch_sizes), "budget_s": budget_s, "warmup": warmup, "kernels": KERNELS,
           "max_slots": MAX_SLOTS, "models": {}}
    started = time.perf_counter()
    for name in names:
        t0 = time.perf_counter()
        out["models"][name] = bench_model(name, batch_sizes, budget_s=budget_s, min_steps=min_steps,
                                          max_steps=max_steps, warmup=warmup, log=log)
        out["models"][name]["wall_s"] = time.perf_counter() - t0
    out["wall_s"] = time.perf_counter() - started
    log(f"  per-model section: {out['wall_s']:.0f} s (loading, prefill, warm-up and timed steps)")
    return out
