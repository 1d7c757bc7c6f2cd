"""One table over every talker's parity rows (standard library only).

`make parity` runs tests/parity once per parity venv; each run's conftest writes its rows
(parity_support.RESULTS) to PARITY_RESULTS, a JSON file in .parity-results/. Run as a script
on that folder, this prints the table of max differences, greedy frame counts and checkpoint
loads per talker, and exits 1 when a talker has no rows or any row failed. conftest.py prints the
same table for its own run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# The order of the README's talker table, and what each is checked against.
TALKERS = {
    "Qwen3-TTS": "qwen-tts 0.1.1 (transformers 4.57.3)",
    "Qwen3-TTS codec": "qwen-tts 0.1.1 Qwen3TTSTokenizerV2Decoder",
    "Qwen3-Omni": "transformers 5.24.0 Qwen3OmniMoe talker",
    "MOSS-TTS Local": "vllm-omni 0.30.0 modules (+ transformers 5.24.0 Qwen3)",
    "Chatterbox T3": "chatterbox-tts 0.1.7 T3 (transformers 5.2.0)",
    "Higgs Audio v3": "vllm-omni 0.30.0 modules, boson-multimodal 0.1.1 sampler",
    "VoxCPM2": "voxcpm 2.0.3 model modules",
}


def talker_rows(results: list[dict]) -> list[dict]:
    by: dict[str, list[dict]] = {}
    for row in results:
        by.setdefault(row["talker"], []).append(row)
    names = [t for t in TALKERS if t in by] + sorted(t for t in by if t not in TALKERS)
    out = []
    for name in names:
        rows = by[name]
        tensors = [r for r in rows if r["kind"] == "tensor"]
        greedy = [r for r in rows if r["kind"] == "greedy" and not r.get("divergence")]
        documented = [r for r in rows if r["kind"] == "greedy" and r.get("divergence")]
        loads = [r for r in rows if r["kind"] == "load"]
        out.append(dict(
            talker=name, upstream=TALKERS.get(name, "?"), tensors=len(tensors),
            diff=max((r["diff"] for r in tensors), default=None),
            scaled=max((r["scaled"] for r in tensors), default=None),
            tol=max((r["tol"] for r in tensors), default=None),
            greedy=len(greedy), same=sum(r["same"] for r in greedy), total=sum(r["total"] for r in greedy),
            per_run=(min((r["total"] for r in greedy), default=0), max((r["total"] for r in greedy), default=0)),
            documented=documented, loads=len(loads), loads_ok=sum(r["ok"] for r in loads),
            failed=[r for r in rows if not r["ok"]],
        ))
    return out


def format_table(results: list[dict], expect_all: bool = False) -> tuple[list[str], bool]:
    """The lines of the table and whether every talker passed (and, with expect_all, every talker
    of TALKERS has rows)."""
    rows = talker_rows(results)
    lines = [f"{'talker':<15} {'upstream':<58} {'tensor':>6} {'max|diff|':>9} {'scaled':>8} "
             f"{'greedy runs':>11} {'frames identical':>17} {'per run':>8} {'ckpt loads':>10}  ok"]
    ok_all = True
    for r in rows:
        diff = "-" if r["diff"] is None else f"{r['diff']:.2e}"
        scaled = "-" if r["scaled"] is None else f"{r['scaled']:.1e}"
        frames = f"{r['same']}/{r['total']}" if r["greedy"] else "-"
        loads = f"{r['loads_ok']}/{r['loads']}" if r["loads"] else "-"
        lo, hi = r["per_run"]
        per_run = "-" if not r["greedy"] else (f"{lo}" if lo == hi else f"{lo}-{hi}")
        ok = not r["failed"]
        ok_all &= ok
        lines.append(f"{r['talker']:<15} {r['upstream']:<58} {r['tensors']:>6} {diff:>9} {scaled:>8} "
                     f"{r['greedy']:>11} {frames:>17} {per_run:>8} {loads:>10}  {'yes' if ok else 'NO'}")
    if expect_all:
        for name in TALKERS:
            if name not in {r["talker"] for r in rows}:
                ok_all = False
                lines.append(f"{name:<15} {TALKERS[name]:<58} no rows: its parity run skipped or failed before any check  NO")
    for r in rows:
        for d in r["documented"]:
            lines.append(f"  {r['talker']}: {d['what']}: {d['same']}/{d['total']} frames identical, "
                         f"documented divergence: {d['divergence']}")
        for f in r["failed"]:
            lines.append(f"  FAILED {r['talker']}: {f['what']} {f.get('note', '')}")
    lines.append("tensor: checks within tolerance (|diff| <= 1e-5 x max(1, |upstream|)); frames identical: "
                 "greedy frames equal / compared, summed over runs; per run: frames compared per run (min-max; short runs "
                 "are stop checks); ckpt loads: our checkpoint opened by the upstream class / loader")
    return lines, ok_all


def main(folder: str) -> int:
    files = sorted(Path(folder).glob("*.json"))
    results = [row for f in files for row in json.loads(f.read_text())]
    lines, ok = format_table(results, expect_all=True)
    print("\n==== make parity: every talker vs its upstream " + "=" * 40)
    print(f"(runs: {', '.join(f.stem for f in files) or 'none'})")
    for line in lines:
        print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".parity-results"))
