"""Client-side serving bench: time to first audio and streams/s through the speech API (embedded backend, loopback HTTP)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from typing import Callable, Sequence

from .._util.stats import percentile
from .._util.threads import torch_threads

log = logging.getLogger("mtp_fsm.bench.serving")  # not __name__: "__main__" under python -m
CONCURRENCY = (1, 8, 32)
TARGET_CONCURRENCY, TARGET_RATIO = 8, 1.5  # client TTFA p50 <= 1.5x the engine's own first-frame latency


def _client_round(url: str, n: int, max_frames: int, seed: int) -> tuple[list[dict], float]:
    """One round from a client process of its own (serving_client.py): the server's threads (event loop,
    engine, decoder) do not share a GIL with the client, as they would not in production."""
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "serving_client.py"), url, str(n),
           str(max_frames), str(seed)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the bench client failed ({done.returncode}): {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["rows"], result["wall_s"]


def bench_serving(model: str = "qwen3_tts", *, concurrency: Sequence[int] = CONCURRENCY, max_frames: int = 24,
                  min_requests: int = 16, seed: int = 0, threads: int = 1,
                  out: Callable[[str], None] = log.info) -> dict:
    """The embedded server (uvicorn on loopback, engine and decoder on their threads) and a real HTTP
    client in a process of its own: at each concurrency, one untimed round, then rounds of n simultaneous
    PCM streams until at least `min_requests` have run. Per request: TTFA from the client's send to its first audio bytes; per
    round: streams/s = n / the round's wall time. The engine's own first-frame latency is read for the same
    requests (ServingMetrics), so the two are compared on one run: from the moment the engine's thread took
    the request (the target's), and from its own submit (ratio_vs_submit). They differ by the admission
    work of the requests of its batch submitted before it (the model's prompt preparation, engine work:
    counted from its own submit it would be charged to the serving layer).

    -> {"model", "rows": [{concurrency, requests, ttfa_ms_p50, ttfa_ms_p95, streams_per_s,
        engine_first_frame_ms_p50, ratio, engine_first_frame_from_submit_ms_p50, ratio_vs_submit}], "target": {...}}"""
    from ..api.app import build_embedded_app, load_embedded_backend
    from ..api.limits import Limits
    from ..api.loopback import LoopbackServer

    logging.getLogger("mtp_fsm.api").setLevel(logging.WARNING)  # no line per request in the bench's output
    with torch_threads(threads):
        backend = load_embedded_backend(model, seed=seed, max_slots=max(concurrency), kernels="torch")
        app = build_embedded_app(backend, limits=Limits(max_new_tokens=max_frames, max_concurrent=max(concurrency)))
        rows = []
        with LoopbackServer(app) as server:
            _client_round(server.url, 2, min(4, max_frames), seed)  # warm-up: first calls of every path
            for n in concurrency:
                # One untimed round at this concurrency first: the model's and the decoder's first calls at
                # a new batch shape cost several times a later one (steady state is what is compared).
                _client_round(server.url, n, max_frames, seed + 10_000)
                timed, rates = [], []
                while len(timed) < max(min_requests, n):
                    got, wall = _client_round(server.url, n, max_frames, seed + len(timed))
                    timed += got
                    rates.append(n / wall)
                records = [backend.metrics.requests[r["id"]] for r in timed]
                engine = [m.first_frame_from_received_ms for m in records if m.first_frame_time is not None]
                from_submit = [m.first_frame_ms for m in records if m.first_frame_time is not None]
                ttfa = [1e3 * r["ttfa_s"] for r in timed if r["ttfa_s"] is not None]
                row = {"concurrency": n, "requests": len(timed), "ttfa_ms_p50": percentile(ttfa, 50),
                       "ttfa_ms_p95": percentile(ttfa, 95), "streams_per_s": sorted(rates)[len(rates) // 2],
                       "engine_first_frame_ms_p50": percentile(engine, 50),
                       "engine_first_frame_from_submit_ms_p50": percentile(from_submit, 50)}
                row["ratio"] = row["ttfa_ms_p50"] / row["engine_first_frame_ms_p50"]
                row["ratio_vs_submit"] = row["ttfa_ms_p50"] / row["engine_first_frame_from_submit_ms_p50"]
                rows.append(row)
                out(f"  {n:>3} concurrent: TTFA p50 {row['ttfa_ms_p50']:.1f} ms, p95 {row['ttfa_ms_p95']:.1f} ms, "
                    f"{row['streams_per_s']:.2f} streams/s; engine first frame p50 {row['engine_first_frame_ms_p50']:.1f}"
                    f" ms ({row['ratio']:.2f}x), from its own submit {row['engine_first_frame_from_submit_ms_p50']:.1f}"
                    f" ms ({row['ratio_vs_submit']:.2f}x)")
    at = next((r for r in rows if r["concurrency"] == TARGET_CONCURRENCY), None)
    target = {"concurrency": TARGET_CONCURRENCY, "max_ratio": TARGET_RATIO,
              "ratio": None if at is None else at["ratio"],
              "met": None if at is None else at["ratio"] <= TARGET_RATIO}
    return {"model": model, "max_frames": max_frames, "rows": rows, "target": target}


def serving_section(result: dict) -> str:
    """The serving table (markdown) and its target line."""
    lines = [f"Online API (`bench/serving.py`): {result['model']}, embedded backend, uvicorn on loopback, an httpx "
             f"client in a process of its own streaming PCM (`stream=true`), up to {result['max_frames']} frames each; "
             "TTFA from the client's send to its first audio bytes; the engine's first frame, same requests, from "
             "the moment the engine's thread took the request, and (last two columns) from its own submit, after "
             "the prompt preparation of the requests of its batch submitted before it.", "",
             "| concurrent | requests | TTFA p50 ms | TTFA p95 ms | streams/s | engine first frame p50 ms | "
             "TTFA / engine | from own submit p50 ms | TTFA / that |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['concurrency']} | {r['requests']} | {r['ttfa_ms_p50']:.1f} | {r['ttfa_ms_p95']:.1f} | "
                     f"{r['streams_per_s']:.2f} | {r['engine_first_frame_ms_p50']:.1f} | {r['ratio']:.2f}x | "
                     f"{r['engine_first_frame_from_submit_ms_p50']:.1f} | {r['ratio_vs_submit']:.2f}x |")
    t = result["target"]
    verdict = "unresolved (not measured)" if t["met"] is None else ("met" if t["met"] else "missed")
    ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}"
    lines += ["", f"- client TTFA p50 at {t['concurrency']} concurrent ≤ {t['max_ratio']}x the engine's first-frame "
              f"latency: **{verdict}** ({ratio}x)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtp_fsm.bench.serving", description=__doc__)
    parser.add_argument("--model", default="qwen3_tts")
    parser.add_argument("--concurrency", type=lambda s: tuple(int(x) for x in s.split(",")), default=CONCURRENCY)
    parser.add_argument("--max-frames", type=int, default=24)
    parser.add_argument("--min-requests", type=int, default=16)
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # others' INFO (transitions') stays out
    log.setLevel(logging.INFO)
    result = bench_serving(args.model, concurrency=args.concurrency, max_frames=args.max_frames,
                           min_requests=args.min_requests)
    print(serving_section(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
