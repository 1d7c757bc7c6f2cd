"""`python -m mtp_fsm.bench`: every design side by side in one run; writes results.json/.md/.png.

The designs (drivers.py) do the same work per step: the NullTalker's precomputed model
calls and the engine's batched sampler. The floor does nothing else; the engine, the
transitions static machine and the per-request dict loop add their lifecycle bookkeeping,
and lifecycle overhead = design - floor. All at the real Qwen3-TTS vocabularies unless
--small-vocab.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time

import attrs
import torch

from .._util.stats import percentile
from .._util.threads import torch_threads
from .step_counts import constant_in_batch, engine_counts_by_batch
from .decode_path import decode_path
from .drivers import DRIVERS, EXTRA_DRIVERS, make_requests
from .null_model import NullInputs, NullTalker, lifecycle_config, qwen3_tts_sizes
from .report import markdown_report, markdown_table, models_table, plot_step_time, update_readme
from .speculative import speculative_table
from .timing import PROMPT_LEN, bench_sweep

BATCH_SIZES = (1, 8, 64, 256, 1024)
COUNT_BATCH_SIZES = (1, 2, 8, 64, 256, 1024)
E2E_CONCURRENCY = (1, 8, 32, 64)
MAX_CONTEXT = 96  # prompt (4) + the untimed steps + at most 40 timed decode steps fit
PROFILE_STEPS = ((8, 10), (256, 2))  # (batch, steps) of the engine's stage split and cProfile
# Overheads at or below this are timer noise: a ratio's denominator is clamped to it.
MIN_OVERHEAD_MS = 1e-3


def machine_info(threads: int) -> dict:
    import numpy
    import transitions

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__,
        "transitions": getattr(transitions, "__version__", "?"), "numpy": numpy.__version__,
        "torch_threads": threads, "loadavg_start": _loadavg(),
    }


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _config_dict(cfg) -> dict:
    return {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in attrs.asdict(cfg).items()}


def run_counts(log) -> dict:
    """Whether the engine's whole-step counts are flat in the batch size: every batch on an
    engine of the same size (1024 slots), small vocabularies (counts do not depend on V
    there: at 1024 slots the sampler takes the same path at both sizes)."""
    cfg = lifecycle_config(max_context=MAX_CONTEXT)
    engine = engine_counts_by_batch(lambda: NullTalker(cfg), COUNT_BATCH_SIZES, NullInputs(PROMPT_LEN))
    constant, diffs = constant_in_batch(engine)
    admit_constant, admit_diffs = constant_in_batch(engine, "admit")
    decode = engine[COUNT_BATCH_SIZES[-1]]["decode"]
    log(f"  engine decode step, whole step: {decode.summary()}; constant in batch: {constant}")
    return {
        "batch_sizes": list(COUNT_BATCH_SIZES), "max_slots": max(COUNT_BATCH_SIZES), "config": _config_dict(cfg),
        "engine": {b: {k: v.to_dict() for k, v in d.items()} for b, d in engine.items()},
        "engine_constant": constant, "engine_differences": diffs,
        "admit_constant": admit_constant, "admit_differences": admit_diffs,
    }


def run_profile(config, batch_sizes, clock, log) -> dict:
    from .drivers import EngineDriver
    from .profile import cprofile_steps, stage_split

    out = {"split": {}, "cprofile": {}}
    for b, steps in PROFILE_STEPS:
        if b not in batch_sizes:
            continue
        driver = EngineDriver(NullTalker(config), make_requests(b, NullInputs(PROMPT_LEN)))
        driver.admit()
        driver.step()
        out["split"][b] = stage_split(driver, steps, clock)
        out["cprofile"][b] = cprofile_steps(driver, steps)
    out["findings"] = findings(out)
    for line in out["findings"]:
        log("  " + line)
    return out


def run_naive_breakdown(config, batch: int, clock, log) -> dict:
    from .profile import naive_breakdown

    out = {}
    for name in ("transitions", "dict_loop"):
        driver = DRIVERS[name](NullTalker(config), make_requests(batch, NullInputs(PROMPT_LEN)))
        driver.admit()
        driver.step()
        out[name] = b = naive_breakdown(driver, 2, clock)
        log(f"  {name} B={batch}: step {b['step_ms']:.1f} ms = batched sampling {b['sampling_ms']:.1f} + "
            f"lifecycle hooks {b['lifecycle_hooks_ms']:.1f} + rest {b['rest_ms']:.1f}")
    return {"batch": batch, "designs": out}


def findings(profile: dict) -> list[str]:
    """Plain statements of where the engine's step time goes, from the split and cProfile."""
    lines = []
    for b, s in sorted(profile["split"].items(), key=lambda kv: int(kv[0])):
        g, total = s["groups_ms"], s["step_ms"]
        top = sorted(g.items(), key=lambda kv: -kv[1])
        lines.append(f"B={b}: step {total:.2f} ms = " + ", ".join(f"{k} {v:.2f} ({100 * v / total:.0f}%)" for k, v in top))
        funcs = profile["cprofile"][b]["mtp_fsm_functions"]
        picks = [
            "mtp_fsm/sampling/sampler.py:filter_mask", "mtp_fsm/sampling/noise.py:gumbel_noise",
            "mtp_fsm/sampling/noise.py:row_key", "mtp_fsm/engine/ledger.py:stage",
            "mtp_fsm/engine/ledger.py:_validate_rows", "mtp_fsm/engine/host_events.py:validate",
            "mtp_fsm/engine/ledger.py:observe", "mtp_fsm/engine/engine.py:_build_output",
        ]
        parts = [f"{k.split(':')[-1]} {funcs[k]['cum_ms_per_step']:.2f}" for k in picks if k in funcs]
        lines.append(f"B={b} cProfile (cumulative ms/step, profiler overhead included): " + ", ".join(parts))
    return lines


