"""Real-size Qwen3-TTS talker through the engine (issue 27): step split and the bandwidth floor measured in the same run.

`config_0_6b(max_context=512)` with random weights (fp32; bf16 where the CPU has avx512_bf16),
`LockstepEngine(kernels="torch")`, B = 1, 8, 32 requests all decoding, one torch thread.
Per batch: ms per step (the step thread's CPU time), per frame, and the split, from the
engine's stage hooks (bench/instrument.py): backbone (forward, cb0_logits, text_step,
frame_embed), code predictor (the MTP hook minus the sampler calls inside it), MTP sampler,
engine (the rest: CB0 sampling and the lifecycle). The floor is the bytes a step must read
(every weight a decode step touches, once per use: the code predictor's layers 15 times,
plus the KV blocks its rows hold) over the bandwidth of a streaming read (a sum over 256 MiB)
timed on the same thread just before each step, so load from other processes weighs on the
step and its floor alike; the 1 GiB sum and MKL gemv of the run are recorded too. The model package is resolved at run
time (mtp_fsm never imports models statically). `python -m mtp_fsm.bench.real_size` runs
this section alone and merges it into benchmarks/results.json under `real_size`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import sys
import time
from collections import defaultdict
from typing import Callable

import torch
from torch.utils import benchmark

from .._util.stats import percentile
from .instrument import instrument_engine
from .model_step import bench_texts
from .timing import summary_ms

BATCHES = (1, 8, 32)
MAX_CONTEXT = 512
TEXT_CHARS = 40
STREAM_BYTES = 1 << 30
PROBE_BYTES = 1 << 28  # larger than any cache here; ~8 ms a read
BACKBONE_HOOKS = ("model:forward", "model:cb0_logits", "model:text_step", "model:frame_embed")
README_BEGIN, README_END = "<!-- real-size:begin -->", "<!-- real-size:end -->"


def stream_bandwidth(nbytes: int = STREAM_BYTES, runs: int = 5) -> dict:
    """GB/s of a streaming read on this thread: a sum over `nbytes` of fp32, and a gemv whose
    matrix is `nbytes` (the kernel class of a B=1 linear layer); medians of `runs`."""
    out = {}
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    w = x.view(-1, 4096)
    v = torch.ones(4096, dtype=torch.float32)
    for name, stmt in (("sum", "x.sum()"), ("gemv", "torch.mv(w, v)")):
        timer = benchmark.Timer(stmt, globals={"x": x, "w": w, "v": v, "torch": torch}, timer=time.thread_time)
        seconds = timer.timeit(runs).median
        out[f"{name}_gbps"] = nbytes / seconds / 1e9
    return out


class BandwidthProbe:
    """GB/s of a streaming sum over PROBE_BYTES, timed on this thread right before each step: the
    floor of that step uses it, so load from other processes hits the step and its floor alike."""

    def __init__(self, nbytes: int = PROBE_BYTES) -> None:
        self._x = torch.ones(nbytes // 4, dtype=torch.float32)

    def __call__(self) -> float:
        t0 = time.thread_time()
        self._x.sum()
        return self._x.numel() * 4 / max(time.thread_time() - t0, 1e-9) / 1e9


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def weight_bytes_per_step(model) -> dict:
    """Bytes of weights one decode step reads, by part: the backbone's layers, final norm and
    CB0 head once per step; the code predictor's layers once per depth step (Q - 1: positions
    0 and 1 go together), each of its Q - 1 heads once. Embedding tables are gathered (a few
    rows), the text projection runs at admission only (tts_pad is cached at bind)."""
    talker = model.talker
    size = next(model.module.parameters()).element_size()
    cp = talker.code_predictor
    groups = model.config.num_code_groups
    backbone = _numel(talker.model.layers) + _numel(talker.model.norm) + _numel(talker.codec_head)
    predictor = (groups - 1) * (_numel(cp.model.layers) + _numel(cp.model.norm)
                                + _numel(cp.small_to_mtp_projection)) + _numel(cp.lm_head)
    return {"backbone": backbone * size, "code_predictor": predictor * size,
            "total": (backbone + predictor) * size}


class StageClock:
    """Exclusive thread time per label between enter/leave (nested labels are subtracted from
    their parent), for one step at a time."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[tuple[str, float]] = []

    def enter(self, label: str) -> None:
        now = time.thread_time()
        if self._stack:
            parent, since = self._stack[-1]
            self.totals[parent] += now - since
        self._stack.append((label, now))

    def leave(self, label: str) -> None:
        now = time.thread_time()
        name, since = self._stack.pop()
        self.totals[name] += now - since
        if self._stack:
            self._stack[-1] = (self._stack[-1][0], now)

    def take(self) -> dict[str, float]:
        out, self.totals = dict(self.totals), defaultdict(float)
        return out


