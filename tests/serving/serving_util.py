"""Shared helpers for the serving tests: scripted engines, requests, a manual driver."""

from __future__ import annotations

from mtp_fsm.engine import LockstepEngine, NewRequest, SchedulingPolicy
from mtp_fsm.lifecycle import State
from mtp_fsm.serving import InMemorySink, ServingLoop
from mtp_fsm.testing import ScriptedTalker, ScriptInputs


def engine(max_slots: int = 4, *, token_budget: int = 64, prefill_chunk: int = 8,
           preempt_after_steps: int | None = None, **talker_kwargs) -> LockstepEngine:
    policy = SchedulingPolicy(token_budget, prefill_chunk, preempt_after_steps)
    return LockstepEngine(ScriptedTalker(**talker_kwargs), max_slots, policy=policy)


def request(rid: str, prompt_len: int = 5, *, eos_at: int | None = None, max_frames: int = 6, seed: int = 0,
            **kwargs) -> NewRequest:
    prompt = tuple((7 * i + len(rid)) % 97 for i in range(prompt_len))
    return NewRequest(rid, ScriptInputs(prompt=prompt, eos_at=eos_at), max_frames=max_frames, seed=seed, **kwargs)


def loop(max_slots=4, token_budget=64, prefill_chunk=8, preempt_after_steps=None, sinks=None, clock=None,
         metrics=None):
    eng = engine(max_slots, token_budget=token_budget, prefill_chunk=prefill_chunk,
                 preempt_after_steps=preempt_after_steps)
    sink = InMemorySink()
    kwargs = {} if clock is None else {"clock": clock}
    if metrics is not None:
        kwargs["metrics"] = metrics
    return ServingLoop(eng, sinks=(sink, *(sinks or ())), **kwargs), sink


def check_bookkeeping(serving: ServingLoop) -> None:
    """Between steps, the one host record per request (what the scheduler plans from) is
    consistent in itself and, for slot holders, with the device's slot row."""
    eng = serving.engine
    ledger, table = eng.ledger, eng.table
    owned: dict[int, str] = {}
    preempted = 0
    for rid, record in ledger.all_records():
        base = int(record.prepared.prompt_embeds.shape[0])  # the prompt without replayed frames
        what = repr(record)
        if rid in ledger.queued:
            assert rid not in ledger.records, what
            assert (record.state, record.slot, record.serial, record.num_computed, record.num_frames) == (
                State.FREE, None, 0, 0, 0), what
            assert record.prompt_len == base, what
            continue
        if record.state is State.PREEMPTED:
            preempted += 1
            assert record.slot is None and record.serial == 0, what
            assert record.replay_codes is not None and len(record.replay_codes) == record.num_frames, what
            continue
        # Every other held request owns a slot, until the release (or abort) that ends it.
        assert record.state is not State.FREE and record.slot is not None and record.serial > 0, what
        assert record.slot not in owned, f"slot {record.slot} owned by {owned[record.slot]!r} and {rid!r}"
        owned[record.slot] = rid
        row = {name: int(getattr(table, name)[record.slot])
               for name in ("state", "serial", "prompt_len", "num_computed", "num_frames")}
        host = {"state": int(record.state), "serial": record.serial, "prompt_len": record.prompt_len,
                "num_computed": record.num_computed, "num_frames": record.num_frames}
        assert row == host, f"{what}: device row {row}"
        if record.state in ledger.live_states:
            # prompt_len is the prompt plus the frames replayed by the last resume (none if never preempted)
            replayed = record.prompt_len - base
            assert replayed >= 0, what
            if record.in_prefill:
                assert record.num_frames == replayed, what  # no frame before the prompt is done
            else:  # one frame from the step that completed the prompt, then one per decode position
                assert record.num_frames == replayed + record.num_computed - record.prompt_len + 1, what
    assert ledger.allocator.in_use() == frozenset(owned), (sorted(ledger.allocator.in_use()), owned)
    assert ledger.allocator.num_free + len(owned) == eng.max_slots
    assert eng.scheduler.num_preempted == preempted


class FakeClock:
    """Deterministic clock: every reading advances one millisecond."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-3
        return self.now

