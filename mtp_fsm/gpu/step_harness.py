"""Step harness for the GPU checks: models and requests, lockstep plans, padded batch
buckets with persistent StepBatch buffers (captured as CUDA graphs on a GPU), and labels
for launch counting.

Drives the engine through its public step phases: `engine.stage(plan) -> HostStep`,
`engine.run_device(host) -> packed`, `engine.finish(host, packed) -> StepOutput`. The
engine does not yet own static step buffers, so the padded buckets are built here (see
PaddedStep for what the engine would need to own).
"""

from __future__ import annotations

import importlib
import importlib.util
import types

import torch


# -- models and requests ---------------------------------------------------------------------


def scripted(device: torch.device, max_context: int = 160, dtype: torch.dtype = torch.float32):
    """ScriptedTalker with its weights on `device`."""
    from ..testing import ScriptedTalker

    return ScriptedTalker(dtype=dtype, max_context=max_context, device=device)


def qwen(device: torch.device):
    if importlib.util.find_spec("models") is None or importlib.util.find_spec("models.qwen3_tts") is None:
        return None
    mod = importlib.import_module("models.qwen3_tts")
    return mod.Qwen3TTSTalker(mod.tiny_config(), seed=0, dtype=torch.float32, device=device), mod.TTSInputs


def scripted_requests(n: int, *, faults: bool = True, max_frames: int | None = None, tag: str = "r"):
    from ..engine import NewRequest
    from ..sampling import SamplingParams
    from ..testing import ScriptInputs

    out = []
    for i in range(n):
        eos = None if not faults else (5 + i % 7 if i % 5 != 1 else None)
        inputs = ScriptInputs(tuple(range(3 * i, 3 * i + 3 + i % 3)), eos_at=eos,
                              nan_at=3 if faults and i % 9 == 4 else None, mtp_nan_at=2 if faults and i % 9 == 5 else None)
        out.append(NewRequest(
            f"{tag}{i}", inputs, max_frames=max_frames or 6 + i % 5, seed=1000 + 17 * i,
            cb0_sampling=SamplingParams(0.0 if i % 3 == 0 else 0.9, 8 if i % 2 else 0, 0.9 if i % 3 == 2 else 1.0,
                                        (1.0, 1.3, 0.7, None)[i % 4]),  # the CB0 history rules run too
            mtp_sampling=SamplingParams(1.1, 0, 1.0) if i % 2 else SamplingParams(0.8, 5, 0.8),
            min_frames=(None, 2, 0)[i % 3],
        ))
    return out


def qwen_requests(inputs_cls, n: int):
    from ..engine import NewRequest
    from ..sampling import SamplingParams

    return [NewRequest(f"q{i}", inputs_cls(text="hello" + "x" * i), max_frames=10, seed=5 + i,
                       cb0_sampling=SamplingParams(0.9, 50, 0.9), mtp_sampling=SamplingParams(0.8, 0, 1.0))
            for i in range(n)]


# -- one engine step, with the device phase swappable ------------------------------------------


def step_with(engine, plan, device_phase=None):
    """LockstepEngine.step through its public phases, `device_phase(host) -> packed`
    standing in for engine.run_device when given (e.g. wrapped in a sync check)."""
    host = engine.stage(plan)
    packed = device_phase(host) if device_phase else engine.run_device(host)
    return engine.finish(host, packed)


def lockstep_plans(lead, pending: list, state: dict, *, chunk: int = 3, preempt_at=(6, 13), abort_at=(9,)):
    """The next StepPlan for the lead engine (the twins receive the same plans)."""
    from ..engine import Span, StepPlan
    from ..testing.runs import next_rows

    step = state.setdefault("step", 0)
    state["step"] += 1
    preempted, finished = state.setdefault("preempted", []), state.setdefault("finished", set())
    live = [rid for rid, r in lead.ledger.records.items() if r.slot is not None]
    ended = [rid for rid in live if lead.request_state(rid) in lead.ledger.terminal_states]
    preempts = [rid for rid in live if step in preempt_at and rid not in ended][:1]
    aborts = [rid for rid in live if step in abort_at and rid not in ended and rid not in preempts][-1:]
    releases = [rid for rid in ended if rid in finished]  # overrun once, then release
    finished |= set(ended)
    room = lead.num_free_slots + len(releases) + len(preempts) + len(aborts)
    resumes, state["preempted"] = preempted[:room], preempted[room:]
    admit = pending[: room - len(resumes)]
    del pending[: len(admit)]
    state["preempted"] += preempts
    gone = set(preempts) | set(aborts) | set(releases)
    rows = [s for s in next_rows(lead, chunk=chunk) if s.request_id not in gone]
    rows += [Span(rid, 1) for rid in ended if rid not in gone]
    plan = StepPlan(new_requests=tuple(admit), preempts=tuple(preempts), aborts=tuple(aborts),
                    releases=tuple(releases), resumes=tuple(resumes), rows=tuple(rows) + (None,))
    done = not pending and not state["preempted"] and not lead.ledger.records
    return plan, done


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]) if t.is_floating_point() else t


def tables_equal(a, b) -> list[str]:
    """Names of the slot-table columns whose bits differ."""
    return [name for name, col in a.columns().items() if not torch.equal(_bits(col), _bits(b.columns()[name]))]


def outputs_equal(a, b) -> bool:
    return (a.frames.request_ids == b.frames.request_ids and torch.equal(a.frames.codes, b.frames.codes)
            and torch.equal(a.frames.frame_index, b.frames.frame_index) and a.finished == b.finished)


