"""`python -m mtp_fsm.bench`: every part side by side in one run; writes results.json/.md/.png."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import attrs
import torch

from .._util.threads import torch_threads
from .counters import constant_in_batch, count_call, engine_counts_by_batch
from .drivers import DRIVERS, make_requests
from .null_model import NullInputs, NullTalker, lifecycle_config, qwen3_tts_sizes
from .report import markdown_report, markdown_table, models_table, plot_step_time, update_readme
from .timing import PROMPT_LEN, bench_engine_scaling, bench_sweep

BATCH_SIZES = (1, 8, 64, 256, 1024)
REAL_VOCAB_BATCH_SIZES = (1, 8, 64, 256)
COUNT_BATCH_SIZES = (1, 2, 8, 64, 256, 1024)
NAIVE_COUNT_BATCH_SIZES = (1, 8, 64)
E2E_CONCURRENCY = (1, 8, 32, 64)
MAX_CONTEXT = 96  # prompt (4) + warm-up + at most 30 timed decode steps fit


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


def run_counts(config, log) -> dict:
    engine = engine_counts_by_batch(lambda: NullTalker(config), COUNT_BATCH_SIZES, NullInputs(PROMPT_LEN))
    constant, diffs = constant_in_batch(engine)
    admit_constant, admit_diffs = constant_in_batch(engine, "admit")
    naive = {}
    for name in ("transitions", "dict_loop"):
        naive[name] = {}
        for b in NAIVE_COUNT_BATCH_SIZES:
            driver = DRIVERS[name](NullTalker(config), make_requests(b, NullInputs(PROMPT_LEN)))
            driver.admit()
            naive[name][b] = count_call(driver.step).to_dict()
    decode = engine[COUNT_BATCH_SIZES[-1]]["decode"]
    h2d_sites = sorted({s.split(" at ", 1)[1] + f" ({s.split(' in ', 1)[1].split(' at ')[0]})" for s in decode.sites if s.startswith("h2d")})
    max_syncs = max(c["decode"].syncs + c["decode"].d2h for c in engine.values())
    log(f"  counts: engine decode {decode.kernels} non-view ops, {decode.syncs} syncs + {decode.d2h} output copy, "
        f"constant in batch: {constant}; H2D inside the step: {decode.h2d}")
    return {
        "engine": {b: {k: v.to_dict() for k, v in d.items()} for b, d in engine.items()},
        "engine_constant": constant, "engine_differences": diffs,
        "admit_constant": admit_constant, "admit_differences": admit_diffs,
        "max_syncs_per_step_incl_output_copy": max_syncs, "h2d_sites": h2d_sites, "naive": naive,
    }


def run_profile(config, log) -> dict:
    from .drivers import EngineDriver
    from .profile import cprofile_steps, stage_split

    out = {"split": {}, "cprofile": {}}
    for b, steps in ((8, 20), (256, 10), (1024, 5)):
        driver = EngineDriver(NullTalker(config), make_requests(b, NullInputs(PROMPT_LEN)))
        driver.admit()
        driver.step()
        out["split"][b] = stage_split(driver, steps)
        out["cprofile"][b] = cprofile_steps(driver, steps)
    out["findings"] = findings(out)
    for line in out["findings"]:
        log("  " + line)
    return out


def run_naive_breakdown(config, batch: int, log) -> dict:
    from .profile import naive_breakdown

    out = {}
    for name in ("transitions", "dict_loop"):
        driver = DRIVERS[name](NullTalker(config), make_requests(batch, NullInputs(PROMPT_LEN)))
        driver.admit()
        out[name] = naive_breakdown(driver, 2)
        b = out[name]
        log(f"  {name} B={batch}: step {b['step_ms']:.1f} ms = per-row sampling {b['row_sampling_ms']:.1f} + "
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
            "mtp_fsm/engine/ledger.py:_validate", "mtp_fsm/engine/ledger.py:_stage_rows",
            "mtp_fsm/engine/ledger.py:observe", "mtp_fsm/engine/engine.py:_build_output",
        ]
        parts = [f"{k.split(':')[-1]} {funcs[k]['cum_ms_per_step']:.2f}" for k in picks if k in funcs]
        lines.append(f"B={b} cProfile (cumulative ms/step, profiler overhead included): " + ", ".join(parts))
    return lines


def evaluate_targets(results: dict) -> list[dict]:
    sweep = results["lifecycle"]["sweep"]
    out = []

    def ratio(b, d):
        row = sweep.get(b, {}).get("designs", {}).get(d, {})
        return row.get("ratio_vs_engine")

    for d, target in (("transitions", 50.0), ("dict_loop", 10.0)):
        r = ratio(256, d)
        if r is not None:
            out.append({"name": f"B=256: {d} step / engine step ≥ {target:g}", "measured": r, "target": f"≥ {target:g}",
                        "met": r >= target})
    scaling = results.get("engine_scaling")
    if scaling:
        r = scaling["paired_ratio_last_vs_first"]
        out.append({"name": "engine step B=1024 / B=8 ≤ 2 (stepped alternately)", "measured": r, "target": "≤ 2",
                    "met": r <= 2.0})
    elif 1024 in sweep and 8 in sweep:
        r = sweep[1024]["designs"]["engine"]["median_ms"] / sweep[8]["designs"]["engine"]["median_ms"]
        out.append({"name": "engine step B=1024 / B=8 ≤ 2", "measured": r, "target": "≤ 2", "met": r <= 2.0})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtp_fsm.bench", description=__doc__)
    parser.add_argument("--out-dir", default="benchmarks", help="where results.json/.md and step_time.png go")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (0: torch's default; 1: small ops are latency-bound, threads thrash on a busy VM)")
    parser.add_argument("--budget", type=float, default=8.0, help="seconds of timed steps per batch size")
    parser.add_argument("--batch-sizes", type=lambda s: tuple(int(x) for x in s.split(",")), default=BATCH_SIZES)
    parser.add_argument("--naive-max-batch", type=int, default=None, help="skip the naive designs above this batch")
    parser.add_argument("--skip", default="",
                        help="comma list of parts to skip: real_vocab,breakdown,counts,profile,models,e2e")
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
        cfg = lifecycle_config(max_context=MAX_CONTEXT)
        log("lifecycle step time (NullTalker, small vocab):")
        results["lifecycle"] = {"config": _config_dict(cfg), "sweep": bench_sweep(
            cfg, args.batch_sizes, budget_s=args.budget, naive_max_batch=args.naive_max_batch, log=log)}
        if "real_vocab" not in skip:
            real = qwen3_tts_sizes(max_context=MAX_CONTEXT)
            log("step time with the real Qwen3-TTS vocabularies:")
            sizes = tuple(b for b in REAL_VOCAB_BATCH_SIZES if b <= max(args.batch_sizes))
            results["real_vocab"] = {"config": _config_dict(real), "sweep": bench_sweep(
                real, sizes, budget_s=args.budget * 0.6, log=log)}
        if 8 in args.batch_sizes and 1024 in args.batch_sizes:
            results["engine_scaling"] = bench_engine_scaling(cfg, (8, 1024), log=log)
        results["targets"] = evaluate_targets(results)
        if "breakdown" not in skip:
            log("where the naive designs' time goes:")
            results["naive_breakdown"] = run_naive_breakdown(cfg, 256 if 256 in args.batch_sizes else max(args.batch_sizes), log)
        if "counts" not in skip:
            log("device ops / host syncs per step:")
            results["counts"] = run_counts(cfg, log)
        if "profile" not in skip:
            log("engine step split:")
            results["profile"] = run_profile(cfg, log)
        if "models" not in skip:
            from .model_step import MODEL_BATCH_SIZES, bench_models

            log(f"engine step per talker model (B={', '.join(map(str, MODEL_BATCH_SIZES))}):")
            names = [n for n in args.models.split(",") if n] or None
            results["models"] = bench_models(names, MODEL_BATCH_SIZES, budget_s=args.model_budget, log=log)
        if "e2e" not in skip:
            from .e2e import bench_e2e

            log("end to end (tiny Qwen3-TTS):")
            results["e2e"] = bench_e2e(E2E_CONCURRENCY, max_frames=args.e2e_max_frames, import_path=args.e2e_model, log=log)
        results["wall_s"] = time.perf_counter() - started
        results["machine"]["loadavg_end"] = _loadavg()
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
        with open(os.path.join(args.out_dir, "results.md"), "w") as f:
            f.write(markdown_report(results))
        plot_step_time(results, os.path.join(args.out_dir, "step_time.png"))
    log("")
    log(markdown_table(results))
    if results.get("models"):
        log("")
        log(models_table(results["models"]))
    for t in results["targets"]:
        log(f"target {t['name']}: {t['measured']:.2f} -> {'met' if t['met'] else 'MISSED'}")
    log(f"wrote {args.out_dir}/results.json, results.md, step_time.png in {results['wall_s']:.0f} s")
    # Last, so a README without the bench markers (a clear error) costs no results.
    if os.path.exists(args.readme) and update_readme(args.readme, results):
        log(f"updated the bench table in {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