# -- targets ---------------------------------------------------------------------------------


def _design(sweep: dict, batch: int, name: str) -> dict | None:
    row = sweep.get(batch, sweep.get(str(batch)))
    d = (row or {}).get("designs", {}).get(name)
    return None if d is None or "skipped" in d else d


def _paired_ratio(a: dict, b: dict, clock: str) -> float:
    """Median over repetitions of a's step / b's step (same repetition)."""
    return percentile([x / y for x, y in zip(a["times_ms"][clock], b["times_ms"][clock])], 50)


def _median(d: dict, clock: str) -> float:
    return d["cpu"]["median_ms"] if clock == "cpu" else d["median_ms"]


def _target(name: str, measured, target: str, met: bool, detail: str, unresolved: str = "") -> dict:
    """unresolved: why the run cannot tell (an overhead below its noise); such a target is not met."""
    out = {"name": name, "measured": measured, "target": target, "met": bool(met) and not unresolved, "detail": detail}
    if unresolved:
        out["unresolved"] = unresolved
    return out


def _noise(design: dict, floor: dict, clock: str, batch: int) -> str:
    """Empty when the design's overhead over the floor is resolved in this run (slower than
    the floor in at least 3 of 4 repetitions), else why it is not."""
    diffs = [x - y for x, y in zip(design["times_ms"][clock], floor["times_ms"][clock])]
    if percentile(diffs, 25) > 0:
        return ""
    return (f"the engine's overhead at B={batch} ({percentile(diffs, 50):+.2f} ms, paired differences p25 "
            f"{percentile(diffs, 25):+.2f} / p75 {percentile(diffs, 75):+.2f} ms) is below this run's noise")


def _unmeasured(name: str, target: str, what: str) -> dict:
    return _target(name, None, target, False, f"not measured: {what} did not run")