class PaddedStep:
    """Persistent StepBatch buffers for one padded bucket of decode rows (row i <-> token i)
    and, on CUDA, a captured graph of the engine's device stages over them.

    What the engine must own for this to be its normal path: the ledger writes each step's
    rows into pinned host buffers, one H2D copy fills these device buffers, padded rows
    point at the scratch row with is_padding set (and one inert token each)."""

    def __init__(self, engine, bucket: int, filters: tuple[bool, bool]) -> None:
        from ..kernels.contract import StepBatch

        dev, self.engine, self.bucket = engine.device, engine, bucket
        self.scratch = engine.table.max_slots
        arange = torch.arange(bucket, dtype=torch.int64, device=dev)
        self.batch = StepBatch(
            idx_mapping=torch.full((bucket,), self.scratch, dtype=torch.int64, device=dev),
            is_padding=torch.ones(bucket, dtype=torch.bool, device=dev),
            expected_serial=torch.zeros(bucket, dtype=torch.int64, device=dev),
            num_scheduled=torch.zeros(bucket, dtype=torch.int64, device=dev),
            query_start_loc=torch.arange(bucket + 1, dtype=torch.int64, device=dev),
            token_rows=arange.clone(), token_offsets=torch.zeros(bucket, dtype=torch.int64, device=dev),
            last_token=arange.clone(), cb0_filters=filters[0], mtp_filters=filters[1],
        )
        self.host = types.SimpleNamespace(events=None, admits=None, replay=None, batch=self.batch)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None

    def run_eager(self) -> torch.Tensor:
        return self.engine.run_device(self.host)

    def capture(self) -> None:
        """Warm up (compiles every kernel variant) and capture, while every row is padding
        (inert: nothing in the table changes)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.run_eager()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.graph):
            self.out = self.engine.run_device(self.host)

    def load(self, batch) -> int:
        """Copy a decode-only StepBatch (one token per real row) into the bucket buffers."""
        n, b = batch.num_rows, self.batch
        for dst, src, fill in ((b.idx_mapping, batch.idx_mapping, self.scratch), (b.is_padding, batch.is_padding, True),
                               (b.expected_serial, batch.expected_serial, 0), (b.num_scheduled, batch.num_scheduled, 0)):
            dst[:n].copy_(src)
            dst[n:].fill_(fill)
        return n

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


class PaddedEngine:
    """Drives an engine: decode-only steps through a padded bucket (graph replay or eager),
    everything else (admission, events, prefill) through the engine's own stages."""

    def __init__(self, engine, buckets, use_graphs: bool) -> None:
        self.engine, self.buckets, self.use_graphs = engine, sorted(buckets), use_graphs
        self.steppers: dict[tuple, PaddedStep] = {}
        self.padded_steps = 0

    def stepper(self, rows: int, filters) -> PaddedStep | None:
        bucket = next((b for b in self.buckets if b >= rows), None)
        if bucket is None:
            return None
        key = (bucket, *filters)
        if key not in self.steppers:
            ps = PaddedStep(self.engine, bucket, filters)
            if self.use_graphs:
                ps.capture()
            self.steppers[key] = ps
        return self.steppers[key]

    def step(self, plan):
        decode = all(s is None or s.num_tokens == 1 for s in plan.rows)
        host = self.engine.stage(plan)
        if decode and host.events is None and host.admits is None and host.batch.num_tokens:
            ps = self.stepper(host.batch.num_rows, (host.batch.cb0_filters, host.batch.mtp_filters))
            if ps is not None:
                n = ps.load(host.batch)
                out = ps.replay() if self.use_graphs else ps.run_eager()
                self.padded_steps += 1
                return self.engine.finish(host, torch.cat([out[:n], out[-1:]]))
        return self.engine.finish(host, self.engine.run_device(host))


def decode_plan(engine):
    from ..engine import StepPlan
    from ..testing.runs import next_rows

    return StepPlan(rows=next_rows(engine, chunk=1 << 30))


def admitted_engine(make_model, rows: int, device, kernels="triton", max_frames: int = 120, make_requests=None):
    """An engine with `rows` requests admitted and prefilled (next step: pure decode)."""
    from ..engine import LockstepEngine, StepPlan
    from ..testing.runs import next_rows

    engine = LockstepEngine(make_model(), rows, device=device, kernels=kernels)
    reqs = make_requests(rows) if make_requests else scripted_requests(rows, faults=False, max_frames=max_frames)
    engine.step(StepPlan(new_requests=tuple(reqs)))
    while any(r.num_computed < r.prompt_len for r in engine.ledger.records.values()):
        engine.step(StepPlan(rows=next_rows(engine, chunk=1 << 30)))
    return engine


class Labeled:
    """engine.kernels proxy: every stage call runs inside record_function('stage:<name>')."""

    def __init__(self, module) -> None:
        self._module = module

    def __getattr__(self, name):
        fn = getattr(self._module, name)
        if name.startswith("_") or not callable(fn) or isinstance(fn, type):
            return fn

        def call(*args, **kwargs):
            with torch.profiler.record_function(f"stage:{name}"):
                out = fn(*args, **kwargs)
            if name == "mtp_sampler":
                sample, bad = out

                def labeled_sample(*a, **k):
                    with torch.profiler.record_function("stage:mtp_sample"):
                        return sample(*a, **k)

                return labeled_sample, bad
            return out

        return call


def label_model(model) -> None:
    for name in ("forward", "cb0_logits", "mtp", "frame_embed", "text_step", "reset_slots"):
        fn = getattr(model, name)

        def call(*args, _fn=fn, _name=name, **kwargs):
            with torch.profiler.record_function(f"model:{_name}"):
                return _fn(*args, **kwargs)

        setattr(model, name, call)
