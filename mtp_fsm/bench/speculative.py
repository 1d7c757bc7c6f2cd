"""Speculative decoding on the tiny MTP LM: k = 0..4 side by side, the same requests each time.

Per k and workload (greedy, sampled): engine steps and verify steps per request, drafts
accepted, frames per verify row, wall time per frame, the median decode-only step (no
prefill row in it: the verify step at k > 0, the plain decode step at k = 0) and the
engine's overhead per step (step time minus the time inside the model's calls). Rounds
rotate the order of k so a noisy machine does not favour one; medians over rounds.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from ..engine import LockstepEngine, NewRequest, SchedulingPolicy
from ..sampling import SamplingParams

TEXTS = ("Hello, this is the lockstep engine.", "Speculative decoding drafts with MTP.", "abc",
         "A longer sentence gives the drafter room to run ahead.")
WORKLOADS = {"greedy": SamplingParams(top_k=1), "sampled": SamplingParams(temperature=0.9, top_k=50)}
MODEL = "mtp_lm"  # the tiny MTP LM of models/, through the serving loader
MODEL_CALLS = ("forward", "cb0_logits", "draft", "frame_embed", "text_step")


def _timed_model(model, spent: list[float]):
    """Wrap the model's engine entry points so the time inside them is summed into spent[0]."""
    for name in MODEL_CALLS:
        inner = getattr(model, name)

        def call(*args, _inner=inner, **kwargs):
            t0 = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0

        setattr(model, name, call)
    return model


def run_once(factory: Callable, inputs_of: Callable, k: int, sampling: SamplingParams, num_requests: int,
             max_frames: int, max_slots: int) -> dict:
    spent = [0.0]
    model = _timed_model(factory(), spent)
    engine = LockstepEngine(model, max_slots, kernels="torch", speculate=k,
                            policy=SchedulingPolicy(token_budget=512, prefill_chunk=64))
    for i in range(num_requests):
        engine.add_request(NewRequest(f"r{i}", inputs_of(TEXTS[i % len(TEXTS)]), max_frames, seed=i,
                                      cb0_sampling=sampling))
    frames = steps = 0  # engine steps until every request ended (the batch runs together)
    decode_steps, overheads = [], []
    started = time.perf_counter()
    while True:
        before_model, t0 = spent[0], time.perf_counter()
        plan = None if engine.idle else engine.scheduler.schedule()
        if plan is None:
            break
        prefill = any(engine.ledger.records[s.request_id].in_prefill for s in plan.rows if s is not None
                      and s.request_id in engine.ledger.records)
        out = engine.step(plan)
        elapsed = time.perf_counter() - t0
        steps += 1
        frames += len(out.frames)
        if plan.rows and not prefill and not plan.new_requests and not plan.resumes:
            decode_steps.append(elapsed)
            overheads.append(elapsed - (spent[0] - before_model))
    wall = time.perf_counter() - started
    stats = engine.speculation
    row = {"steps": steps, "frames": frames, "wall_s": wall, "ms_per_frame": 1e3 * wall / max(frames, 1),
           "decode_step_ms": 1e3 * statistics.median(decode_steps) if decode_steps else None,
           "overhead_ms": 1e3 * statistics.median(overheads) if overheads else None,
           "verify_steps_per_request": None}
    if stats is not None:
        row.update(acceptance=stats.acceptance_rate, frames_per_verify_row=stats.frames_per_row)
    return row


def bench_speculative(ks=(0, 1, 2, 3, 4), rounds: int = 3, num_requests: int = 8, max_frames: int = 48,
                      max_slots: int = 8, log=print) -> dict:
    from ..serving.model_loader import load_talker

    def factory():  # by its short name: the engine package never imports `models`
        return load_talker(MODEL).model

    inputs_of = load_talker(MODEL).text_inputs
    out: dict = {"ks": list(ks), "rounds": rounds, "requests": num_requests, "max_frames": max_frames,
                 "max_slots": max_slots, "workloads": {}}
    for name, sampling in WORKLOADS.items():
        runs: dict[int, list[dict]] = {k: [] for k in ks}
        expected = None
        for r in range(rounds):
            order = list(ks[r % len(ks):]) + list(ks[: r % len(ks)])
            for k in order:
                with torch.inference_mode():
                    row = run_once(factory, inputs_of, k, sampling, num_requests, max_frames, max_slots)
                runs[k].append(row)
                expected = row["frames"] if expected is None else expected
                if row["frames"] != expected:  # the identity property, tested frame by frame in tests/
                    raise AssertionError(f"{name}: k={k} published {row['frames']} frames, other runs {expected}")
        table = {}
        for k in ks:
            rows = runs[k]
            merged = {key: statistics.median(r[key] for r in rows) for key in rows[0] if rows[0][key] is not None}
            table[k] = merged
        base = table[ks[0]]
        for k in ks:
            if table[k].get("decode_step_ms") and base.get("decode_step_ms"):
                table[k]["step_vs_k0"] = table[k]["decode_step_ms"] / base["decode_step_ms"]
            table[k]["speedup_per_frame"] = base["ms_per_frame"] / table[k]["ms_per_frame"]
            m = table[k]
            log(f"  {name} k={k}: acceptance {m.get('acceptance', 0):.3f}, {m.get('frames_per_verify_row', 1):.2f} "
                f"frames/verify row, {m['steps']:.0f} engine steps, {m['ms_per_frame']:.2f} ms/frame "
                f"({m['speedup_per_frame']:.2f}x k=0), decode step {m.get('decode_step_ms', float('nan')):.2f} ms "
                f"({m.get('step_vs_k0', float('nan')):.2f}x k=0), overhead {m.get('overhead_ms', float('nan')):.2f} ms")
        out["workloads"][name] = table
    return out


def speculative_table(section: dict) -> str:
    lines = [
        f"Speculative decoding on the tiny MTP LM (`bench/speculative.py`): {section['requests']} requests of up to "
        f"{section['max_frames']} tokens, {section['max_slots']} slots, k = 0..{max(section['ks'])} side by side, "
        f"median of {section['rounds']} rotated rounds; the frames are the same for every k (checked). Decode step: "
        "median of steps without a prefill row (k > 0: the verify step); overhead: step minus time in the model.",
        "",
        "| workload | k | acceptance | frames / verify row | engine steps | ms / frame | speed vs k=0 | "
        "decode step ms | cost vs k=0 | engine overhead ms/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, table in section["workloads"].items():
        for k, m in table.items():
            lines.append(
                f"| {name} | {k} | {m.get('acceptance', 0):.3f} | {m.get('frames_per_verify_row', 1.0):.2f} | "
                f"{m['steps']:.0f} | {m['ms_per_frame']:.2f} | {m['speedup_per_frame']:.2f}× | "
                f"{m.get('decode_step_ms', float('nan')):.2f} | {m.get('step_vs_k0', float('nan')):.2f}× | "
                f"{m.get('overhead_ms', float('nan')):.2f} |")
    return "\n".join(lines)
