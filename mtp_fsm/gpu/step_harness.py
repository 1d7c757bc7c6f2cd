"""Step harness for the GPU checks: models and requests, lockstep plans, twin-engine
comparisons and labels for launch counting.

Drives the engine through its public step phases: `engine.stage(plan) -> HostStep`,
`engine.run_device(host) -> packed`, `engine.finish(host, packed) -> StepOutput`. The
padded decode buckets and their CUDA graphs are the engine's own (`decode_graphs`).
"""

from __future__ import annotations

import importlib
import importlib.util

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


def step_with(engine, plan, device_phase=None, stage_phase=None):
    """LockstepEngine.step through its public phases, `device_phase(host) -> packed` and
    `stage_phase(plan) -> host` standing in for engine.run_device / engine.stage when given
    (e.g. wrapped in a sync check)."""
    host = stage_phase(plan) if stage_phase else engine.stage(plan)
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


def live_slots_differ(a, b) -> list[str]:
    """Columns whose values differ between two engines' live slots: integer columns bit for
    bit, float columns beyond rounding (a matmul over a padded batch may round differently);
    free and ended slots may hold values no edge reads (an overrun token's hidden state)."""
    state = a.table.state[: a.max_slots]
    live = torch.tensor(sorted(int(s) for s in a.ledger.live_states), dtype=state.dtype, device=state.device)
    held = torch.nonzero(torch.isin(state, live)).flatten()
    differ = []
    for name, column in a.table.columns().items():
        mine, theirs = column[held], b.table.columns()[name][held]
        if column.is_floating_point():
            same = torch.allclose(theirs.float(), mine.float(), rtol=1e-5, atol=1e-6, equal_nan=True)
        else:
            same = torch.equal(mine, theirs)
        if not same:
            differ.append(name)
    return differ


def decode_plan(engine):
    from ..engine import StepPlan
    from ..testing.runs import next_rows

    return StepPlan(rows=next_rows(engine, chunk=1 << 30))


def admitted_engine(make_model, rows: int, device, kernels="triton", max_frames: int = 120, make_requests=None,
                    **engine_kwargs):
    """An engine with `rows` requests admitted and prefilled (next step: pure decode);
    decode graphs off unless engine_kwargs say otherwise (launch counts are of eager steps)."""
    from ..engine import LockstepEngine, StepPlan
    from ..testing.runs import next_rows

    engine_kwargs.setdefault("decode_graphs", "off")
    engine = LockstepEngine(make_model(), rows, device=device, kernels=kernels, **engine_kwargs)
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
                sample, fault_words = out

                def labeled_sample(*a, **k):
                    with torch.profiler.record_function("stage:mtp_sample"):
                        return sample(*a, **k)

                return labeled_sample, fault_words
            return out

        return call


def label_model(model) -> None:
    for name in ("forward", "cb0_logits", "mtp", "frame_embed", "text_step", "reset_slots"):
        fn = getattr(model, name)

        def call(*args, _fn=fn, _name=name, **kwargs):
            with torch.profiler.record_function(f"model:{_name}"):
                return _fn(*args, **kwargs)

        setattr(model, name, call)
