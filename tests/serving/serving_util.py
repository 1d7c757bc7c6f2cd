"""Shared helpers for the serving tests: scripted engines, requests, a manual driver."""

from __future__ import annotations

from mtp_fsm.engine import LockstepEngine, NewRequest
from mtp_fsm.sampling import SamplingParams
from mtp_fsm.serving import InMemorySink, Scheduler, ServingLoop
from mtp_fsm.testing import ScriptedTalker, ScriptInputs


def engine(max_slots: int = 4, **talker_kwargs) -> LockstepEngine:
    return LockstepEngine(ScriptedTalker(**talker_kwargs), max_slots)


def request(rid: str, prompt_len: int = 5, *, eos_at: int | None = None, max_frames: int = 6, seed: int = 0,
            **kwargs) -> NewRequest:
    prompt = tuple((7 * i + len(rid)) % 97 for i in range(prompt_len))
    return NewRequest(rid, ScriptInputs(prompt=prompt, eos_at=eos_at), max_frames=max_frames, seed=seed, **kwargs)


def loop(max_slots=4, token_budget=64, prefill_chunk=8, preempt_after_steps=None, engine_slots=None, sinks=None,
         clock=None):
    eng = engine(engine_slots or max_slots)
    sched = Scheduler(max_slots, token_budget, prefill_chunk, preempt_after_steps=preempt_after_steps)
    sink = InMemorySink()
    kwargs = {} if clock is None else {"clock": clock}
    return ServingLoop(eng, sched, sinks=(sink, *(sinks or ())), **kwargs), sink


def check_bookkeeping(serving: ServingLoop) -> None:
    """The scheduler's host bookkeeping agrees with the engine's ledger for every slot holder."""
    ledger = serving.engine.ledger
    for rid, record in ledger.records.items():
        ledger.sync(record)
        if record.slot is None or serving.scheduler.phase(rid) != "running":
            continue
        computed, target, frames = serving.scheduler.progress(rid)
        # The ledger counts decode positions in num_computed too; the scheduler only the prompt.
        assert (min(record.num_computed, record.prompt_len), record.prompt_len, record.num_frames) == (
            computed, target, frames
        ), rid


class FakeClock:
    """Deterministic clock: every reading advances one millisecond."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-3
        return self.now


GREEDY = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
