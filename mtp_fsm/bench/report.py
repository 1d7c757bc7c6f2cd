"""Renders bench results: the README markdown table, the full results.md, the step-time plot."""

from __future__ import annotations

from typing import Sequence

from .._util.marked_block import replace_marked_block

DESIGN_TITLES = {
    "engine": "lockstep engine",
    "transitions": "transitions static machine, FSM per request",
    "dict_loop": "per-request dict loop",
}


def _cell(d: dict) -> str:
    if "skipped" in d:
        return "skipped"
    return f"{d['median_ms']:.2f} ({d['p10_ms']:.2f}–{d['p90_ms']:.2f})"


def _ratio(d: dict) -> str:
    return "–" if "skipped" in d else f"{d['ratio_vs_engine']:.1f}×"


def _sweep_table(sweep: dict, designs: Sequence[str]) -> str:
    head = "| batch | " + " | ".join(
        f"{DESIGN_TITLES.get(d, d)} ms" + ("" if d == "engine" else " | ×engine") for d in designs
    ) + " | reps |"
    sep = "|---:|" + "|".join("---:" if d == "engine" else "---:|---:" for d in designs) + "|---:|"
    lines = [head, sep]
    for b in sorted(sweep, key=int):
        row = sweep[b]["designs"]
        cells = []
        for d in designs:
            cells.append(_cell(row[d]))
            if d != "engine":
                cells.append(_ratio(row[d]))
        lines.append(f"| {b} | " + " | ".join(cells) + f" | {sweep[b]['reps']} |")
    return "\n".join(lines)


def markdown_table(results: dict) -> str:
    """The README table: decode step time per design and batch size (median, p10–p90), ratios."""
    life = results["lifecycle"]
    designs = list(next(iter(life["sweep"].values()))["designs"])
    cfg = life["config"]
    note = (
        f"Decode step, all B requests decoding; NullTalker (precomputed model outputs, Q={cfg['num_codebooks']}, "
        f"CB0 vocab {cfg['backbone_vocab_size']}, codebook {cfg['codebook_size']}), sampling T=0.9 top-k 50; "
        "median ms (p10–p90), designs interleaved in every repetition; ×engine = median / engine median."
    )
    return note + "\n\n" + _sweep_table(life["sweep"], designs)


def _step_cells(row: dict | None) -> list[str]:
    if not row or "median_ms" not in row:
        return ["–", "–"]
    return [f"{row['median_ms']:.2f} ({row['p10_ms']:.2f}–{row['p90_ms']:.2f})", f"{row['frames_per_s']:.0f}"]


