"""Soak run: thousands of short requests through ServingLoop + the engine's built-in policy,
with random client aborts (queued and running), explicit preemptions and injected model
faults; checks every request's end and frames against the reference interpreter, and that
memory stays flat.

    python -m mtp_fsm.serving.soak --requests 100000 --model null

`run_soak(SoakConfig(...))` returns a SoakReport (problems found, throughput, memory
samples); the test suite runs a short one, `make soak` a long one.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Callable

import attrs

from .._util.threads import torch_threads
from ..engine import LockstepEngine
from ..engine.plan import FinishedRequest, FrameBatch
from ..engine.scheduler import SchedulingPolicy
from ..lifecycle import FinishReason
from ..sampling import SamplingParams
from ..sampling.params import GREEDY
from .chunking import AudioChunk, ChunkingSink
from .metrics import ServingMetrics
from .runner import ServingLoop
from .sinks import CallbackSink
from .soak_models import MODELS, InjectedFault, faulty_model, reference_factory
from .soak_report import MemorySample, SoakReport, live_tensors, peak_rss_mb, retained_records, rss_mb

_SAMPLING = (GREEDY, SamplingParams(), SamplingParams(0.7, 5, 0.8), SamplingParams(1.3, 0, 0.9), SamplingParams(1.0, 3))


@attrs.frozen
class SoakConfig:
    requests: int = 2000
    model: str = attrs.field(default="scripted", validator=attrs.validators.in_(MODELS))
    max_slots: int = 4
    token_budget: int = 16
    prefill_chunk: int = 3
    preempt_after_steps: int | None = 1  # the policy preempts under queue pressure
    max_frames: int = 6  # each request's budget is drawn from [1, max_frames]
    max_prompt: int = 5  # prompts of [1, max_prompt] positions
    pool: int = 64  # distinct request definitions (each one's reference is computed once)
    queue_depth: int = 6  # requests kept queued: steady pressure, bounded in-flight count
    abort_p: float = 0.08  # per step: a client aborts a random queued or running request
    preempt_p: float = 0.08  # per step: an explicit preemption of a random running request
    fault_p: float = 0.02  # per step: the model raises in forward
    eos_p: float = 0.3  # scripted: share of definitions with a forced EOS (frame 0 included)
    nan_p: float = 0.1  # scripted: share with NaN backbone logits at some frame
    mtp_nan_p: float = 0.1  # scripted: share with NaN MTP logits at some frame
    retention: int = 128  # metrics windows and the chunker's remembered finished ids
    samples: int = 8  # memory samples, at k/samples of the requests finished
    check: bool = True  # compare frames and reasons with the reference interpreter
    seed: int = 0
    max_steps: int | None = None  # safety stop (default: 50 steps per request)


def _definitions(config: SoakConfig, rng: random.Random):
    from ..testing.alone import RequestDef

    defs = []
    for _ in range(config.pool):
        max_frames = rng.randint(1, config.max_frames)
        prompt_len = rng.randint(1, config.max_prompt)
        if config.model == "scripted":
            from ..testing import ScriptInputs

            def at(p: float) -> int | None:
                return rng.randint(0, max_frames - 1) if rng.random() < p else None

            inputs = ScriptInputs(prompt=tuple(rng.randrange(97) for _ in range(prompt_len)),
                                  eos_at=at(config.eos_p), nan_at=at(config.nan_p), mtp_nan_at=at(config.mtp_nan_p))
        else:
            from ..bench.null_model import NullInputs

            inputs = NullInputs(prompt_len)
        defs.append(RequestDef(inputs, max_frames, rng.randrange(2**31), rng.choice(_SAMPLING), rng.choice(_SAMPLING)))
    return defs


class _Checker:
    """A Sink that holds each live request's frames until it ends, then checks them against
    the reference (bounded: nothing is kept for an ended request)."""

    def __init__(self, report: SoakReport, reference: Callable | None) -> None:
        self.report, self.reference = report, reference
        self.live: dict[str, object] = {}  # rid -> RequestDef
        self.frames: dict[str, list[tuple[int, ...]]] = {}
        self.aborting: set[str] = set()
        self.model = None  # the fault-injecting model (soak_models.faulty)
        self.fault_step: int | None = None  # the step running now, and the model's fault count before it
        self.faults_before = 0
        self.ended_count = 0
        self.next_id = 0

    def submitted(self, rid: str, definition) -> None:
        self.live[rid] = definition
        self.frames[rid] = []

    def on_frames(self, step: int, frames: FrameBatch) -> None:
        for rid, index, codes in zip(frames.request_ids, frames.frame_index.tolist(), frames.codes.tolist()):
            got = self.frames.get(rid)
            if got is None:
                self.report.problem(f"step {step}: frame {index} of {rid!r}, which is not live (ended or unknown)")
                continue
            if index != len(got):
                self.report.problem(f"step {step}: {rid!r} published frame {index}, expected {len(got)}")
            got.append(tuple(codes))

    def on_finished(self, step: int, finished: FinishedRequest) -> None:
        rid, reason = finished.request_id, FinishReason(finished.reason)
        definition = self.live.pop(rid, None)
        if definition is None:
            seen = int(rid.rsplit("-", 1)[1]) < self.next_id if rid.startswith("soak-") else False
            what = "a second time" if seen else "but was never submitted"
            self.report.problem(f"step {step}: {rid!r} ended ({reason.label}) {what}")
            return
        self.ended_count += 1
        frames = self.frames.pop(rid)
        aborting = rid in self.aborting
        self.aborting.discard(rid)
        # A step whose forward raised runs no device stage: every error it reports is the fault's.
        by_fault = reason is FinishReason.ERROR and step == self.fault_step and self.model.faults > self.faults_before
        self.report.fault_ended += by_fault
        self.report.by_reason[reason.label] = self.report.by_reason.get(reason.label, 0) + 1
        if reason is FinishReason.NONE:
            self.report.problem(f"step {step}: {rid!r} ended without a reason")
        if finished.num_frames != len(frames):
            self.report.problem(f"step {step}: {rid!r} ended ({reason.label}) reporting {finished.num_frames} frames, "
                                f"{len(frames)} were published")
        if reason is FinishReason.ABORT and not aborting:
            self.report.problem(f"step {step}: {rid!r} aborted, but no client asked")
        if by_fault and InjectedFault.__name__ not in finished.detail:
            self.report.problem(f"step {step}: {rid!r} ended by a model fault, but its detail "
                                f"{finished.detail!r} does not name the exception")
        if self.reference is None:
            return
        ref = self.reference(definition)
        if reason is FinishReason.ABORT or by_fault:  # cut short: a prefix of what it does alone
            if tuple(frames) != ref.frames[: len(frames)] or len(frames) > len(ref.frames):
                self.report.problem(f"{rid!r} ({reason.label} after {len(frames)} frames): frames are not a prefix "
                                    f"of its reference ({len(ref.frames)} frames, {ref.reason.label})")
        elif reason is not ref.reason or tuple(frames) != ref.frames:
            first_bad = next((i for i, (a, b) in enumerate(zip(frames, ref.frames)) if a != b), None)
            self.report.problem(
                f"{rid!r} ended {reason.label} with {len(frames)} frames; alone it ends {ref.reason.label} with "
                f"{len(ref.frames)} (first differing frame: {first_bad}) [{definition}]")
        elif finished.detail != ref.detail:  # an error ending says what the reference says went wrong
            self.report.problem(f"{rid!r} ended {reason.label} with detail {finished.detail!r}; "
                                f"its reference says {ref.detail!r}")
        if not ref.frames and ref.reason is FinishReason.EOS:
            self.report.eos_first += 1


def run_soak(config: SoakConfig, log: Callable[[str], None] | None = None) -> SoakReport:
    """Run the soak (torch single-threaded); problems are reported, never raised."""
    with torch_threads(1):
        return _run(config, log or (lambda _msg: None))


def _run(config: SoakConfig, log: Callable[[str], None]) -> SoakReport:
    from ..testing.references import reference_runs

    rng = random.Random(config.seed)
    report = SoakReport(config)
    defs = _definitions(config, rng)
    reference = None
    if config.check:
        refs = reference_runs(reference_factory(config.model))
        started = time.perf_counter()
        for d in defs:  # before the run: reference work is neither timed nor sampled
            refs.get(d)
        reference = refs.get
        log(f"references for {len(defs)} request definitions in {time.perf_counter() - started:.1f} s")

    model = faulty_model(config.model)
    policy = SchedulingPolicy(config.token_budget, config.prefill_chunk, config.preempt_after_steps)
    engine = LockstepEngine(model, config.max_slots, kernels="torch", policy=policy)
    checker = _Checker(report, reference)
    checker.model = model
    no_audio: set[str] = set()  # live requests whose reference has no frame (EOS first): they must get no audio

    def count_chunk(chunk: AudioChunk) -> None:
        report.audio_chunks += chunk.has_audio

    chunker = ChunkingSink(count_chunk, num_codebooks=engine.spec.frame_width, max_closed=config.retention)
    metrics = ServingMetrics(max_steps=config.retention, max_finished=config.retention)

    def finished_hook(_step: int, finished: FinishedRequest) -> None:
        rid = finished.request_id
        if rid in no_audio:
            no_audio.discard(rid)
            rm = metrics.requests.get(rid)
            if rm is not None and rm.first_chunk_time is not None:
                report.first_audio_of_no_audio += 1
                report.problem(f"{rid!r} produced no frame but has a first-chunk time")

    # The hook runs after the chunker emitted the final chunk (sinks see a finish in order).
    sinks = (CallbackSink(checker.on_frames, checker.on_finished), chunker, CallbackSink(on_finished=finished_hook))
    loop = ServingLoop(engine, sinks=sinks, metrics=metrics)
    max_steps = config.max_steps or 50 * config.requests
    marks = [(k / config.samples, int(config.requests * k / config.samples)) for k in range(1, config.samples + 1)]
    submitted = 0
    started = time.perf_counter()
    sampling_s = 0.0

    def one_step() -> bool:
        """Submit, inject client events and faults, step once; False when the run is over."""
        nonlocal submitted, sampling_s
        while submitted < config.requests and len(engine.ledger.queued) < config.queue_depth:
            rid = f"soak-{submitted}"
            checker.next_id = submitted + 1
            definition = rng.choice(defs)
            checker.submitted(rid, definition)
            if reference is not None and not reference(definition).frames:
                no_audio.add(rid)
            if not loop.submit(definition.new_request(rid)):
                report.problem(f"{rid!r} rejected at submit: {metrics.requests[rid].error}")
            submitted += 1
        if rng.random() < config.abort_p:
            pool = list(engine.ledger.queued) if rng.random() < 0.5 else list(engine.ledger.records)
            if pool:
                rid = rng.choice(pool)
                checker.aborting.add(rid)  # before: a queued request is reported aborted at once
                outcome = loop.abort(rid)
                if outcome == "ignored":
                    checker.aborting.discard(rid)
                else:
                    report.aborts_requested += 1
                    report.aborts_queued += outcome == "dropped"
        if rng.random() < config.preempt_p:
            running = list(engine.ledger.records)
            if running and loop.preempt(rng.choice(running)):
                report.preempts_requested += 1
        if rng.random() < config.fault_p:
            model.arm()
        checker.fault_step, checker.faults_before = engine.step_count, model.faults  # the step about to run
        output = loop.step()
        report.steps += 1
        if output is None:
            if not loop.idle:
                report.problem(f"step {engine.step_count}: nothing to do but the engine is not idle")
            if submitted >= config.requests:
                return False
        while marks and checker.ended_count >= marks[0][1]:
            fraction, _ = marks.pop(0)
            t0 = time.perf_counter()
            report.samples.append(MemorySample(fraction, live_tensors(), retained_records(loop, chunker), rss_mb()))
            sampling_s += time.perf_counter() - t0
            log(f"{fraction:4.0%}: {checker.ended_count} finished, {report.steps} steps, "
                f"{time.perf_counter() - started:.1f} s, tensors {report.samples[-1].tensors}, "
                f"records {report.samples[-1].records}, rss {report.samples[-1].rss_mb:.0f} MB")
        if report.steps >= max_steps:
            report.problem(f"stopped after {report.steps} steps with {len(checker.live)} requests not ended")
            return False
        return submitted < config.requests or not loop.idle

    while True:
        try:
            if not one_step():
                break
        except Exception as exc:  # an engine or sink error: report it (the state after it is not trusted)
            report.problem(f"step {engine.step_count}: {type(exc).__name__}: {exc}")
            break
    report.wall_s = time.perf_counter() - started - sampling_s  # the memory samples are not serving time
    model.armed = False
    report.finished = checker.ended_count
    report.frames = metrics.total_frames
    report.faults = model.faults
    report.preemptions = engine.scheduler.num_preemptions
    report.peak_rss_mb = peak_rss_mb()
    if checker.live:
        report.problem(f"{len(checker.live)} requests never ended, e.g. {sorted(checker.live)[:5]}")
    if not engine.idle or engine.num_free_slots != engine.max_slots:
        held = {rid: repr(r) for rid, r in engine.ledger.all_records()}
        report.problem(f"at the end: idle={engine.idle}, {engine.num_free_slots} of {engine.max_slots} slots free, "
                       f"held {held}")
    if metrics.num_finished != report.finished or metrics.num_submitted != submitted:
        report.problem(f"metrics count {metrics.num_submitted} submitted / {metrics.num_finished} finished, "
                       f"the soak {submitted} / {report.finished}")
    if chunker.retained()["streams"]:
        report.problem(f"the chunker holds {chunker.retained()['streams']} streams after every request ended")
    engine.close()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtp_fsm.serving.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = SoakConfig()
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument("--model", choices=MODELS, default=defaults.model)
    parser.add_argument("--max-slots", type=int, default=defaults.max_slots)
    parser.add_argument("--token-budget", type=int, default=defaults.token_budget)
    parser.add_argument("--prefill-chunk", type=int, default=defaults.prefill_chunk)
    parser.add_argument("--preempt-after", type=int, default=defaults.preempt_after_steps,
                        help="the policy's preempt_after_steps (-1: never preempts by itself)")
    parser.add_argument("--max-frames", type=int, default=defaults.max_frames)
    parser.add_argument("--queue-depth", type=int, default=defaults.queue_depth,
                        help="requests kept queued (steady pressure on the slots)")
    parser.add_argument("--pool", type=int, default=defaults.pool, help="distinct request definitions")
    parser.add_argument("--retention", type=int, default=defaults.retention)
    parser.add_argument("--samples", type=int, default=defaults.samples)
    parser.add_argument("--abort-p", type=float, default=defaults.abort_p, help="per step: chance of a client abort")
    parser.add_argument("--preempt-p", type=float, default=defaults.preempt_p,
                        help="per step: chance of an explicit preemption")
    parser.add_argument("--fault-p", type=float, default=defaults.fault_p, help="per step: chance the model raises")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--no-check", action="store_true", help="skip the comparison with the reference interpreter")
    args = parser.parse_args(argv)
    for name in ("requests", "max_slots", "token_budget", "prefill_chunk", "max_frames", "queue_depth", "pool", "samples"):
        if getattr(args, name) < 1:
            parser.error(f"argument --{name.replace('_', '-')}: must be an integer >= 1")
    if args.retention < 0:
        parser.error("argument --retention: must be an integer >= 0")
    for name in ("abort_p", "preempt_p", "fault_p"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            parser.error(f"argument --{name.replace('_', '-')}: must be a probability in [0, 1]")
    config = SoakConfig(
        requests=args.requests, model=args.model, max_slots=args.max_slots, token_budget=args.token_budget,
        prefill_chunk=args.prefill_chunk, preempt_after_steps=None if args.preempt_after < 0 else args.preempt_after,
        max_frames=args.max_frames, queue_depth=args.queue_depth, pool=args.pool, abort_p=args.abort_p, preempt_p=args.preempt_p,
        fault_p=args.fault_p, retention=args.retention, samples=args.samples, seed=args.seed, check=not args.no_check,
    )
    report = run_soak(config, log=lambda msg: print(msg, flush=True))
    print(report.table())
    flat = report.growth("tensors") <= tensor_slack(config) and report.growth("records") <= record_slack(config)
    if not flat:
        print(f"memory grew: tensors +{report.growth('tensors')} (slack {tensor_slack(config)}), "
              f"records +{report.growth('records')} (slack {record_slack(config)})")
    return 0 if report.num_problems == 0 and flat else 1


def in_flight_bound(config: SoakConfig) -> int:
    """Requests that can be held at once: slots, the queue, and preempted ones waiting to resume."""
    return 2 * config.max_slots + config.queue_depth


def record_slack(config: SoakConfig) -> int:
    """Retained records may move with the in-flight count (each request has a few records)."""
    return 4 * in_flight_bound(config) + 8


def tensor_slack(config: SoakConfig) -> int:
    """Live tensors may move with the in-flight count: a prepared prompt and its columns, the
    frames replayed at resume, the chunker's pending and context frames."""
    return (12 + 2 * config.max_frames) * in_flight_bound(config) + 64


if __name__ == "__main__":
    raise SystemExit(main())