def _split(stages: dict[str, float], step_s: float) -> dict[str, float]:
    backbone = sum(stages.get(k, 0.0) for k in BACKBONE_HOOKS)
    predictor = stages.get("model:mtp", 0.0)
    sampler = stages.get("kernel:mtp_sample", 0.0)
    return {"backbone": backbone, "code_predictor": predictor, "mtp_sampler": sampler,
            "engine": step_s - backbone - predictor - sampler}


@contextlib.contextmanager
def _timed_mtp(model, clock: StageClock):
    """The MTP hook and the sampler calls inside it under their labels (the engine hands the
    sampler from a stage instrument_engine does not wrap). An instance attribute, removed after."""
    hook = model.mtp

    def sampler(sample):
        def timed(*args, **kwargs):
            clock.enter("kernel:mtp_sample")
            try:
                return sample(*args, **kwargs)
            finally:
                clock.leave("kernel:mtp_sample")
        return timed

    def mtp(hidden, cb0, sample):
        clock.enter("model:mtp")
        try:
            return hook(hidden, cb0, sampler(sample))
        finally:
            clock.leave("model:mtp")

    model.mtp = mtp
    try:
        yield
    finally:
        del model.mtp


def _decoding(engine) -> int:
    states = list(engine.requests().values())
    return sum(s == "decoding" for s in states) if all(s == "decoding" for s in states) else -1