def models_table(section: dict) -> str:
    """Per talker of `models/` (tiny seeded demo sizes): lifecycle variant, its declared states
    and edges, the engine's decode step at the smallest and largest batch, the per-frame ratio."""
    sizes = [int(b) for b in section["batch_sizes"]]
    lo, hi = sizes[0], sizes[-1]
    note = (
        f"Engine decode step per talker (`LockstepEngine(model, max_slots={section['max_slots']}, "
        f"kernels=\"{section['kernels']}\")`, tiny seeded demo weights, request sampling T=0.9 top-k 50 unless the model fixes its own), "
        f"B={lo} and B={hi} stepped alternately; timed steps are decode-only (every request held decoding; "
        "an ended request is replaced, its prefill step untimed); median ms (p10–p90); "
        f"per-frame ×: (step / frames) at B={hi} ÷ the same at B={lo}."
    )
    head = (f"| model | lifecycle variant | states | edges | B={lo} ms/step | B={lo} frames/s | B={hi} ms/step | "
            f"B={hi} frames/s | rows decoding at B={hi} | per-frame B={hi} / B={lo} | steps |")
    lines = [note, "", head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in section["models"].items():
        if "skipped" in m:
            lines.append(f"| {name} | skipped: {m['skipped'].replace('|', '/')} | | | | | | | | | |")
            continue
        by_b = {int(b): r for b, r in m["batches"].items()}
        rows = by_b.get(hi, {}).get("rows_decoding")
        rows_cell = "–" if not rows else (f"{rows['median']:g}" if rows["min"] == rows["max"]
                                          else f"{rows['median']:g} ({rows['min']}–{rows['max']})")
        ratio = m.get("per_frame_ratio")
        problems = [f"B={b}: {r['problem']}" for b, r in by_b.items() if "problem" in r]
        lines.append(
            f"| {name} | {m['variant']} | {m['states']} | {m['edges']} | " + " | ".join(_step_cells(by_b.get(lo)))
            + " | " + " | ".join(_step_cells(by_b.get(hi))) + f" | {rows_cell} | "
            + ("–" if ratio is None else f"{ratio:.3f}×") + f" | {m.get('steps', '–')} |"
        )
        lines += [f"|  | problem: {p.replace('|', '/')} | | | | | | | | | |" for p in problems]
    return "\n".join(lines)


README_BEGIN = "<!-- bench-table:begin -->"
README_END = "<!-- bench-table:end -->"


def update_readme(path: str, results: dict) -> bool:
    """Put the latest table (with its date and machine) between the README's bench markers;
    returns whether the file changed (MarkedBlockError when the markers are missing)."""
    m = results["machine"]
    stamp = f"{m.get('date', '')} · {m.get('cpu', '')} · {m.get('cores', '')} cores · torch {m.get('torch', '')}"
    body = f"_From `make bench`, {stamp}._\n\n{markdown_table(results)}"
    if results.get("models"):
        body += "\n\n" + models_table(results["models"])
    return replace_marked_block(path, README_BEGIN, README_END, body)


def _counts_table(counts: dict) -> str:
    lines = ["| batch | aten ops | non-view ops (≈launches) | syncs | D2H copies | H2D (host data) | host-stage ops |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for b in sorted(counts["engine"], key=int):
        c = counts["engine"][b]["decode"]
        lines.append(f"| {b} | {c['ops']} | {c['kernels']} | {c['syncs']} | {c['d2h']} | {c['h2d']} | {c['host_stage_ops']} |")
    return "\n".join(lines)


def _naive_counts_table(counts: dict) -> str:
    lines = ["| design | batch | non-view ops / step | syncs / step |", "|---|---:|---:|---:|"]
    for name, by_b in counts.get("naive", {}).items():
        for b in sorted(by_b, key=int):
            c = by_b[b]
            lines.append(f"| {DESIGN_TITLES.get(name, name)} | {b} | {c['kernels']} | {c['syncs']} |")
    return "\n".join(lines)


def _e2e_table(e2e: dict) -> str:
    lines = [
        "| concurrent requests | frames | lockstep frames/s | one-at-a-time frames/s | speedup | "
        "lockstep first frame ms (p50 / max) | one-at-a-time first frame ms (p50 / max) | frames identical |",
        "|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for c in sorted(e2e["concurrency"], key=int):
        r = e2e["concurrency"][c]
        lk, sq = r["lockstep"], r["sequential"]
        lines.append(
            f"| {c} | {lk['frames']} | {lk['frames_per_s']:.1f} | {sq['frames_per_s']:.1f} | "
            f"{r['speedup_frames_per_s']:.1f}× | {lk['first_frame_ms_p50']:.0f} / {lk['first_frame_ms_max']:.0f} | "
            f"{sq['first_frame_ms_p50']:.0f} / {sq['first_frame_ms_max']:.0f} | "
            f"{'yes' if r['identical_frames'] else 'NO: ' + ', '.join(r['mismatched_requests'])} |"
        )
    return "\n".join(lines)


def _split_table(profile: dict) -> str:
    groups = ("host_stage", "fsm_kernels", "sampling", "model", "glue", "host_output")
    lines = ["| batch | step ms | " + " | ".join(groups) + " |", "|---:|---:|" + "---:|" * len(groups)]
    for b in sorted(profile["split"], key=int):
        s = profile["split"][b]
        lines.append(f"| {b} | {s['step_ms']:.2f} | " + " | ".join(f"{s['groups_ms'].get(g, 0.0):.2f}" for g in groups) + " |")
    return "\n".join(lines)


def _admit_table(sweep: dict, designs: Sequence[str]) -> str:
    lines = ["| batch | " + " | ".join(DESIGN_TITLES.get(d, d) for d in designs) + " |",
             "|---:|" + "---:|" * len(designs)]
    for b in sorted(sweep, key=int):
        row = sweep[b]["designs"]
        lines.append(f"| {b} | " + " | ".join(
            "skipped" if "skipped" in row[d] else f"{row[d]['setup_ms'] + row[d]['admit_prefill_step_ms']:.1f}"
            for d in designs) + " |")
    return "\n".join(lines)


def _breakdown_lines(breakdown: dict, sweep: dict) -> list[str]:
    b = breakdown["batch"]
    engine = sweep.get(b, sweep.get(str(b), {})).get("designs", {}).get("engine", {})
    lines = []
    for name, x in breakdown["designs"].items():
        pct = lambda v: 100 * v / x["step_ms"]  # noqa: E731
        lines.append(
            f"- {DESIGN_TITLES.get(name, name)}, B={b}: per-row sampling {pct(x['row_sampling_ms']):.0f}% "
            f"({x['row_sampling_ms']:.1f} ms), lifecycle hooks {pct(x['lifecycle_hooks_ms']):.1f}% "
            f"({x['lifecycle_hooks_ms']:.2f} ms), rest (model calls, input composition, per-row Python) "
            f"{pct(x['rest_ms']):.0f}% ({x['rest_ms']:.1f} ms) of an instrumented {x['step_ms']:.1f} ms step"
        )
    if engine and "median_ms" in engine:
        lines.append(f"- lockstep engine, B={b}: whole step {engine['median_ms']:.1f} ms (median of the timed reps; "
                     "its split is in the profile section below)")
    return lines


def markdown_report(results: dict) -> str:
    """The whole results.md: header (date, machine), every table, targets, findings."""
    m = results["machine"]
    out = [
        "# mtp_fsm bench results",
        "",
        f"{m['date']} · {m['cpu']} · {m['cores']} cores · torch threads {m['torch_threads']} · "
        f"Python {m['python']} · torch {m['torch']} · transitions {m['transitions']} · "
        f"bench wall {results.get('wall_s', 0):.0f} s · load average at start / end "
        f"{m.get('loadavg_start')} / {m.get('loadavg_end')} (other work shared the machine)",
        "",
        "## Decode step time (lifecycle work only)",
        "",
        markdown_table(results),
    ]
    designs = list(next(iter(results["lifecycle"]["sweep"].values()))["designs"])
    out += ["", "Admission: building the drivers' per-request state plus the admit + prefill step, ms, one shot:", "",
            _admit_table(results["lifecycle"]["sweep"], designs)]
    if results.get("naive_breakdown"):
        out += ["", "Where the naive designs' decode step goes (2 instrumented steps apart from the timed ones, mean):", "",
                *_breakdown_lines(results["naive_breakdown"], results["lifecycle"]["sweep"])]
    real = results.get("real_vocab")
    if real:
        designs = list(next(iter(real["sweep"].values()))["designs"])
        out += ["", "### Same, with the real Qwen3-TTS vocabularies (CB0 3072, codebook 2048)", "",
                _sweep_table(real["sweep"], designs)]
    targets = results.get("targets")
    if targets:
        out += ["", "## Targets", ""] + [
            f"- {t['name']}: measured {t['measured']:.2f}, target {t['target']} → **{'met' if t['met'] else 'missed'}**"
            for t in targets
        ]
    counts = results.get("counts")
    if counts:
        ok = counts["engine_constant"]
        out += ["", "## Device ops and host syncs per engine decode step", "",
                "Counted with a TorchDispatchMode over `LockstepEngine.step`, excluding `Ledger.stage` and "
                "`_build_output` (host side). The D2H copy is the step's single output copy.", "",
                _counts_table(counts), "",
                f"Constant in batch size (non-view ops, syncs, copies, per-stage ops): **{'yes' if ok else 'NO'}**"]
        out += [f"- {d}" for d in counts.get("engine_differences", [])]
        if counts.get("h2d_sites"):
            out += ["", "Host-data tensors created inside the step (an H2D copy each on a GPU):", ""]
            out += [f"- {s}" for s in counts["h2d_sites"]]
        out += ["", "Naive designs (ops grow with the batch):", "", _naive_counts_table(counts)]
    profile = results.get("profile")
    if profile:
        out += ["", "## Where an engine step's time goes (exclusive ms per group, mean over steps)", "", _split_table(profile)]
        out += ["", *[f"- {line}" for line in profile.get("findings", [])]]
    models = results.get("models")
    if models:
        out += ["", "## Engine step per talker model (tiny demo sizes)", "", models_table(models)]
        details = []
        for name, m in models["models"].items():
            if "skipped" in m:
                continue
            for b, r in m["batches"].items():
                extra = [f"{k} {r[k]}" for k in ("refills", "starved_fed", "feed_rows") if r.get(k)]
                if r.get("finish_reasons"):
                    extra.append("finishes " + ", ".join(f"{k} {v}" for k, v in r["finish_reasons"].items()))
                if extra:
                    details.append(f"- {name} B={b}: " + "; ".join(extra))
        if details:
            out += ["", "Requests replaced or fed during the measurement:", "", *details]
    e2e = results.get("e2e")
    if e2e:
        out += ["", f"## End to end: tiny Qwen3-TTS ({e2e['dtype']}, max {e2e['max_frames']} frames, {e2e['sampling']})",
                "", _e2e_table(e2e)]
    return "\n".join(out) + "\n"


def plot_step_time(results: dict, path: str) -> None:
    """Step time vs batch size, log-log, one line per design (p10–p90 as error bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    series = [("lifecycle", "", "-")]
    if results.get("real_vocab"):
        series.append(("real_vocab", " (real vocab)", ":"))
    for key, suffix, style in series:
        sweep = results[key]["sweep"]
        designs = list(next(iter(sweep.values()))["designs"])
        for i, d in enumerate(designs):
            pts = [(int(b), sweep[b]["designs"][d]) for b in sorted(sweep, key=int) if "skipped" not in sweep[b]["designs"][d]]
            if not pts:
                continue
            xs = [b for b, _ in pts]
            ys = [s["median_ms"] for _, s in pts]
            err = [[s["median_ms"] - s["p10_ms"] for _, s in pts], [s["p90_ms"] - s["median_ms"] for _, s in pts]]
            ax.errorbar(xs, ys, yerr=err, linestyle=style, marker="o", markersize=3, capsize=2, color=f"C{i}",
                        label=DESIGN_TITLES.get(d, d) + suffix)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (requests decoding)")
    ax.set_ylabel("decode step time, ms (median, p10–p90)")
    ax.set_title("mtp_fsm: one decode step, lifecycle work only (NullTalker)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
