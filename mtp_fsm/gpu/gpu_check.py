"""GPU checks of the Triton backend: `python -m mtp_fsm.gpu.gpu_check`.

On a CUDA machine:
1. parity: one schedule (chunked prefill, EOS, NaN aborts, preempt + resume, abort,
   overrun) through kernels="torch" and kernels="triton", ScriptedTalker float32 and the
   tiny Qwen3-TTS when `models.qwen3_tts` is importable: identical frames, finish reasons
   and slot tables after every step;
2. CUDA graphs: the engine's own decode graphs (`decode_graphs="cuda"`: the whole device
   step captured per padded batch bucket over engine-owned buffers, replayed) against a
   twin engine with decode_graphs="off": same frames and endings after every step, live
   slots equal (integer columns bit for bit, floats to rounding), no capture refused;
3. no host sync: admission, prefill, decode, preempt/resume and abort steps run their
   device stages under torch.cuda.set_sync_debug_mode("error");
4. launches per decode step, counted with torch.profiler at batch 1, 64 and 256 (must be
   constant for the FSM stages);
5. timing: the whole engine.step with decode graphs off and on.
Then one summary table. Without CUDA it says so and exits 0 (2 with --require-gpu).
--cpu-dry-run runs checks 1 and 2 (decode_graphs="eager": the padded buckets, no capture) on
the CPU under the Triton interpreter, to exercise this script's own logic.

Plans, twin comparisons and launch labels are in step_harness.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections import Counter

import torch

from .step_harness import (
    Labeled, admitted_engine, decode_plan, label_model, live_slots_differ, lockstep_plans, outputs_equal,
    qwen, qwen_requests, scripted, scripted_requests, step_with, tables_equal,
)

RESULTS: list[tuple[str, str, str]] = []
DEFAULT_BUCKETS = (1, 8, 64, 256)


def record(check: str, ok: bool | None, detail: str) -> None:
    status = "INFO" if ok is None else ("PASS" if ok else "FAIL")
    RESULTS.append((check, status, detail))
    print(f"[{status}] {check}: {detail}", flush=True)


def guarded(check: str):
    def wrap(fn):
        def run(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # a check that crashes is a failed check, the others still run
                traceback.print_exc()
                record(check, False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
        return run
    return wrap


# -- 1. parity --------------------------------------------------------------------------------


def run_parity(name: str, make_model, requests, device, slots: int = 3, max_steps: int = 80) -> None:
    from ..engine import LockstepEngine

    # Kernel parity, eager: the decode graphs have their own check (section 2).
    engines = [LockstepEngine(make_model(), slots, device=device, kernels=k, decode_graphs="off")
               for k in ("torch", "triton")]
    pending, state, frames, steps = list(requests), {}, 0, 0
    for steps in range(1, max_steps + 1):
        plan, done = lockstep_plans(engines[0], pending, state)
        if done:
            break
        outs = [e.step(plan) for e in engines]
        frames += len(outs[0].frames)
        diff = tables_equal(engines[0].table, engines[1].table)
        if not outputs_equal(*outs) or diff:
            record(f"parity {name}", False, f"step {steps}: outputs equal={outputs_equal(*outs)}, columns differing={diff}")
            return
    record(f"parity {name}", True, f"{steps} steps, {frames} frames, identical outputs and slot tables")


# -- 2. padded buckets and CUDA graphs -------------------------------------------------------------


def run_graphs(name: str, make, make_requests, buckets, device, steps: int, timing: dict | None,
               mode: str = "cuda") -> None:
    for bucket in buckets:
        label = f"{'graph replay == eager' if mode == 'cuda' else 'padded bucket == engine.step'} {name} b={bucket}"
        guarded(label)(graph_bucket)(label, make, make_requests, bucket, device, steps, timing, mode)


def graph_bucket(label, make, make_requests, bucket, device, steps, timing, mode) -> None:
    """Twin engines, same plans: decode_graphs="off" vs the engine's own padded bucket
    (captured and replayed in mode "cuda", eager over the same buffers in mode "eager")."""
    rows = max(1, bucket - (bucket > 1))  # leave one padding row in the bucket when possible
    eager = admitted_engine(make, rows, device, make_requests=make_requests, decode_graphs="off")
    graphed = admitted_engine(make, rows, device, make_requests=make_requests, decode_graphs=mode,
                              graph_buckets=(bucket,))
    for i in range(steps):
        plan = decode_plan(eager)
        if not plan.rows:
            break
        out_a, out_b = eager.step(plan), graphed.step(plan)
        diff = live_slots_differ(eager, graphed)
        if not outputs_equal(out_a, out_b) or diff:
            record(label, False, f"step {i}: outputs equal={outputs_equal(out_a, out_b)}, columns differing={diff}")
            return
    g = graphed.graphs
    record(label, g.replays > 0 and not g.refused,
           f"{g.replays} decode steps of {rows} rows through the bucket, outputs and live slots equal"
           + (f"; capture refused: {g.refused}" if g.refused else ""))
    if mode == "cuda" and timing is not None:
        timing[bucket] = time_bucket(make, rows, bucket, device)


def time_bucket(make, rows: int, bucket: int, device, iters: int = 20) -> dict:
    """ms per whole decode step (engine.step: staging, device stages, the copy, outputs)
    with decode_graphs off and with the step replayed as a CUDA graph."""
    out = {}
    for mode in ("off", "cuda"):
        engine = admitted_engine(make, rows, device, max_frames=10 * iters, decode_graphs=mode,
                                 graph_buckets=(bucket,))
        engine.step(decode_plan(engine))  # a graph's capture happens here, untimed
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            engine.step(decode_plan(engine))
        out[mode] = (time.perf_counter() - t) / iters * 1e3
    return out


@guarded("graph capture, torch backend")
def try_reference_capture(device) -> None:
    from ..engine import LockstepEngine
    from ..errors import KernelBackendError

    try:
        LockstepEngine(scripted(device), 2, device=device, kernels="torch", decode_graphs="cuda")
    except KernelBackendError as exc:
        record("graph capture, torch backend", True, f"refused by name: {str(exc)[:120]}")
        return
    record("graph capture, torch backend", False, "decode_graphs='cuda' with the torch stages was accepted")


# -- 3. host syncs ----------------------------------------------------------------------------------


def run_sync_check(name: str, make_model, requests, device, kernels: str, slots: int = 3, expect: bool | None = True,
                   graphs: str = "off"):
    """Every step's device phase under sync_debug_mode("error"); with graphs="cuda" a decode
    step that captures a new bucket runs outside it (one-time setup), every replay inside."""
    from ..engine import LockstepEngine
    from ..sampling.noise import gumbel_table
    from ..sampling.topp import fixed_tables

    gumbel_table(device), fixed_tables(device)  # cached tables: their one-time upload is not a step's sync
    engine = LockstepEngine(make_model(), slots, device=device, kernels=kernels, decode_graphs=graphs)
    pending, state, steps = list(requests), {}, 0
    label = f"no host sync {name} [{kernels}{', graphs' if graphs == 'cuda' else ''}]"

    def no_sync(phase, arg):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return phase(arg)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    def run_device(host):
        g = engine.graphs
        if g is not None and g.eligible(host) and g.key(host.batch) not in g.steps:
            return engine.run_device(host)
        return no_sync(engine.run_device, host)

    def stage(plan):  # host staging too: admissions upload through pinned memory, nothing comes back
        return no_sync(engine.stage, plan)

    try:
        for steps in range(1, 80):
            plan, done = lockstep_plans(engine, pending, state)
            if done:
                break
            step_with(engine, plan, run_device, stage)
    except Exception as exc:
        where = "".join(traceback.format_exception(exc)[-4:-1]).strip().splitlines()
        record(label, False if expect else None,
               f"step {steps}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]} at {where[0].strip()[:120] if where else '?'}")
        return
    replays = "" if engine.graphs is None else f", {engine.graphs.replays} through decode buckets"
    record(label, True if expect else None,
           f"{steps} steps (admit, prefill, decode, preempt/resume, abort{replays}), staging and device phases "
           "under sync_debug_mode('error')")


# -- 4. launches --------------------------------------------------------------------------------------


def _triton_kernel_names() -> frozenset[str]:
    from ..kernels import triton_kernels

    return frozenset(name for module in triton_kernels.STAGE_MODULES for name in vars(module) if name.endswith("_kernel"))


def count_launches(engine) -> Counter:
    """Kernel launches of one decode step's device stages, by innermost stage/model label.

    Torch kernels are attached to the op (and so the label) that launched them; Triton
    launches carry no such link in the profiler, so they are counted by kernel name as
    `stage:triton <name>` (every Triton kernel is an FSM stage's)."""
    from torch.profiler import ProfilerActivity, profile

    host = engine.stage(decode_plan(engine))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        packed = engine.run_device(host)
        torch.cuda.synchronize()
    engine.finish(host, packed)
    events = list(prof.events())
    counts: Counter = Counter()
    for evt in events:  # kernels (and memsets / copies) are attached to the innermost torch op or range
        kernels = getattr(evt, "kernels", None) or []
        if not kernels:
            continue
        label, parent = "other (engine glue)", evt
        while parent is not None:
            if parent.name.startswith(("stage:", "model:")):
                label = parent.name
                break
            parent = parent.cpu_parent
        counts[label] += len(kernels)
    triton = _triton_kernel_names()
    device = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")
              and not e.name.startswith(("stage:", "model:"))]  # not the GPU side of the label ranges
    for evt in device:
        if evt.name in triton:
            counts[f"stage:triton {evt.name}"] += 1
    on_device = len(device)
    if on_device > sum(counts.values()):  # launched outside any torch op / range (e.g. no linked correlation)
        counts["unattributed device activities"] = on_device - sum(counts.values())
    return counts


