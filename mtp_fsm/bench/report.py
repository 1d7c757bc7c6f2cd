"""Renders bench results: the README markdown table, the full results.md, the step-time plot."""

from __future__ import annotations

from typing import Sequence

from .._util.marked_block import replace_marked_block

DESIGN_TITLES = {
    "floor": "floor (no lifecycle)",
    "engine": "lockstep engine",
    "engine_compiled": "lockstep engine, stages compiled (kernels=\"compiled\")",
    "transitions": "transitions static machine, FSM per request",
    "dict_loop": "per-request dict loop",
}
SHORT_TITLES = {"floor": "floor", "engine": "engine", "engine_compiled": "engine compiled", "transitions": "transitions",
                "dict_loop": "dict loop"}
CLOCK_WORDS = {
    "cpu": "the step thread's CPU time (torch on 1 thread: the whole step runs there; time other processes "
           "take the core away is left out)",
    "wall": "wall time",
}


def _designs(sweep: dict) -> list[str]:
    return list(next(iter(sweep.values()))["designs"]) if sweep else []


def _stat(d: dict, clock: str) -> dict:
    return d["cpu"] if clock == "cpu" else d


def _cell(d: dict, clock: str = "wall") -> str:
    if "skipped" in d:
        return "skipped"
    s = _stat(d, clock)
    return f"{s['median_ms']:.2f} ({s['p10_ms']:.2f}–{s['p90_ms']:.2f})"


def _overhead(d: dict, clock: str) -> str:
    if "skipped" in d:
        return "–"
    return f"{d[f'overhead_ms_{clock}']:+.2f} ({d[f'ratio_{clock}']:.2f}×)"