def evaluate_targets(results: dict, engine: str = "engine") -> list[dict]:
    """The four targets of the honest-measurement issue for one engine design (`engine`, or
    `engine_compiled`: its stages compiled), computed from the sweep: ratios and overheads
    are paired per repetition on the sweep's clock (`lifecycle.clock`). Names of the
    compiled engine's targets say so."""
    life = results["lifecycle"]
    sweep, clock = life["sweep"], life.get("clock", "wall")
    if engine != "engine" and not any(_design(sweep, b, engine) for b in sweep):
        return []  # an optional design that did not run
    label = "" if engine == "engine" else " (compiled stages)"
    ovh = f"overhead_ms_{clock}"
    out = []

    # (1) engine step / floor step.
    # The floor is the minimal loop (the same model calls and sample_tokens calls, nothing else).
    name, limits = "engine step / floor step", {1: 1.15, 64: 1.10, 256: 1.10, 1024: 1.10}
    target = "≤ 1.15 at B=1; ≤ 1.10 at B=64, 256 and 1024"
    measured, parts = {}, []
    for b, limit in limits.items():
        e, f = _design(sweep, b, engine), _design(sweep, b, "floor")
        if e and f:
            measured[str(b)] = r = _paired_ratio(e, f, clock)
            floor_ms = _median(f, clock)
            parts.append(f"B={b}: {r:.3f} (≤ {limit:g}: {'met' if r <= limit else 'missed'}; engine "
                         f"{e[ovh]:+.2f} ms over a {floor_ms:.2f} ms floor)")
    if measured:
        met = len(measured) == len(limits) and all(measured[str(b)] <= lim for b, lim in limits.items())
        missing = [str(b) for b in limits if str(b) not in measured]
        out.append(_target(name, measured, target, met, "; ".join(parts) + (f"; B={', '.join(missing)} not run" if missing else "")))
    else:
        out.append(_unmeasured(name, target, "the floor and engine at B=1, 64, 256, 1024"))

    # (2) transitions-per-request overhead / engine overhead at B=256.
    name, target = "transitions-per-request overhead / engine overhead at B=256", "≥ 20"
    e, t, f = _design(sweep, 256, engine), _design(sweep, 256, "transitions"), _design(sweep, 256, "floor")
    if e and t and f:
        r = t[ovh] / max(e[ovh], MIN_OVERHEAD_MS)
        out.append(_target(name, r, target, r >= 20, f"transitions {t[ovh]:+.2f} ms, engine {e[ovh]:+.2f} ms over the floor"
                           + (f" (engine overhead clamped to {MIN_OVERHEAD_MS} ms)" if e[ovh] < MIN_OVERHEAD_MS else ""),
                           _noise(e, f, clock, 256)))
    else:
        out.append(_unmeasured(name, target, "B=256 with the engine and the transitions driver"))

    # (3) engine overhead at B=1024 / at B=8.
    name, target = "engine overhead at B=1024 / at B=8", "≤ 2"
    big, small = _design(sweep, 1024, engine), _design(sweep, 8, engine)
    big_floor, small_floor = _design(sweep, 1024, "floor"), _design(sweep, 8, "floor")
    if big and small and big_floor and small_floor:
        r = max(big[ovh], 0.0) / max(small[ovh], MIN_OVERHEAD_MS)
        why = _noise(big, big_floor, clock, 1024) or _noise(small, small_floor, clock, 8)
        out.append(_target(name, r, target, r <= 2, f"B=1024 {big[ovh]:+.2f} ms, B=8 {small[ovh]:+.2f} ms over the floor",
                           why))
    else:
        out.append(_unmeasured(name, target, "the engine at B=8 and B=1024"))

    # (4) engine step at B=1 <= dict loop step at B=1.
    name, target = "engine step / dict-loop step at B=1", "≤ 1"
    e, dl = _design(sweep, 1, engine), _design(sweep, 1, "dict_loop")
    if e and dl:
        r = _paired_ratio(e, dl, clock)
        out.append(_target(name, r, target, r <= 1, f"engine {e[ovh]:+.2f} ms, dict loop {dl[ovh]:+.2f} ms over the floor"))
    else:
        out.append(_unmeasured(name, target, "B=1 with the engine and the dict loop"))
    for t in out:
        t["name"] += label
        if isinstance(t["measured"], float) and not math.isfinite(t["measured"]):
            t["measured"] = None
    return out

# --skip name -> the results.json section it leaves out.
SECTIONS = {"breakdown": "naive_breakdown", "counts": "counts", "profile": "profile", "models": "models",
            "speculative": "speculative", "e2e": "e2e", "audio": "audio", "serving": "serving",
            "real_size": "real_size"}


