"""`make bench-vllm`: frames/s of the same requests through the embedded serving loop and through vLLM, side by side."""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time

from .._util.threads import torch_threads
from ..engine import LockstepEngine, NewRequest
from ..serving import InMemorySink, ServingLoop
from ..serving.model_loader import load_talker
from .llm import TalkerLLM

TEXTS = ("Hello there, how are you today?", "A longer sentence to speak, with a comma and a pause.", "Short one.")


def _requests(talker, n: int, max_frames: int) -> list[NewRequest]:
    return [NewRequest(f"b-{i}", talker.text_inputs(TEXTS[i % len(TEXTS)]), max_frames=max_frames, seed=i)
            for i in range(n)]


def _embedded(model, requests, slots: int) -> tuple[float, dict]:
    loop = ServingLoop(LockstepEngine(model, slots, kernels="torch"), sinks=(sink := InMemorySink(),))
    start = time.perf_counter()
    for request in requests:
        loop.submit(request)
    loop.run_until_idle()
    return time.perf_counter() - start, {r.request_id: sink.codes(r.request_id) for r in requests}


def _vllm(llm: TalkerLLM, requests) -> tuple[float, dict]:
    start = time.perf_counter()
    results = llm.generate(requests)
    elapsed = time.perf_counter() - start
    return elapsed, {rid: [f.codes.tolist() for f in g.frames] for rid, g in results.items()}


def run(concurrency: tuple[int, ...], max_frames: int, rounds: int, talker_name: str) -> list[dict]:
    rows = []
    for seqs in concurrency:
        talker = load_talker(talker_name, seed=0)
        requests = _requests(talker, seqs, max_frames)
        llm = TalkerLLM(talker_name, max_num_seqs=seqs, max_num_batched_tokens=max(256, seqs))
        times: dict[str, list[float]] = {"embedded": [], "vllm": []}
        for _ in range(rounds):  # alternate, so drift on a noisy machine hits both
            t_e, frames_e = _embedded(talker.model, requests, seqs)
            t_v, frames_v = _vllm(llm, requests)
            if frames_e != frames_v:
                raise AssertionError(f"concurrency {seqs}: frames through vLLM differ from the embedded loop's")
            times["embedded"].append(t_e)
            times["vllm"].append(t_v)
        llm.close()
        frames = sum(len(f) for f in frames_e.values())
        e, v = statistics.median(times["embedded"]), statistics.median(times["vllm"])
        rows.append({"concurrency": seqs, "requests": len(requests), "frames": frames,
                     "embedded_frames_per_s": frames / e, "vllm_frames_per_s": frames / v, "vllm_over_embedded": v / e})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtp_fsm.vllm.bench", description=__doc__)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--max-frames", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="qwen3_tts")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both designs")
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.getLogger("vllm").setLevel(logging.ERROR)
    with torch_threads(args.threads):
        rows = run(tuple(args.concurrency), args.max_frames, args.rounds, args.model)
    print("| concurrent requests | frames | embedded frames/s | vLLM frames/s | vLLM time / embedded |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['frames']} | {r['embedded_frames_per_s']:.1f} | {r['vllm_frames_per_s']:.1f} "
              f"| {r['vllm_over_embedded']:.3f} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "vllm.json"), "w") as f:
        json.dump({"rows": rows, "max_frames": args.max_frames, "rounds": args.rounds, "model": args.model}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
