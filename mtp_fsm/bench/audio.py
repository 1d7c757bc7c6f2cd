"""Speech out: engine frames/s with the codec decoder on vs off at N concurrent requests, first-audio latency, RTF."""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from typing import Callable, Sequence

from .._util.threads import torch_threads
from ..engine import LockstepEngine, NewRequest
from ..serving.audio_metrics import summarize
from ..serving.audio_stream import AudioStream
from ..serving.codec import load_decoder
from ..serving.model_loader import load_talker
from ..serving.runner import ServingLoop

log = logging.getLogger("mtp_fsm.bench.audio")  # not __name__: "__main__" under python -m
AUDIO_MODELS = ("qwen3_tts", "qwen3_omni", "higgs_audio_v3", "voxcpm2")
TEXTS = ("Hello there, how are you today?", "The quick brown fox jumps over the lazy dog.",
         "Please turn left at the next corner.", "Trains to the airport leave every ten minutes.")


def _run(talker, decoder, requests: int, max_slots: int, max_frames: int, seed: int, audio: bool,
         worker_nice: int | None = None) -> dict:
    engine = LockstepEngine(talker.model, max_slots)
    try:
        return _serve(engine, talker, decoder, requests, max_frames, seed, audio, worker_nice)
    finally:
        engine.close()  # the talker binds to one live engine at a time


def _serve(engine, talker, decoder, requests: int, max_frames: int, seed: int, audio: bool,
           worker_nice: int | None) -> dict:
    samples = [0]
    stream = None
    if audio:
        stream = AudioStream(decoder, lambda chunk: samples.__setitem__(0, samples[0] + len(chunk.samples)),
                             frame_width=engine.spec.frame_width, worker_nice=worker_nice)
    loop = ServingLoop(engine, sinks=() if stream is None else (stream,))
    start = time.perf_counter()
    for i in range(requests):
        loop.submit(NewRequest(f"a{i:03d}", talker.text_inputs(TEXTS[i % len(TEXTS)]), max_frames=max_frames,
                               seed=seed + i))
    loop.run_until_idle()
    engine_s = time.perf_counter() - start  # the step loop's time: what decoding must not slow
    row = {"frames": loop.metrics.total_frames, "engine_s": engine_s,
           "frames_per_s": loop.metrics.total_frames / engine_s}
    if stream is not None:
        stream.close()
        row["until_last_audio_s"] = time.perf_counter() - start
        row["summary"] = summarize(stream, loop.metrics)
        row["first_frame_ms_p50"] = loop.metrics.summary().first_frame_ms_p50
        row["samples"] = samples[0]
    return row


def bench_audio(model: str = "qwen3_omni", *, requests: int = 16, max_slots: int = 16, max_frames: int = 48,
                repeats: int = 3, seed: int = 0, threads: int = 1, worker_nice: int | None = None,
                out: Callable[[str], None] = log.info) -> dict:
    """The same requests served with audio off and on, interleaved `repeats` times (noise hits both
    alike); medians. audio on: the talker's tiny decoder on AudioStream's worker thread (worker_nice:
    see AudioStream).

    -> {"model", "requests", "frames_per_s_off", "frames_per_s_on", "ratio", "first_audio_ms_p50",
        "first_audio_ms_p95", "decoder_rtf", "stream_rtf_p50", ...}."""
    with torch_threads(threads):
        talker = load_talker(model, seed=seed)
        decoder = load_decoder(model, seed=seed)
        _run(talker, decoder, 2, max_slots, 4, seed, audio=True)  # warm-up: first calls of both paths
        off, on = [], []
        for _ in range(repeats):
            off.append(_run(talker, decoder, requests, max_slots, max_frames, seed, audio=False))
            on.append(_run(talker, decoder, requests, max_slots, max_frames, seed, audio=True, worker_nice=worker_nice))
    best = sorted(on, key=lambda r: r["frames_per_s"])[len(on) // 2]  # the median run's audio figures
    s = best["summary"]
    result = {
        "model": model, "requests": requests, "max_slots": max_slots, "max_frames": max_frames, "repeats": repeats,
        "threads": threads, "worker_nice": worker_nice, "sample_rate": decoder.sample_rate, "samples_per_frame": decoder.samples_per_frame,
        "frames_per_s_off": statistics.median(r["frames_per_s"] for r in off),
        "frames_per_s_on": statistics.median(r["frames_per_s"] for r in on),
        "first_frame_ms_p50": best["first_frame_ms_p50"], "first_audio_ms_p50": s.first_audio_ms_p50, "first_audio_ms_p95": s.first_audio_ms_p95,
        "decoder_rtf": s.decoder_rtf, "stream_rtf_p50": s.stream_rtf_p50, "audio_seconds": s.audio_seconds,
        "until_last_audio_s": best["until_last_audio_s"], "engine_s_on": best["engine_s"],
        "decode_calls": s.decode_calls, "windows": s.windows, "audio_errors": s.errors,
    }
    result["ratio"] = result["frames_per_s_on"] / result["frames_per_s_off"]
    out(f"audio bench {model}: {requests} requests, {max_slots} slots: engine {result['frames_per_s_off']:.1f} "
        f"frames/s audio off, {result['frames_per_s_on']:.1f} audio on (x{result['ratio']:.3f}); first frame p50 "
        f"{best['first_frame_ms_p50']:.1f} ms; first audio p50 "
        f"{s.first_audio_ms_p50:.1f} ms, p95 {s.first_audio_ms_p95:.1f} ms; RTF decoder {s.decoder_rtf:.4f}, "
        f"arrival-to-last-sample p50 {s.stream_rtf_p50:.3f}; {s.windows} windows in {s.decode_calls} calls")
    return result


def markdown_rows(results: Sequence[dict]) -> str:
    """A table of bench_audio results, one row per model."""
    lines = ["| model | frames/s audio off | frames/s audio on | on / off | first audio p50 / p95 (ms) | "
             "decoder RTF | arrival-to-last-sample RTF p50 |", "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['model']} | {r['frames_per_s_off']:.1f} | {r['frames_per_s_on']:.1f} | {r['ratio']:.3f} | "
                     f"{r['first_audio_ms_p50']:.1f} / {r['first_audio_ms_p95']:.1f} | {r['decoder_rtf']:.4f} | "
                     f"{r['stream_rtf_p50']:.3f} |")
    return "\n".join(lines)


def _log_to_stderr(logger: logging.Logger) -> None:
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtp_fsm.bench.audio", description=__doc__)
    parser.add_argument("--models", nargs="+", default=list(AUDIO_MODELS))
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-slots", type=int, default=16)
    parser.add_argument("--max-frames", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--worker-nice", type=int, default=None, help="the decoder thread's nice increment (Linux)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    _log_to_stderr(logging.getLogger("mtp_fsm"))
    results = [bench_audio(m, requests=args.requests, max_slots=args.max_slots, max_frames=args.max_frames,
                           repeats=args.repeats, threads=args.threads, worker_nice=args.worker_nice)
               for m in args.models]
    log.info("%s", markdown_rows(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