@guarded("launch counts")
def run_launch_counts(sizes, device) -> None:
    table = {}
    def labeled_model():
        model = scripted(device)
        label_model(model)  # before the engine binds its entry points (text_step runs inside compose_inputs)
        return model

    for rows in sizes:
        engine = admitted_engine(labeled_model, rows, device)
        engine.kernels = Labeled(engine.kernels)
        engine.step(decode_plan(engine))  # warm: every variant compiled
        table[rows] = count_launches(engine)
    labels = sorted(set().union(*table.values()))
    print("\nkernel launches per decode step (device stages)")
    print(f"{'label':34s}" + "".join(f"{f'b={r}':>8s}" for r in sizes))
    for label in labels:
        print(f"{label:34s}" + "".join(f"{table[r].get(label, 0):8d}" for r in sizes))
    fsm = {r: sum(v for k, v in table[r].items() if k.startswith("stage:")) for r in sizes}
    total = {r: sum(table[r].values()) for r in sizes}
    print(f"{'FSM stages total':34s}" + "".join(f"{fsm[r]:8d}" for r in sizes))
    print(f"{'all':34s}" + "".join(f"{total[r]:8d}" for r in sizes) + "\n")
    record("launches constant (FSM stages)", len(set(fsm.values())) == 1 and fsm[sizes[0]] > 0,
           ", ".join(f"b={r}: {fsm[r]}" for r in sizes))
    # The model's own kernels may legitimately change with the batch (cuBLAS picks gemv for one
    # row, gemm + split-K for many; torch picks gather kernels by size): reported, not judged.
    record("launches (whole step)", None,
           ", ".join(f"b={r}: {total[r]}" for r in sizes) + " (model kernels included)")