def _sweep_table(sweep: dict, designs: Sequence[str], clock: str) -> str:
    ref = next(iter(sweep.values())).get("reference", designs[0])
    head = ["batch"]
    for d in designs:
        head.append(f"{SHORT_TITLES.get(d, d)} ms")
        if d != ref:
            head.append(f"{SHORT_TITLES.get(d, d)} overhead ms (×{SHORT_TITLES.get(ref, ref)})")
    head.append("reps")
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for b in sorted(sweep, key=int):
        row = sweep[b]["designs"]
        cells = [str(b)]
        for d in designs:
            cells.append(_cell(row[d], clock))
            if d != ref:
                cells.append(_overhead(row[d], clock))
        cells.append(str(sweep[b]["reps"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _counts_cell(c: dict | None) -> str:
    if not c:
        return "–"
    return f"{c['kernels']} ({c['device_ops']}/{c['host_ops']}) · {c['h2d']} · {c['d2h']} · {c['syncs']}"


def counts_table(sweep: dict, designs: Sequence[str]) -> str:
    """Whole-step counts of one steady decode step per design and batch."""
    lines = ["| batch | " + " | ".join(f"{SHORT_TITLES.get(d, d)}: ops (device/host) · H2D · D2H · syncs" for d in designs) + " |",
             "|---:|" + "---:|" * len(designs)]
    for b in sorted(sweep, key=int):
        row = sweep[b]["designs"]
        lines.append(f"| {b} | " + " | ".join(_counts_cell(row[d].get("counts")) for d in designs) + " |")
    return "\n".join(lines)


def _reps_words(sweep: dict) -> str:
    return ", ".join(f"B={b}: {sweep[b]['reps']}" for b in sorted(sweep, key=int))


def _target_line(t: dict) -> str:
    m = t["measured"]
    value = "" if m is None or isinstance(m, dict) else f"{m:.3f}; "  # a dict's parts are in the detail
    if t.get("unresolved"):
        return f"- {t['name']} {t['target']}: **unresolved** ({t['unresolved']}; {value}{t['detail']})"
    return f"- {t['name']} {t['target']}: **{'met' if t['met'] else 'missed'}** ({value}{t['detail']})"


def markdown_table(results: dict) -> str:
    """The README block: step time and lifecycle overhead per design and batch size, the
    whole-step counts, and the targets."""
    life = results["lifecycle"]
    sweep, cfg, clock = life["sweep"], life["config"], life.get("clock", "wall")
    designs = _designs(sweep)
    real = life.get("vocab", "real") == "real"
    note = (
        f"Decode step, all B requests decoding; NullTalker (precomputed model outputs; Q={cfg['num_codebooks']}, "
        f"CB0 vocab {cfg['backbone_vocab_size']}, codebook {cfg['codebook_size']}"
        + (": the real Qwen3-TTS vocabularies" if real else ": vocabularies scaled down, NOT the real ones") + "). "
        "Every design makes the same model calls and samples with the engine's batched sampler (T=0.9, top-k 50); "
        "the floor does nothing else (no lifecycle). Step: median ms (p10–p90) of "
        f"{CLOCK_WORDS.get(clock, clock)}; overhead = design − floor, median of the per-repetition differences "
        "(× = median per-repetition ratio to the floor). Designs interleaved in every repetition; repetitions per "
        f"batch size: {_reps_words(sweep)}."
        + (" engine compiled: the same engine with its lifecycle stages compiled by TorchInductor "
           "(`kernels=\"compiled\"`; warm: its compile happened at admission, outside the timed steps)."
           if "engine_compiled" in designs else "")
    )
    out = note + "\n\n" + _sweep_table(sweep, designs, clock)
    counted = [d for d in designs if any("counts" in sweep[b]["designs"].get(d, {}) for b in sweep)]
    if counted:
        out += ("\n\nOne steady decode step, whole step (host staging and output building included; "
                "`mtp_fsm/bench/counters.py`): non-view aten ops (device / host), host-to-device copies, "
                "device-to-host copies, host syncs (every D2H counts as one).\n\n" + counts_table(sweep, counted))
    targets = results.get("targets")
    if targets:
        out += "\n\nTargets (computed from the table above):\n\n" + "\n".join(_target_line(t) for t in targets)
    return out


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
    costs = section.get("frame_costs")
    if costs:
        cells = "; ".join(f"B={b}: {r['payload_us']:.0f} µs payload, {r['delay_us']:.0f} µs delay pattern"
                          for b, r in costs["batches"].items())
        lines += ["", "Frame-format work the engine adds per step at the real sizes (`bench/frame_costs.py`, "
                  f"torch.utils.benchmark medians): VoxCPM2's payload ({'×'.join(map(str, costs['payload_shape']))} "
                  f"float32 patch: noise, decode, finiteness, encode) and Higgs Audio v3's delay-pattern masks "
                  f"({costs['delay_codebooks']} codebooks × {costs['delay_vocab']}): {cells}. Other models run none of it."]
    return "\n".join(lines)


README_BEGIN = "<!-- bench-table:begin -->"
README_END = "<!-- bench-table:end -->"


def update_readme(path: str, results: dict) -> bool:
    """Put the latest table (with its date and machine) between the README's bench markers;
    returns whether the file changed (MarkedBlockError when the markers are missing)."""
    m = results["machine"]
    stamp = f"{m.get('date', '')} · {m.get('cpu', '')} · {m.get('cores', '')} cores · torch {m.get('torch', '')}"
    body = f"_From `make bench`, {stamp}{carried_words(results)}._\n\n{markdown_table(results)}"
    if results.get("models"):
        body += "\n\n" + models_table(results["models"])
    if results.get("speculative"):
        from .speculative import speculative_table

        body += "\n\n" + speculative_table(results["speculative"])
    if results.get("audio"):
        body += "\n\n" + audio_section(results["audio"])
    return replace_marked_block(path, README_BEGIN, README_END, body)


def carried_words(results: dict) -> str:
    """'; kept from earlier runs: ...' for the sections this run skipped (bench/run.py carry_over)."""
    carried = results.get("carried_over") or {}
    return "; kept from earlier runs: " + ", ".join(f"{k} ({v})" for k, v in sorted(carried.items())) if carried else ""


def audio_section(rows: list[dict]) -> str:
    """The speech-out table (`bench/audio.py`) and its target: frames/s with audio on >= 0.9x off."""
    from .audio import markdown_rows

    worst = min(r["ratio"] for r in rows)
    verdict = "met" if worst >= 0.9 else "missed"
    return ("Speech out (`bench/audio.py`): 16 concurrent requests on 16 slots, tiny talkers and their tiny "
            "decoders, audio off and on interleaved, medians; first audio from arrival.\n\n"
            + markdown_rows(rows) + f"\n\n- engine frames/s audio on / off ≥ 0.9 at 16 requests: **{verdict}** "
            f"(lowest {worst:.3f})")


def _engine_counts_table(counts: dict) -> str:
    lines = ["| batch | ops | device ops | host ops | H2D | D2H | syncs | ops per stage |",
             "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for b in sorted(counts["engine"], key=int):
        c = counts["engine"][b]["decode"]
        stages = ", ".join(f"{k} {v}" for k, v in c["by_stage"].items())
        lines.append(f"| {b} | {c['kernels']} | {c['device_ops']} | {c['host_ops']} | {c['h2d']} | {c['d2h']} | "
                     f"{c['syncs']} | {stages} |")
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


def _breakdown_lines(breakdown: dict) -> list[str]:
    b = breakdown["batch"]
    lines = []
    for name, x in breakdown["designs"].items():
        pct = lambda v: 100 * v / x["step_ms"]  # noqa: E731
        lines.append(
            f"- {DESIGN_TITLES.get(name, name)}, B={b}: batched sampling {pct(x['sampling_ms']):.0f}% "
            f"({x['sampling_ms']:.1f} ms), lifecycle hooks {pct(x['lifecycle_hooks_ms']):.1f}% "
            f"({x['lifecycle_hooks_ms']:.2f} ms), rest (model calls, gathering per-row inputs, per-row Python) "
            f"{pct(x['rest_ms']):.0f}% ({x['rest_ms']:.1f} ms) of an instrumented {x['step_ms']:.1f} ms step"
        )
    return lines


def _sites(sweep: dict, design: str) -> list[str]:
    """Where the design's copies and syncs happen at its largest batch (each site once)."""
    for b in sorted(sweep, key=int, reverse=True):
        c = sweep[b]["designs"].get(design, {}).get("counts")
        if c:
            seen = {}
            for site in c["sites"]:
                seen[site] = seen.get(site, 0) + 1
            return [f"B={b}: {site}" + (f" (×{n})" if n > 1 else "") for site, n in seen.items()]
    return []


def markdown_report(results: dict) -> str:
    """The whole results.md: header (date, machine), every table, targets, findings."""
    m = results["machine"]
    life = results["lifecycle"]
    sweep, clock = life["sweep"], life.get("clock", "wall")
    designs = _designs(sweep)
    out = [
        "# mtp_fsm bench results",
        "",
        f"{m['date']} · {m['cpu']} · {m['cores']} cores · torch threads {m['torch_threads']} · "
        f"Python {m['python']} · torch {m['torch']} · transitions {m['transitions']} · "
        f"bench wall {results.get('wall_s', 0):.0f} s · load average at start / end "
        f"{m.get('loadavg_start')} / {m.get('loadavg_end')} (other work shared the machine)"
        + carried_words(results),
        "",
        "## Decode step time and lifecycle overhead",
        "",
        markdown_table(results),
    ]
    other = "wall" if clock == "cpu" else "cpu"
    out += ["", f"The same steps on the other clock ({CLOCK_WORDS[other]}):", "", _sweep_table(sweep, designs, other)]
    out += ["", "Admission: building the drivers' per-request state plus the admit + prefill step, ms, one shot:", "",
            _admit_table(sweep, designs)]
    if results.get("naive_breakdown"):
        out += ["", f"Where the naive designs' decode step goes (2 instrumented steps apart from the timed ones, mean, "
                    f"{clock} clock):", "",
                *_breakdown_lines(results["naive_breakdown"])]
    for d in designs:
        sites = _sites(sweep, d)
        if sites:
            out += ["", f"Copies and syncs of one {DESIGN_TITLES.get(d, d)} step:", "", *[f"- {x}" for x in sites]]
    counts = results.get("counts")
    if counts:
        ok = counts["engine_constant"]
        out += ["", "## Engine whole-step counts at every batch size on one engine", "",
                f"One `LockstepEngine` of {counts.get('max_slots', '?')} slots per batch size (small vocabularies: "
                "counts do not depend on V), one steady decode step each:", "",
                _engine_counts_table(counts), "",
                f"Constant in batch size (ops, copies, syncs, ops per stage): **{'yes' if ok else 'NO'}**"]
        out += [f"- {d}" for d in counts.get("engine_differences", [])]
    profile = results.get("profile")
    if profile and profile.get("split"):
        out += ["", f"## Where an engine step's time goes (exclusive ms per group, mean over steps, {clock} clock)", "",
                _split_table(profile)]
        out += ["", *[f"- {line}" for line in profile.get("findings", [])]]
    models = results.get("models")
    if models:
        out += ["", "## Engine step per talker model (tiny demo sizes)", "", models_table(models)]
        details = []
        for name, mm in models["models"].items():
            if "skipped" in mm:
                continue
            for b, r in mm["batches"].items():
                extra = [f"{k} {r[k]}" for k in ("refills", "starved_fed", "feed_rows") if r.get(k)]
                if r.get("finish_reasons"):
                    extra.append("finishes " + ", ".join(f"{k} {v}" for k, v in r["finish_reasons"].items()))
                if extra:
                    details.append(f"- {name} B={b}: " + "; ".join(extra))
        if details:
            out += ["", "Requests replaced or fed during the measurement:", "", *details]
    if results.get("speculative"):
        from .speculative import speculative_table

        out += ["", "## Speculative decoding (MTP LM: tiny and wide)", "", speculative_table(results["speculative"])]
    if results.get("audio"):
        out += ["", "## Speech out", "", audio_section(results["audio"])]
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

    life = results["lifecycle"]
    sweep, clock = life["sweep"], life.get("clock", "wall")
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for i, d in enumerate(_designs(sweep)):
        pts = [(int(b), _stat(sweep[b]["designs"][d], clock)) for b in sorted(sweep, key=int)
               if "skipped" not in sweep[b]["designs"][d]]
        if not pts:
            continue
        xs = [b for b, _ in pts]
        ys = [s["median_ms"] for _, s in pts]
        err = [[s["median_ms"] - s["p10_ms"] for _, s in pts], [s["p90_ms"] - s["median_ms"] for _, s in pts]]
        ax.errorbar(xs, ys, yerr=err, linestyle="--" if d == "floor" else "-", marker="o", markersize=3, capsize=2,
                    color=f"C{i}", label=DESIGN_TITLES.get(d, d))
    cfg = life["config"]
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (requests decoding)")
    ax.set_ylabel(f"decode step, ms ({clock}; median, p10–p90)")
    ax.set_title(f"mtp_fsm: one decode step, NullTalker, CB0 {cfg['backbone_vocab_size']} / codebook {cfg['codebook_size']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
