"""End to end on the tiny Qwen3-TTS: N concurrent requests in lockstep vs one at a time."""

from __future__ import annotations

import pkgutil
import time
from typing import Sequence

import attrs
import torch

from .._util.stats import percentile
from ..engine import LockstepEngine, NewRequest, SchedulingPolicy
from ..sampling import SamplingParams

DEFAULT_MODEL = "models.qwen3_tts"  # resolved by name at run time (mtp_fsm never imports models)
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven small voices read "
    "numbers aloud in a quiet room near the old harbour under grey autumn skies"
).split()


def load_tiny_talker(import_path: str = DEFAULT_MODEL, *, seed: int = 0, dtype: torch.dtype = torch.float32):
    """(model, inputs factory) of the tiny Qwen3-TTS, imported by name at run time."""
    module = pkgutil.resolve_name(import_path)
    model = module.Qwen3TTSTalker(module.tiny_config(), seed=seed, dtype=dtype)
    return model, (lambda text: module.TTSInputs(text=text))


def request_texts(n: int) -> list[str]:
    """n deterministic texts of 10-45 characters (the tiny model says about len(text)+1 frames)."""
    texts = []
    for i in range(n):
        target = 10 + (i * 13) % 36
        words, k = [], i
        while len(" ".join(words)) < target:
            words.append(WORDS[k % len(WORDS)])
            k += 5
        texts.append(" ".join(words)[:target].strip())
    return texts


@attrs.define
class RunResult:
    wall_s: float
    steps: int
    frames: dict[str, list[tuple[int, ...]]]  # request -> codes of each frame, in order
    first_frame_s: dict[str, float]  # request -> seconds from t0 (all arrive at t0)
    admitted_s: dict[str, float]  # request -> seconds from t0 to its admission step
    done_s: dict[str, float]  # request -> seconds from t0 to its last step
    reasons: dict[str, str]

    @property
    def num_frames(self) -> int:
        return sum(len(f) for f in self.frames.values())


def run_engine(model, requests: Sequence[NewRequest], prompt_lens: dict[str, int], max_slots: int) -> RunResult:
    """All requests arrive at t0; the engine's built-in policy admits them as slots allow,
    prefills each prompt in one chunk and decodes until all finish."""
    unbounded = max(prompt_lens.values(), default=1) * (len(requests) + max_slots)
    engine = LockstepEngine(model, max_slots=max_slots, policy=SchedulingPolicy(unbounded, unbounded))
    frames = {r.request_id: [] for r in requests}
    first, admitted, done, reasons = {}, {}, {}, {}
    steps = 0
    t0 = time.perf_counter()
    for request in requests:
        engine.add_request(request)
    while True:
        started = time.perf_counter() - t0
        out = engine.step()
        if out is None:
            break
        steps += 1
        now = time.perf_counter() - t0
        for rid, record in engine.ledger.all_records():  # holding a slot: admitted by now
            if record.slot is not None:
                admitted.setdefault(rid, started)
        for rid, c in zip(out.frames.request_ids, out.frames.codes.tolist()):
            if not frames[rid]:
                first[rid] = now
            frames[rid].append(tuple(c))
        for fin in out.finished:
            done[fin.request_id] = now
            reasons[fin.request_id] = fin.reason.label
    wall = time.perf_counter() - t0
    engine.close()  # the model binds to one live engine; the next run builds its own
    return RunResult(wall, steps, frames, first, admitted, done, reasons)


def summarise(frames: int, wall_s: float, first_frame_s: list[float]) -> dict:
    return {
        "frames": frames, "wall_s": wall_s, "frames_per_s": frames / wall_s if wall_s else 0.0,
        "first_frame_ms_p50": 1e3 * percentile(first_frame_s, 50),
        "first_frame_ms_p90": 1e3 * percentile(first_frame_s, 90),
        "first_frame_ms_max": 1e3 * max(first_frame_s),
    }


def sequential_figures(runs: Sequence[RunResult], ids: Sequence[str]) -> dict:
    """One at a time, all requests arriving at t0: request i starts when i-1 is done.

    Built from each request's own duration (admission step to finishing step) measured in
    max_slots=1 runs, so the runs can be interleaved in time with the lockstep runs.
    """
    merged = {}
    for run in runs:
        for rid in run.done_s:
            merged[rid] = (run.done_s[rid] - run.admitted_s[rid], run.first_frame_s[rid] - run.admitted_s[rid],
                           len(run.frames[rid]))
    offset, firsts, frames = 0.0, [], 0
    for rid in ids:
        duration, to_first, n = merged[rid]
        firsts.append(offset + to_first)
        offset += duration
        frames += n
    return summarise(frames, offset, firsts)


def bench_e2e(
    concurrency: Sequence[int] = (1, 8, 32, 64),
    *,
    max_frames: int = 32,
    import_path: str = DEFAULT_MODEL,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    log=print,
) -> dict:
    """Lockstep at each concurrency N vs the same N requests one at a time (max_slots=1).

    Interleaved in time: the one-at-a-time requests are run in chunks between the
    lockstep runs (chunk k holds the requests that concurrency k adds), so machine noise
    hits both designs alike.
    """
    model, make_inputs = load_tiny_talker(import_path, seed=seed, dtype=dtype)
    concurrency = sorted(concurrency)
    texts = request_texts(max(concurrency))
    requests = [
        NewRequest(f"q{i}", make_inputs(t), max_frames=max_frames, seed=100 + i,
                   cb0_sampling=SamplingParams(), mtp_sampling=SamplingParams())
        for i, t in enumerate(texts)
    ]
    prompt_lens = {r.request_id: int(model.prepare(r.inputs).prompt_embeds.shape[0]) for r in requests}
    warm = attrs.evolve(requests[0], request_id="warmup", max_frames=4)
    run_engine(model, [warm], {"warmup": prompt_lens["q0"]}, 1)
    out = {"model": f"{import_path}.tiny_config", "dtype": str(dtype).replace("torch.", ""), "max_frames": max_frames,
           "sampling": "T=0.9, top-k 50 (CB0 and MTP)", "texts": texts, "concurrency": {}}
    seq_runs, done = [], 0
    for c in concurrency:
        seq_runs.append(run_engine(model, requests[done:c], prompt_lens, 1))
        done = c
        lock = run_engine(model, requests[:c], prompt_lens, c)
        ids = [r.request_id for r in requests[:c]]
        seq = {rid: f for run in seq_runs for rid, f in run.frames.items()}
        mismatched = [rid for rid in ids if lock.frames[rid] != seq[rid]]
        row = {
            "requests": c,
            "lockstep": summarise(lock.num_frames, lock.wall_s, [lock.first_frame_s[r] for r in ids]) | {"steps": lock.steps},
            "sequential": sequential_figures(seq_runs, ids),
            "identical_frames": not mismatched, "mismatched_requests": mismatched,
            "finish_reasons": {k: sum(1 for r in ids if lock.reasons.get(r) == k) for k in ("eos", "length")},
        }
        row["speedup_frames_per_s"] = row["lockstep"]["frames_per_s"] / row["sequential"]["frames_per_s"]
        out["concurrency"][c] = row
        log(f"  e2e N={c}: lockstep {row['lockstep']['frames_per_s']:.1f} frames/s, one at a time "
            f"{row['sequential']['frames_per_s']:.1f} frames/s, frames identical: {not mismatched}")
    return out