def carry_over(results: dict, skip: set[str], previous_path: str, log) -> None:
    """A section this run skipped keeps its previous measurement (results.json before this run),
    named with that run's date in results["carried_over"]: a long bench can rerun one part
    without dropping the others, and the report says which numbers are older."""
    try:
        with open(previous_path) as f:
            previous = json.load(f)
    except (OSError, ValueError):
        return
    when = previous.get("machine", {}).get("date", "an earlier run")
    carried = dict(previous.get("carried_over", {}))
    for name, section in SECTIONS.items():
        if name in skip and section not in results and section in previous:
            results[section] = previous[section]
            results.setdefault("carried_over", {})[section] = carried.get(section, when)
            log(f"{section}: not measured in this run, kept from {results['carried_over'][section]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtp_fsm.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default="benchmarks", help="where results.json/.md and step_time.png go")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (0: torch's default; 1: small ops are latency-bound, threads thrash on a busy VM)")
    parser.add_argument("--budget", type=float, default=120.0,
                        help="seconds of timed steps for the whole sweep, shared out by batch size (timing.BUDGET_SHARE); "
                             "repetitions per batch stay within timing.REPS")
    parser.add_argument("--batch-sizes", type=lambda s: tuple(int(x) for x in s.split(",")), default=BATCH_SIZES)
    parser.add_argument("--naive-max-batch", type=int, default=None, help="skip the naive designs above this batch")
    parser.add_argument("--small-vocab", action="store_true",
                        help="vocabularies scaled 1/32 (CB0 96, codebook 64) instead of the real Qwen3-TTS ones (smoke runs)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="the clock of overheads, ratios and targets (both are recorded): cpu = the step thread's CPU "
                             "time, immune to other processes taking the core on a shared machine")
    parser.add_argument("--skip", default="",
                        help="comma list of parts to skip: counts,breakdown,profile,models,speculative,e2e,audio,serving,real_size (the sweep's per-design "
                             "op counts: step_counts; the compiled engine design: compiled)")
    parser.add_argument("--models", default="",
                        help="comma list of talkers for the per-model step (short names or 'pkg.module:factory'; "
                             "default: every model in models/)")
    parser.add_argument("--model-budget", type=float, default=6.0,
                        help="seconds of timed steps per model (both batch sizes together)")
    parser.add_argument("--e2e-model", default="models.qwen3_tts", help="import path of the tiny talker package")
    parser.add_argument("--e2e-max-frames", type=int, default=32)
    parser.add_argument("--readme", default="README.md",
                        help="README whose bench-table block gets the new table (skipped when absent)")
    args = parser.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    started = time.perf_counter()
    with torch_threads(args.threads):
        results: dict = {"machine": machine_info(torch.get_num_threads())}
        cfg = (lifecycle_config if args.small_vocab else qwen3_tts_sizes)(max_context=MAX_CONTEXT)
        vocab = "small" if args.small_vocab else "real"
        designs = tuple(DRIVERS) + (() if "compiled" in skip else tuple(EXTRA_DRIVERS))
        clock = time.thread_time if args.clock == "cpu" else time.perf_counter  # for the breakdown and split
        log(f"decode step per design (NullTalker, {vocab} vocabularies: CB0 {cfg.backbone_vocab_size}, "
            f"codebook {cfg.codebook_size}, Q={cfg.num_codebooks}); overhead = design - floor:")
        results["lifecycle"] = {"config": _config_dict(cfg), "vocab": vocab, "clock": args.clock,
                                "budget_s": args.budget, "sweep": bench_sweep(
            cfg, args.batch_sizes, designs, budget_s=args.budget, naive_max_batch=args.naive_max_batch,
            count="step_counts" not in skip, log=log)}
        results["targets"] = evaluate_targets(results) + evaluate_targets(results, "engine_compiled")
        results["decode_path"] = path = decode_path()
        results["targets"].append(_target(
            "one steady decode step (engine.step, torch path) reads <= 10 files and <= 1800 lines",
            {"files": path["num_files"], "lines": path["lines"]}, "<= 10 files, <= 1800 lines",
            path["num_files"] <= 10 and path["lines"] <= 1800,
            f"{path['num_files']} files, {path['lines']} lines: " + ", ".join(
                f"{name} {f['lines']}" for name, f in path["files"].items())))
        log(f"one decode step's code: {results['targets'][-1]['detail']}")
        if "breakdown" not in skip:
            log("where the naive designs' time goes:")
            results["naive_breakdown"] = run_naive_breakdown(
                cfg, 256 if 256 in args.batch_sizes else max(args.batch_sizes), clock, log)
        if "counts" not in skip:
            log("engine whole-step counts at every batch size on one engine:")
            results["counts"] = run_counts(log)
        if "profile" not in skip:
            log("engine step split:")
            results["profile"] = run_profile(cfg, args.batch_sizes, clock, log)
        if "models" not in skip:
            from .model_step import MODEL_BATCH_SIZES, bench_models

            log(f"engine step per talker model (B={', '.join(map(str, MODEL_BATCH_SIZES))}):")
            names = [n for n in args.models.split(",") if n] or None
            results["models"] = bench_models(names, MODEL_BATCH_SIZES, budget_s=args.model_budget, log=log)
            from .frame_costs import bench_frame_costs

            log("frame-format work per step (real sizes):")
            results["models"]["frame_costs"] = bench_frame_costs(MODEL_BATCH_SIZES, log=log)
        if "speculative" not in skip:
            from .speculative import bench_speculative

            log("speculative decoding, MTP LM (tiny and wide), per (model, workload, batch, k):")
            results["speculative"] = bench_speculative(log=log)
        if "e2e" not in skip:
            from .e2e import bench_e2e

            log("end to end (tiny Qwen3-TTS):")
            results["e2e"] = bench_e2e(E2E_CONCURRENCY, max_frames=args.e2e_max_frames, import_path=args.e2e_model, log=log)
        if "audio" not in skip:
            from .audio import AUDIO_MODELS, bench_audio

            log("speech out: engine frames/s with the codec decoder on and off, 16 requests:")
            results["audio"] = [bench_audio(m, requests=16, max_slots=16, repeats=3, out=log) for m in AUDIO_MODELS]
        # -- online speech API (issue 29; bench/serving.py): results["serving"], its table appended to results.md
        if "serving" not in skip:
            from .serving import bench_serving

            log("online API: client-side TTFA and streams/s through the embedded server at 1, 8, 32 concurrent:")
            results["serving"] = bench_serving(out=log)
        if "real_size" not in skip:
            from .real_size import bench_real_size

            log("real-size Qwen3-TTS talker (config_0_6b, random weights; issue 27):")
            results["real_size"] = bench_real_size(log=log)
        carry_over(results, skip, os.path.join(args.out_dir, "results.json"), log)
        results["wall_s"] = time.perf_counter() - started
        results["machine"]["loadavg_end"] = _loadavg()
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
        with open(os.path.join(args.out_dir, "results.md"), "w") as f:
            f.write(markdown_report(results))
            if results.get("serving"):  # issue 29's serving table (bench/serving.py)
                from .serving import serving_section

                f.write("\n## Online API\n\n" + serving_section(results["serving"]) + "\n")
        plot_step_time(results, os.path.join(args.out_dir, "step_time.png"))
    log("")
    log(markdown_table(results))
    if results.get("models"):
        log("")
        log(models_table(results["models"]))
    if results.get("speculative"):
        log("")
        log(speculative_table(results["speculative"]))
    if results.get("serving"):
        from .serving import serving_section

        log("")
        log(serving_section(results["serving"]))
    log(f"wrote {args.out_dir}/results.json, results.md, step_time.png in {results['wall_s']:.0f} s")
    # Last, so a README without the bench markers (a clear error) costs no results.
    if os.path.exists(args.readme) and update_readme(args.readme, results):
        log(f"updated the bench table in {args.readme}")
    if results.get("real_size") and os.path.exists(args.readme):
        from .real_size import update_readme as update_real_size

        if update_real_size(args.readme, results["real_size"]):
            log(f"updated the real-size table in {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
