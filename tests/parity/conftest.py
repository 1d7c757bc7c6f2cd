"""Parity tests of every talker vs its upstream (`make parity`): see parity_support.py.

Importing parity_support registers the official Qwen3-TTS package skeleton before the test
modules are collected; the hook below prints Qwen3-TTS's table of max differences, then this
run's per-talker table, and (PARITY_RESULTS set) writes the rows for parity_summary.py.
"""

from __future__ import annotations

import json
import os

from parity_summary import format_table
from parity_support import DIFFS, RESULTS  # import side effect: the official package skeleton


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    out = os.environ.get("PARITY_RESULTS")
    if out:
        with open(out, "w") as f:
            json.dump(RESULTS, f, indent=1)
    if DIFFS:
        _qwen3_tts_tables(terminalreporter)
    if RESULTS:
        terminalreporter.section("parity of this run, per talker")
        for line in format_table(RESULTS)[0]:
            terminalreporter.write_line(line)


def _qwen3_tts_tables(tr) -> None:
    tr.section("Qwen3-TTS parity vs qwen-tts 0.1.1: max differences")
    tr.write_line("tensors: max |ours - official| and max |ours - official| / max(1, |official|) (<= 1e-5);")
    tr.write_line("codes and weights: frames (or values) differing, exact")
    width = max(len(k) for k in DIFFS)
    tr.write_line(f"{'check':<{width}}  {'max |diff|':>10}  {'scaled':>9}  {'allowed':>7}  ok")
    for what, (diff, scaled, tol) in DIFFS.items():
        if tol is None:
            row, ok = f"{int(diff) if diff == int(diff) else diff:>10}  {'':>9}  {'exact':>7}", diff == 0
        else:
            row, ok = f"{diff:>10.3e}  {scaled:>9.2e}  {tol:>7.0e}", scaled <= tol
        tr.write_line(f"{what:<{width}}  {row}  {'yes' if ok else 'NO'}")
    # The same, one row per kind of check (the worst over every layout, batch and shape).
    kinds: dict[str, list] = {}
    for what, (diff, scaled, tol) in DIFFS.items():
        kind = next((k for k in KINDS if k in what), "other")
        entry = kinds.setdefault(kind, [0.0, 0.0, tol, 0])
        entry[0], entry[3] = max(entry[0], diff), entry[3] + 1
        entry[1] = max(entry[1], scaled or 0.0)
    tr.section("Qwen3-TTS parity: worst per kind of check")
    tr.write_line(f"{'kind':<26}  {'checks':>6}  {'max |diff|':>10}  {'scaled':>9}  {'allowed':>7}")
    for kind, (diff, scaled, tol, n) in kinds.items():
        if tol is None:
            tr.write_line(f"{kind:<26}  {n:>6}  {int(diff):>10}  {'':>9}  {'exact':>7}")
        else:
            tr.write_line(f"{kind:<26}  {n:>6}  {diff:>10.3e}  {scaled:>9.2e}  {tol:>7.0e}")


KINDS = ("prompt embeds", "trailing text padding", "trailing text", "CB0 logits", "code-predictor logits",
         "greedy", "weights", "codec")