def bench_batch(model, inputs_of: Callable[[str], object], batch: int, steps: int, weight_bytes: int,
                probe: BandwidthProbe, log) -> dict:
    """`steps` timed decode steps with `batch` requests decoding on one engine (its own slots);
    a request that ends is replaced and the batch refilled untimed."""
    from ..engine import LockstepEngine, NewRequest, SchedulingPolicy

    policy = SchedulingPolicy(token_budget=max(512, batch * MAX_CONTEXT), prefill_chunk=MAX_CONTEXT)
    engine = LockstepEngine(model, max_slots=batch, kernels="torch", policy=policy)
    texts = bench_texts(batch + steps, TEXT_CHARS)
    issued = 0

    def fill() -> None:
        nonlocal issued
        while len(engine.requests()) < batch:
            engine.add_request(NewRequest(f"r{issued}", inputs_of(texts[issued % len(texts)]),
                                          max_frames=MAX_CONTEXT // 2, seed=1000 + issued))
            issued += 1
        for _ in range(8):
            if _decoding(engine) == batch:
                return
            engine.step()
        raise RuntimeError(f"B={batch}: the requests did not all reach decoding")

    clock = StageClock()
    times, splits, kv, bandwidth = [], [], [], []
    try:
        fill()
        engine.step()  # warm: the first decode step of these shapes
        while len(times) < steps:
            fill()
            pool = model.kv_pool
            kv.append(pool.blocks_in_use * pool.allocated_bytes() // max(pool.capacity, 1))
            bandwidth.append(probe())
            with _timed_mtp(model, clock), instrument_engine(engine, clock.enter, clock.leave):
                clock.take()
                t0 = time.thread_time()
                engine.step()
                dt = time.thread_time() - t0
            times.append(dt)
            splits.append(_split(clock.take(), dt))
        kv_ratio = model.kv_pool.allocated_bytes() / model.kv_pool.slot_layout_bytes()
    finally:
        engine.close()
    med = {k: 1e3 * percentile([s[k] for s in splits], 50) for k in splits[0]}
    step = summary_ms(times)
    floors = [(weight_bytes + b) / (g * 1e9) for b, g in zip(kv, bandwidth)]
    out = {"batch": batch, "step": step, "per_frame_ms": step["median_ms"] / batch, "split_ms": med,
           "kv_bytes_read": int(percentile(kv, 50)), "kv_pool_vs_slot_layout": kv_ratio,
           "probe_gbps": percentile(bandwidth, 50), "floor_ms": 1e3 * percentile(floors, 50),
           # the median of per-step ratios: each step against the bandwidth measured just before it
           "floor_ratio": percentile([t / f for t, f in zip(times, floors)], 50)}
    log(f"  B={batch}: step {step['median_ms']:.1f} ms ({step['p10_ms']:.1f}-{step['p90_ms']:.1f}), "
        f"per frame {out['per_frame_ms']:.1f} ms; " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()))
    return out


def bench_dtype(dtype: torch.dtype, batches, steps: int, bandwidth: dict, log) -> dict:
    from ..serving.model_loader import resolve

    talker_cls = resolve("models.qwen3_tts:Qwen3TTSTalker")
    config = resolve("models.qwen3_tts:config_0_6b")(max_context=MAX_CONTEXT, max_trailing_text=MAX_CONTEXT // 2)
    inputs_cls = resolve("models.qwen3_tts:TTSInputs")
    t0 = time.perf_counter()
    # Byte ids stand in for the real tokenizer (not bundled): valid ids of the 151936-entry vocabulary.
    model = talker_cls(config, seed=0, dtype=dtype, tokenizer=resolve("models.qwen3_tts.prompt:ByteTextTokenizer")())
    log(f" {str(dtype).removeprefix('torch.')}: {model.num_parameters() / 1e6:.0f} M parameters, built in "
        f"{time.perf_counter() - t0:.0f} s")
    weights = weight_bytes_per_step(model)
    rows = {}
    probe = BandwidthProbe()
    for batch in batches:
        row = bench_batch(model, lambda text: inputs_cls(text=text), batch, steps, weights["total"], probe, log)
        # The same bytes over the gemv bandwidth of the run's 1 GiB read (MKL's, what F.linear streamed).
        row["floor_ratio_vs_gemv"] = row["step"]["median_ms"] / (
            1e3 * (weights["total"] + row["kv_bytes_read"]) / (bandwidth["gemv_gbps"] * 1e9))
        rows[str(batch)] = row
    del model
    gc.collect()
    out = {"dtype": str(dtype).removeprefix("torch."), "weight_bytes_per_step": weights, "batches": rows}
    if "1" in rows:
        out["floor_ratio_b1"] = rows["1"]["floor_ratio"]
        if "8" in rows:
            out["per_frame_ratio_b8"] = rows["8"]["per_frame_ms"] / rows["1"]["per_frame_ms"]
    return out


def bf16_supported() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
        return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        return False


def bench_real_size(batches=BATCHES, steps: int = 8, bf16_batches=(1, 8), log=print) -> dict:
    """The `real_size` results: fp32 at `batches` (the targets), bf16 at `bf16_batches` when supported."""
    torch.set_num_threads(1)
    bandwidth = stream_bandwidth()
    log(f" streaming read of 1 GiB: sum {bandwidth['sum_gbps']:.1f} GB/s, gemv (MKL) {bandwidth['gemv_gbps']:.1f} GB/s; "
        f"each step's floor uses a {PROBE_BYTES >> 20} MiB sum timed just before it")
    result = {"max_context": MAX_CONTEXT, "steps": steps, "clock": "cpu", "bandwidth": bandwidth}
    fp32 = bench_dtype(torch.float32, batches, steps, bandwidth, log)
    result.update(fp32=fp32, floor_ratio_b1=fp32.get("floor_ratio_b1"), per_frame_ratio_b8=fp32.get("per_frame_ratio_b8"))
    if bf16_batches and bf16_supported():
        result["bf16"] = bench_dtype(torch.bfloat16, bf16_batches, steps, bandwidth, log)
    result["targets"] = {"floor_ratio_b1 <= 1.5": result["floor_ratio_b1"] is not None and result["floor_ratio_b1"] <= 1.5,
                         "per_frame_ratio_b8 <= 0.35": result["per_frame_ratio_b8"] is not None
                         and result["per_frame_ratio_b8"] <= 0.35}
    return result


def real_size_table(res: dict) -> str:
    bw = res["bandwidth"]
    lines = [f"Real-size Qwen3-TTS talker (`config_0_6b(max_context={res['max_context']})`, random weights, "
             f"`LockstepEngine(kernels=\"torch\")`, 1 thread, all B requests decoding; median of {res['steps']} steps, "
             f"step thread CPU time). Floor = bytes a step reads (every weight it touches, the code predictor's layers "
             f"15 times, plus its KV blocks) / a streaming read (a sum over {PROBE_BYTES >> 20} MiB) timed on the same "
             f"thread just before that step; step / floor is the median of the per-step ratios. Last column: the same "
             f"bytes over the run's 1 GiB MKL gemv ({bw['gemv_gbps']:.1f} GB/s; its 1 GiB sum: {bw['sum_gbps']:.1f}).", "",
             "| dtype | B | step ms | per frame ms | backbone | code predictor | MTP sampler | engine | probe GB/s | "
             "floor ms | step / floor | step / gemv floor |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key in ("fp32", "bf16"):
        part = res.get(key)
        if not part:
            continue
        for b, row in part["batches"].items():
            s = row["split_ms"]
            lines.append(f"| {part['dtype']} | {b} | {row['step']['median_ms']:.1f} | {row['per_frame_ms']:.1f} | "
                         f"{s['backbone']:.1f} | {s['code_predictor']:.1f} | {s['mtp_sampler']:.1f} | {s['engine']:.1f} | "
                         f"{row['probe_gbps']:.1f} | {row['floor_ms']:.1f} | {row['floor_ratio']:.2f} | "
                         f"{row['floor_ratio_vs_gemv']:.2f} |")
    met = res["targets"]

    def ratio(key: str, target: str, batch: int) -> str:
        # A run without B=1 or B=8 (--batches) has no such ratio: say so instead of failing.
        value = res[key]
        return f"{key} = not measured (no B={batch} row)" if value is None else (
            f"{key} = {value:.3f} (target {target}: {'met' if met[f'{key} {target}'] else 'missed'})")

    lines += ["", f"- {ratio('floor_ratio_b1', '<= 1.5', 1)}; {ratio('per_frame_ratio_b8', '<= 0.35', 8)}"]
    return "\n".join(lines)


def update_readme(path: str, res: dict) -> bool:
    """Rewrite the README block between the real-size markers; False when they are absent."""
    with open(path) as f:
        text = f.read()
    pattern = re.compile(re.escape(README_BEGIN) + r".*?" + re.escape(README_END), re.S)
    if not pattern.search(text):
        return False
    block = f"{README_BEGIN}\n{real_size_table(res)}\n{README_END}"
    with open(path, "w") as f:
        f.write(pattern.sub(lambda _: block, text))
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtp_fsm.bench.real_size", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results.json", help="merged under the key real_size")
    parser.add_argument("--readme", default="README.md")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batches", type=lambda s: tuple(int(x) for x in s.split(",")), default=BATCHES)
    parser.add_argument("--bf16-batches", type=lambda s: tuple(int(x) for x in s.split(",") if x), default=(1, 8))
    args = parser.parse_args(argv)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    res = bench_real_size(args.batches, args.steps, args.bf16_batches, log=log)
    results = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            results = json.load(f)
    results["real_size"] = res
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, default=str)
    log(real_size_table(res))
    if os.path.exists(args.readme) and update_readme(args.readme, res):
        log(f"updated the real-size table in {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