# -- main ------------------------------------------------------------------------------------------


def summary(timing: dict) -> int:
    width = max(len(c) for c, _, _ in RESULTS) if RESULTS else 10
    print("\n" + "=" * 100)
    print(f"{'check':{width}s}  status  detail")
    for check, status, detail in RESULTS:
        print(f"{check:{width}s}  {status:6s}  {detail}")
    if timing:
        print(f"\n{'bucket':>8s} {'engine.step ms, eager':>22s} {'engine.step ms, graphs':>23s} {'speedup':>8s}")
        for bucket, t in timing.items():
            print(f"{bucket:8d} {t['off']:22.3f} {t['cuda']:23.3f} {t['off'] / max(t['cuda'], 1e-9):7.1f}x")
    failed = [c for c, s, _ in RESULTS if s == "FAIL"]
    print("=" * 100)
    print(f"{len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtp_fsm.gpu.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--require-gpu", action="store_true", help="exit 2 when no CUDA device is present")
    parser.add_argument("--buckets", default=",".join(map(str, DEFAULT_BUCKETS)), help="padded batch buckets")
    parser.add_argument("--steps", type=int, default=6, help="decode steps per bucket")
    parser.add_argument("--no-qwen", action="store_true", help="skip the tiny Qwen3-TTS checks")
    parser.add_argument("--cpu-dry-run", action="store_true", help="CPU + Triton interpreter: parity and padded buckets")
    args = parser.parse_args(argv)
    buckets = tuple(int(b) for b in args.buckets.split(","))
    if args.cpu_dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here; nothing to check (the CPU path is covered by `pytest tests/kernels`, "
                  "which runs the Triton kernels under TRITON_INTERPRET=1).")
            return 2 if args.require_gpu else 0
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            print("gpu_check: unset TRITON_INTERPRET to run the compiled Triton kernels on the GPU")
            return 2
        device = torch.device("cuda")
    try:
        from ..kernels import triton_kernels
    except ImportError as exc:
        print(f"gpu_check: the Triton backend cannot be imported: {exc}")
        return 2 if (args.require_gpu or args.cpu_dry_run) else 0
    problem = triton_kernels.unsupported(device)
    if problem:
        print(f"gpu_check: {problem}")
        return 2
    print(f"gpu_check on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (interpreter)'}; "
          f"torch {torch.__version__}", flush=True)
    timing: dict = {}
    q = None if args.no_qwen else qwen(device)

    guarded("parity scripted")(run_parity)("scripted float32", lambda: scripted(device),
                                           scripted_requests(6 if args.cpu_dry_run else 12), device)
    if q is not None:
        guarded("parity qwen3_tts")(run_parity)("qwen3_tts tiny float32", lambda: qwen(device)[0],
                                               qwen_requests(q[1], 3), device, 2)
    else:
        record("parity qwen3_tts", None, "skipped (--no-qwen)" if args.no_qwen else "models.qwen3_tts not importable: skipped")
    small = tuple(b for b in buckets if b <= 8)
    qwen_reqs = None if q is None else (lambda n: qwen_requests(q[1], n))
    if args.cpu_dry_run:
        run_graphs("scripted", lambda: scripted(device), None, small, device, args.steps, None, mode="eager")
        return summary(timing)
    run_graphs("scripted", lambda: scripted(device), None, buckets, device, args.steps, timing)
    if q is not None:
        run_graphs("qwen3_tts", lambda: qwen(device)[0], qwen_reqs, small, device, args.steps, None)
    guarded("no host sync")(run_sync_check)("scripted", lambda: scripted(device), scripted_requests(8), device, "triton")
    guarded("no host sync, graphs")(run_sync_check)("scripted", lambda: scripted(device), scripted_requests(8), device,
                                                    "triton", graphs="cuda")
    guarded("no host sync")(run_sync_check)("scripted", lambda: scripted(device), scripted_requests(8), device, "torch",
                                            expect=None)
    if q is not None:
        guarded("no host sync qwen")(run_sync_check)("qwen3_tts", lambda: qwen(device)[0], qwen_requests(q[1], 3), device,
                                                     "triton", 2)
    run_launch_counts(tuple(s for s in (1, 64, 256) if s <= max(buckets)) or (1,), device)
    try_reference_capture(device)  # last: a failed capture is reported, then nothing else runs on this context
    return summary(timing)


if __name__ == "__main__":
    sys.exit(main())
