"""The engine's isolation / determinism properties and its bad-input refusals, for every model of
the zoo (the tiny seeded talkers in `models/`), not only the scripted talker.

Ground truth is each request alone: a fresh one-slot engine over the same model object, whole
prompt in one step, its whole conditioning feed (Qwen3-Omni) given at admission. Properties:

1. batched == alone under the built-in policy (random token budget, prefill chunk, max_slots);
2. explicit StepPlans with shuffled rows, padding rows, random chunks, overrun rows of ended
   requests, late releases and (conditioned models) late feeds give the alone frames;
3. preemption / resume (engine.preempt, the policy's preempt_after_steps, and StepPlan
   preempts / resumes) never change frames;
4. bad plans, bad new requests and bad feeds raise an MtpFsmError naming the request and leave
   the engine (requests, slot table, model state) unchanged; the requests then finish as alone.

Each model is built once per module and shared by every engine of the module (one live engine
at a time: each is closed when its example ends). Examples are few: the module must stay fast.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
from typing import Any, Iterator

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from models.paged_kv import BlockPool
from mtp_fsm._util.threads import torch_threads
from mtp_fsm.engine import FeedError, LockstepEngine, NewRequest, SchedulingPolicy, Span, StepOutput, StepPlan
from mtp_fsm.errors import (
    AdmissionError, DuplicateRequestError, LifecycleError, MtpFsmError, PlanError, SlotTableFullError,
    UnknownRequestError,
)
from mtp_fsm.lifecycle import FinishReason, State
from mtp_fsm.sampling import GREEDY, SamplingParams

MODELS = ("qwen3_tts", "qwen3_omni", "moss_tts_local", "chatterbox", "higgs_audio_v3", "voxcpm2")
MAX_FRAMES = 8
DECODE_STATES = ("decoding", "ramp_up", "wind_down")  # one-token rows (the delay pattern's phases too)
MAX_STEPS = 400  # any drive below that has not finished is a bug (a stall)
# MTP_FSM_ZOO_SCALE=10 runs ten times the examples (a soak; the default keeps the module ~1 min).
SCALE = float(os.environ.get("MTP_FSM_ZOO_SCALE", "1"))
FAST = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                print_blob=True)

# CB0 / MTP sampling: greedy, plain, top-k, top-p, k=1, a vanishing top-p, greedy with filters.
SAMPLING = (
    GREEDY, SamplingParams(), SamplingParams(0.7, 5, 0.9), SamplingParams(1.3, 0, 0.5),
    SamplingParams(1.0, 1, 1.0), SamplingParams(0.9, 0, 1e-6), SamplingParams(0.0, 3, 0.8),
)


def examples(n: int) -> int:
    return max(1, round(n * SCALE))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):  # tiny tensors: thread hand-offs cost far more than the arithmetic
        yield


# -- the zoo --------------------------------------------------------------------------------


@attrs.frozen
class Req:
    """Everything that determines a request's output (hashable: the alone-run cache key)."""

    text: str
    max_frames: int
    seed: int = 0
    cb0: SamplingParams = SamplingParams()
    mtp: SamplingParams = SamplingParams()


@attrs.frozen
class Alone:
    frames: tuple[tuple[int, ...], ...]
    reason: FinishReason


class Zoo:
    """One model of the zoo: its package, the model object every engine of the module shares,
    and the cache of its requests' alone runs."""

    def __init__(self, name: str, package: Any) -> None:
        self.name, self.package = name, package
        self.model = package.tiny_demo_talker(seed=0)
        self.spec = self.model.spec
        self._alone: dict[Req, Alone] = {}

    def new_request(self, rid: str, req: Req, **overrides) -> NewRequest:
        fields = dict(inputs=self.package.text_inputs(req.text), max_frames=req.max_frames, seed=req.seed,
                      cb0_sampling=req.cb0, mtp_sampling=req.mtp)
        return NewRequest(rid, **{**fields, **overrides})

    def late_request(self, rid: str, req: Req, keep: int) -> tuple[NewRequest, torch.Tensor | None]:
        """The same request whose conditioning feed (a model with one) brings only its first
        `keep` rows at admission; returns it and the rows still to come through engine.feed
        (the last of them with done=True). Without a feed: the plain request and None."""
        if not self.spec.has_feed:
            return self.new_request(rid, req), None
        inputs, rest = LATE_FEED[self.name](self, req.text, keep)
        return self.new_request(rid, req, inputs=inputs), rest

    @contextlib.contextmanager
    def engine(self, max_slots: int, policy: SchedulingPolicy | None = None) -> Iterator[LockstepEngine]:
        engine = LockstepEngine(self.model, max_slots, kernels="torch", policy=policy)
        try:
            yield engine
        finally:
            engine.close()  # the model is shared: unbind it whatever happened

    def alone(self, req: Req) -> Alone:
        """The request alone in a fresh one-slot engine, whole prompt in one step (what
        mtp_fsm.testing.alone.run_alone does, on this shared model object; text inputs bring a
        conditioned model's whole feed at admission)."""
        if req not in self._alone:
            whole = SchedulingPolicy(token_budget=self.spec.max_context, prefill_chunk=self.spec.max_context)
            with self.engine(1, whole) as engine:
                request = self.new_request("alone", req)
                engine.add_request(request)
                frames, ended = [], []
                while (out := engine.step()) is not None:
                    assert out.num_tokens in (0, 1) or not frames, "alone: one decode token per step"
                    collect(out, {"alone": frames}, {})
                    ended += out.finished
                assert [f.request_id for f in ended] == ["alone"], f"alone run of {req} ended {ended}"
                assert ended[0].num_frames == len(frames)
            self._alone[req] = Alone(tuple(frames), ended[0].reason)
        return self._alone[req]


def _load(name: str) -> Any:
    try:
        return importlib.import_module(f"models.{name}")
    except Exception as exc:  # a model still in progress elsewhere: skip it, saying why
        pytest.skip(f"models.{name} does not import: {type(exc).__name__}: {exc}")


def _omni_late(zoo: Zoo, text: str, keep: int) -> tuple[Any, torch.Tensor]:
    """Qwen3-Omni: the stand-in thinker's rows of `text` as row inputs, the prompt side and the
    first `keep` conditioning rows at admission (not done), the rest returned for engine.feed."""
    prompt = importlib.import_module("models.qwen3_omni.prompt")
    head, tail = prompt.stand_in_prompt_rows(text, zoo.spec.feed_width or zoo.spec.hidden_size)
    inputs = zoo.package.OmniInputs(prompt_rows=head, feed_rows=tail[:keep], feed_done=False)
    return inputs, tail[keep:]


# How a model with a conditioning feed makes a request whose feed arrives late.
LATE_FEED = {"qwen3_omni": _omni_late}


@pytest.fixture(scope="module", params=MODELS)
def zoo(request, _one_thread) -> Zoo:
    return Zoo(request.param, _load(request.param))


# -- strategies -----------------------------------------------------------------------------

TEXTS = st.text(alphabet="ab xyz.", min_size=1, max_size=6).filter(str.strip)  # Higgs refuses blank text
SEEDS = st.one_of(st.integers(0, 2**20), st.sampled_from([-1, -(2**63), 2**63 - 1]))
FRESH = st.builds(Req, TEXTS, st.integers(1, MAX_FRAMES), SEEDS, st.sampled_from(SAMPLING), st.sampled_from(SAMPLING))
# Most requests come from a fixed pool, so that their alone runs (cached per model for the whole
# module) are shared by every test and example; one in four is drawn fresh.
POOL = (
    Req("a", 1, 0, GREEDY, GREEDY),
    Req("ab x", 6, 3, SamplingParams(0.9, 8, 0.95), SamplingParams(1.1, 0, 1.0)),
    Req("zy.", 5, 7, GREEDY, SamplingParams(0.7, 5, 0.9)),
    Req("x", 3, 1),
    Req("xyz ab", 8, 2**63 - 1, SamplingParams(1.3, 0, 0.5), SamplingParams(0.0, 3, 0.8)),
    Req("b.b", 8, -1, SamplingParams(1.0, 1, 1.0), GREEDY),
    Req("yy", 4, -(2**63), SamplingParams(0.9, 0, 1e-6), SamplingParams()),
    Req("a z", 7, 12345, SamplingParams(0.7, 5, 0.9), SamplingParams(1.3, 0, 0.5)),
    Req(".", 2, 99, SamplingParams(0.0, 3, 0.8), SamplingParams(0.9, 0, 1e-6)),
)


def requests() -> st.SearchStrategy[Req]:
    pool = st.sampled_from(POOL)
    return st.one_of(pool, pool, pool, FRESH)


def request_lists(min_size: int = 1, max_size: int = 4) -> st.SearchStrategy[list[Req]]:
    return st.lists(requests(), min_size=min_size, max_size=max_size)


POLICIES = st.builds(SchedulingPolicy, token_budget=st.integers(1, 48), prefill_chunk=st.integers(1, 40))


# -- drivers --------------------------------------------------------------------------------


def collect(out: StepOutput, frames: dict[str, list], finished: dict[str, Any]) -> None:
    """Append a step's frames per request (checking their indices) and its ended requests."""
    for frame in out.frames:
        got = frames.setdefault(frame.request_id, [])
        assert frame.index == len(got), f"{frame.request_id!r} published frame {frame.index} after {len(got)}"
        got.append(tuple(int(c) for c in frame.codes))
    for ended in out.finished:
        assert ended.request_id not in finished, f"{ended.request_id!r} ended twice"
        finished[ended.request_id] = ended


def assert_alone(zoo: Zoo, defs: dict[str, Req], frames: dict[str, list], finished: dict[str, Any]) -> None:
    for rid, req in defs.items():
        ref = zoo.alone(req)
        assert rid in finished, f"{zoo.name}: {rid!r} never ended ({req})"
        got = frames.get(rid, [])
        assert finished[rid].num_frames == len(got)
        assert (tuple(got), finished[rid].reason) == (ref.frames, ref.reason), (
            f"{zoo.name}: {rid!r} {req} gave {len(got)} frames / {finished[rid].reason.label}, alone "
            f"{len(ref.frames)} frames / {ref.reason.label}; first difference at frame "
            f"{next((i for i, (a, b) in enumerate(zip(got, ref.frames)) if a != b), min(len(got), len(ref.frames)))}"
        )


def fits(zoo: Zoo, reqs: list[Req]) -> None:
    """Prompt + frames fit the model's context (so no request ends for lack of KV positions)."""
    for req in reqs:
        n = int(zoo.model.prepare(zoo.package.text_inputs(req.text)).prompt_embeds.shape[0])
        assert n + req.max_frames < zoo.spec.max_context, (zoo.name, req, n)


def drive_policy(zoo: Zoo, engine: LockstepEngine, defs: dict[str, Req], data, *, preempt: bool = False,
                 trickle: int = 0):
    """Queue every request and run the built-in policy to the end. Between steps, with
    `preempt`, random live requests are preempted through engine.preempt. With `trickle` (a
    model with a conditioning feed), each request brings 0-2 feed rows at admission and gets
    `trickle` more per step through engine.feed, so requests starve and wake up."""
    frames: dict[str, list] = {}
    finished: dict[str, Any] = {}
    pending: dict[str, torch.Tensor] = {}
    for rid, req in defs.items():
        if trickle:
            keep = data.draw(st.integers(0, 2), label=f"rows of {rid} at admission")
            request, pending[rid] = zoo.late_request(rid, req, keep)
        else:
            request = zoo.new_request(rid, req)
        engine.add_request(request)

    def feed() -> None:
        for rid in list(pending):
            if rid in finished:  # ended (e.g. length) before its feed was complete: nothing more to feed
                del pending[rid]
                continue
            rows, pending[rid] = pending[rid][:trickle], pending[rid][trickle:]
            engine.feed(rid, rows, done=len(pending[rid]) == 0)
            if not len(pending[rid]):
                del pending[rid]

    preempts = 0
    for _ in range(MAX_STEPS):
        out = engine.step()
        if out is None:
            if not pending:
                break
            feed()  # every request waits for a row: give the next ones
            continue
        collect(out, frames, finished)
        feed()
        if preempt and preempts < 6:
            # Mostly requests with frames out (their resume replays them), sometimes mid-prompt.
            odds = {"decoding": 3, "ramp_up": 3, "wind_down": 3, "starved": 3, "waiting": 8, "prefilling": 8}
            for rid, label in sorted(engine.requests().items()):
                if label in odds and data.draw(st.integers(0, odds[label] - 1), label=f"preempt {rid}?") == 1:
                    preempts += engine.preempt(rid)
    else:
        raise AssertionError(f"{zoo.name}: the built-in policy did not finish in {MAX_STEPS} steps")
    assert engine.idle, engine.requests()
    return frames, finished


class PlanDriver:
    """Drives an engine with explicit StepPlans drawn at random: admissions as slots allow (each
    new request either queued first with engine.add_request or named fresh in the plan), random
    prefill chunks, rows skipped now and then, rows in random order with padding rows, overrun
    rows of ended requests, releases whenever, optional preempts and resumes, and late feeds."""

    def __init__(self, zoo: Zoo, engine: LockstepEngine, data, defs: dict[str, Req], *, preempt: bool) -> None:
        self.zoo, self.engine, self.data, self.preempt = zoo, engine, data, preempt
        self.defs = defs
        self.queue = list(defs)
        self.frames: dict[str, list] = {}
        self.finished: dict[str, Any] = {}
        self.unfed: dict[str, torch.Tensor] = {}  # conditioning rows still to come (given done=True)
        self.preemptions: dict[str, int] = {}

    def draw(self, strategy, label):
        return self.data.draw(strategy, label=label)

    def chance(self, one_in: int, label: str) -> bool:
        """True about once in `one_in` draws; shrinks to False, so every choice below is phrased
        so that False is progress (a shrunk example still finishes)."""
        return self.draw(st.integers(0, one_in - 1), label) == one_in - 1

    def chunk(self, left: int, label: str) -> int:
        """1..left prompt tokens; shrinks to all of them."""
        return left - self.draw(st.integers(0, left - 1), label)

    def run(self):
        for _ in range(MAX_STEPS):
            if not self.step():
                assert not self.unfed
                return self.frames, self.finished
        raise AssertionError(f"{self.zoo.name}: explicit plans did not finish in {MAX_STEPS} steps")

    def feed(self, rid: str) -> None:
        self.engine.feed(rid, self.unfed.pop(rid), done=True)

    def step(self) -> bool:
        engine, ledger = self.engine, self.engine.ledger
        records = dict(ledger.records)
        for rid in [rid for rid in self.unfed if rid in self.finished]:
            del self.unfed[rid]  # ended (length) before its feed came: nothing to feed
        for rid in list(self.unfed):  # late feeds: a conditioned request may sit in `starved` meanwhile
            if not self.chance(2, f"feed {rid} later?"):
                self.feed(rid)
        states = {rid: r.state for rid, r in records.items()}
        held = [rid for rid, r in sorted(records.items()) if r.slot is not None]
        live = [rid for rid in held if states[rid] in ledger.live_states]
        starved = [rid for rid in held if states[rid] is State.STARVED]
        ended = [rid for rid in held if states[rid] in ledger.terminal_states]
        preempted = [rid for rid, r in sorted(records.items()) if states[rid] is State.PREEMPTED]
        if not self.queue and not live and not starved and not preempted:
            return False
        if not live and self.unfed:  # nothing may be able to run without them: the rows arrive now
            for rid in list(self.unfed):
                self.feed(rid)
            return True

        releases = [rid for rid in ended if not self.chance(2, f"keep {rid} unreleased?")]
        preempts = []
        if self.preempt:
            preempts = [rid for rid in live + starved if self.preemptions.get(rid, 0) < 2 and self.chance(
                3 if records[rid].num_frames else 8, f"preempt {rid}?")]
        free = engine.num_free_slots + len(releases) + len(preempts)
        if free == 0 and self.queue + preempted and not live and not preempts:
            releases = ended  # every slot is held by an ended request: make room
            free = len(releases)
        resumes = []
        for rid in preempted:
            if free and ledger.ready_to_resume(records[rid]) and not (live and self.chance(2, f"resume {rid} later?")):
                resumes.append(rid)
                free -= 1
        most = min(free, len(self.queue))
        admit = self.queue[: most - self.draw(st.integers(0, most - (0 if live else min(1, most))), "admit fewer")]
        self.queue = self.queue[len(admit):]

        new, prompt = [], {}
        for rid in admit:
            request = self.zoo.new_request(rid, self.defs[rid])
            if self.zoo.spec.has_feed and self.chance(2, f"feed of {rid} late?"):
                keep = self.draw(st.integers(0, 2), f"rows of {rid} at admission")
                request, self.unfed[rid] = self.zoo.late_request(rid, self.defs[rid], keep)
            if self.draw(st.booleans(), f"queue {rid} first?"):
                engine.add_request(request)
                if rid in self.unfed and self.chance(2, f"feed {rid} while queued?"):
                    self.feed(rid)
            new.append(request)
            prompt[rid] = int(engine.prepare(request).prompt_embeds.shape[0])

        rows: list[Span | None] = []
        gone = set(preempts)
        for rid in live:
            if rid in gone:
                continue
            left = records[rid].prompt_len - records[rid].num_computed
            if self.chance(6, f"skip {rid}?"):
                continue
            rows.append(Span(rid, self.chunk(left, f"chunk {rid}") if left > 0 else 1))
        for rid in resumes:
            left = ledger.resume_prompt_len(records[rid])
            rows.append(Span(rid, self.chunk(left, f"resume chunk {rid}")))
        for rid in admit:
            rows.append(Span(rid, self.chunk(prompt[rid], f"chunk {rid}")))
        for rid in ended:  # async overrun: an ended request scheduled again publishes nothing
            if rid not in releases and self.chance(3, f"overrun {rid}?"):
                rows.append(Span(rid, 1))
        rows = list(self.draw(st.permutations(rows), "row order"))
        for _ in range(self.draw(st.integers(0, 2), "padding rows")):
            rows.insert(self.draw(st.integers(0, len(rows)), "padding at"), None)

        out = engine.step(StepPlan(new_requests=tuple(new), rows=tuple(rows), releases=tuple(releases),
                                   preempts=tuple(preempts), resumes=tuple(resumes)))
        assert out.preempted == tuple(preempts)
        for rid in preempts:
            self.preemptions[rid] = self.preemptions.get(rid, 0) + 1
        for rid, row_valid in zip(out.rows.request_ids, out.rows.valid.tolist()):
            if rid is None or rid in ended:
                assert not row_valid, f"a padding or overrun row of {rid!r} published a frame"
        collect(out, self.frames, self.finished)
        return True


# -- 1. batched == alone ----------------------------------------------------------------------


@settings(FAST, max_examples=examples(6))
@given(data=st.data(), defs=request_lists(), max_slots=st.integers(1, 4), policy=POLICIES,
       trickle=st.sampled_from([0, 0, 1, 3]))
def test_batched_equals_alone_under_the_builtin_policy(zoo, data, defs, max_slots, policy, trickle):
    """1-4 random requests (text, max_frames 1..8, seed, CB0/MTP sampling incl. greedy, top-k,
    top-p) generated together by the built-in policy with a random token budget / prefill chunk
    and 1-4 slots each give exactly their alone frames and finish reason. A conditioned model's
    feed is given whole up front or trickled a few rows per step (requests starve meanwhile)."""
    fits(zoo, defs)
    named = {f"r{i}": d for i, d in enumerate(defs)}
    with zoo.engine(max_slots, policy) as engine:
        frames, finished = drive_policy(zoo, engine, named, data, trickle=trickle if zoo.spec.has_feed else 0)
    assert_alone(zoo, named, frames, finished)


# -- 2. any row order, padding rows ------------------------------------------------------------


@settings(FAST, max_examples=examples(6))
@given(data=st.data(), defs=request_lists(), max_slots=st.integers(1, 4))
def test_any_row_order_chunking_and_padding_gives_the_alone_frames(zoo, data, defs, max_slots):
    """The same requests driven by explicit StepPlans: random chunks, rows shuffled, None padding
    rows anywhere, overrun rows of ended requests, late releases, requests admitted queued or
    fresh, a conditioned model's feed arriving late (the request starves meanwhile): each request's
    frames and finish reason equal its alone run, and padding / overrun rows publish nothing."""
    fits(zoo, defs)
    named = {f"r{i}": d for i, d in enumerate(defs)}
    with zoo.engine(max_slots) as engine:
        frames, finished = PlanDriver(zoo, engine, data, named, preempt=False).run()
    assert_alone(zoo, named, frames, finished)


# -- 3. preemption and resume ------------------------------------------------------------------


@settings(FAST, max_examples=examples(5))
@given(data=st.data(), defs=request_lists(2, 4), max_slots=st.integers(1, 3), policy=POLICIES,
       preempt_after=st.sampled_from([None, 0, 1, 2]))
def test_preemption_by_the_policy_and_engine_preempt_never_changes_frames(zoo, data, defs, max_slots, policy,
                                                                           preempt_after):
    """The built-in policy with preempt_after_steps (a blocked queue head preempts the newest
    running request) and random engine.preempt calls between steps: preempted requests resume by
    re-prefilling prompt + published frames, and every request still gives its alone frames."""
    fits(zoo, defs)
    named = {f"r{i}": d for i, d in enumerate(defs)}
    policy = attrs.evolve(policy, preempt_after_steps=preempt_after)
    with zoo.engine(max_slots, policy) as engine:
        frames, finished = drive_policy(zoo, engine, named, data, preempt=True)
    assert_alone(zoo, named, frames, finished)


@settings(FAST, max_examples=examples(5))
@given(data=st.data(), defs=request_lists(1, 3), max_slots=st.integers(1, 3))
def test_preempts_and_resumes_in_explicit_plans_never_change_frames(zoo, data, defs, max_slots):
    """Explicit StepPlans preempting random live (or starved) requests, resuming them later with
    random chunks of prompt + replayed frames, in shuffled padded rows: frames equal alone."""
    fits(zoo, defs)
    named = {f"r{i}": d for i, d in enumerate(defs)}
    with zoo.engine(max_slots) as engine:
        driver = PlanDriver(zoo, engine, data, named, preempt=True)
        frames, finished = driver.run()
    assert_alone(zoo, named, frames, finished)


# -- 4. bad input -----------------------------------------------------------------------------


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, BlockPool):  # a paged KV: every block and the block table
        return [*value.k, *value.v, value.table]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def snapshot(engine: LockstepEngine):
    """Everything a refused input must leave as it was: request states, host records, the free
    slot count, every slot-table column and the model's own per-slot state (KV cache)."""
    ledger = engine.ledger
    records = {rid: (r.slot, r.serial, r.prompt_len, r.num_computed, r.num_frames, r.state, r.feed_count,
                     r.feed_done) for rid, r in ledger.all_records()}
    columns = {k: v.clone() for k, v in engine.table.columns().items()}
    model = [t.clone() for name, v in sorted(vars(engine.model).items()) if name != "module" for t in _tensors(v)]
    return engine.requests(), records, engine.num_free_slots, list(ledger.queued), columns, model, engine.step_count


def assert_unchanged(before, engine: LockstepEngine, case: str) -> None:
    after = snapshot(engine)
    assert after[0] == before[0], f"{case}: requests changed {before[0]} -> {after[0]}"
    assert after[1:4] == before[1:4], f"{case}: host records / free slots / queue changed"
    for name in before[4]:
        assert torch.equal(before[4][name], after[4][name]), f"{case}: slot column {name!r} changed"
    assert len(before[5]) == len(after[5]) and all(torch.equal(a, b) for a, b in zip(before[5], after[5])), (
        f"{case}: the model's per-slot state changed")
    assert after[6] == before[6], f"{case}: a step ran"


def refused(engine: LockstepEngine, case: str, call, error: type, name: str):
    """`call()` raises `error` (an MtpFsmError) naming request `name`, and changes nothing."""
    before = snapshot(engine)
    with pytest.raises(error) as info:
        call()
    assert isinstance(info.value, MtpFsmError), f"{case}: {type(info.value).__name__} is not an MtpFsmError"
    assert f"'{name}'" in str(info.value), f"{case}: the error does not name {name!r}: {info.value}"
    if hasattr(info.value, "request_id"):
        assert info.value.request_id == name, f"{case}: request_id {info.value.request_id!r}, expected {name!r}"
    assert_unchanged(before, engine, case)
    return info.value


A, B, C = POOL[1], POOL[2], POOL[3]


@contextlib.contextmanager
def two_running(zoo: Zoo, slots: int = 3):
    """An engine holding 'a' (prompt done: decoding, one frame out) and 'b' (one prompt token
    computed: prefilling), with slots - 2 free slots; yields (engine, frames, finished) and on
    exit runs both to their end and checks they gave their alone frames."""
    with zoo.engine(slots) as engine:
        frames, finished = {}, {}
        a, b = zoo.new_request("a", A), zoo.new_request("b", B)
        n_a = int(engine.prepare(a).prompt_embeds.shape[0])
        collect(engine.step(StepPlan(new_requests=(a, b), rows=(Span("a", n_a), Span("b", 1)))), frames, finished)
        states = engine.requests()
        assert states["b"] == "prefilling" and states["a"] in (*DECODE_STATES, "finished"), states
        yield engine, frames, finished
        for _ in range(MAX_STEPS):
            rows = []
            for rid in ("a", "b"):
                record = engine.ledger.records.get(rid)
                if record is not None and record.state in engine.ledger.live_states:
                    left = record.prompt_len - record.num_computed
                    rows.append(Span(rid, left if left > 0 else 1))
            if not rows:
                break
            collect(engine.step(StepPlan(rows=tuple(reversed(rows)))), frames, finished)
    assert_alone(zoo, {"a": A, "b": B}, frames, finished)  # the engine is closed: the alone runs may bind the model


def test_bad_plans_are_refused_whole_naming_the_request(zoo):
    """Unknown requests, spans too long / zero / decode rows of 2, a request in two rows or named
    twice, duplicate ids, a full table, illegal lifecycle triggers and a bad request inside an
    otherwise good plan: each raises the MtpFsmError subclass naming the request, leaves the
    engine exactly as it was, and afterwards 'a' and 'b' still finish with their alone frames."""
    with two_running(zoo) as (engine, _, _):
        rec_b = engine.ledger.records["b"]
        left_b = rec_b.prompt_len - rec_b.num_computed
        c, d = zoo.new_request("c", C), zoo.new_request("d", C)
        n_c = int(engine.prepare(c).prompt_embeds.shape[0])
        a_live = engine.requests()["a"] in DECODE_STATES
        cases = {
            "unknown row": (StepPlan(rows=(Span("b", 1), Span("zz", 1))), PlanError, "zz"),
            "unknown abort": (StepPlan(aborts=("zz",)), UnknownRequestError, "zz"),
            "unknown release": (StepPlan(releases=("zz",)), UnknownRequestError, "zz"),
            "unknown preempt": (StepPlan(preempts=("zz",)), UnknownRequestError, "zz"),
            "unknown resume": (StepPlan(resumes=("zz",)), UnknownRequestError, "zz"),
            "prefill span too long": (StepPlan(rows=(Span("b", left_b + 1),)), PlanError, "b"),
            "new request's span too long": (StepPlan(new_requests=(c,), rows=(Span("c", n_c + 1),)), PlanError, "c"),
            "zero-token span": (StepPlan(rows=(Span("b", 0),)), PlanError, "b"),
            "negative span": (StepPlan(rows=(Span("b", -1),)), PlanError, "b"),
            "scheduled in two rows": (StepPlan(rows=(Span("b", 1), None, Span("b", 1))), PlanError, "b"),
            "named twice in one plan": (StepPlan(aborts=("b",), preempts=("b",)), PlanError, "b"),
            "duplicate id of a running request": (StepPlan(new_requests=(zoo.new_request("a", C),)),
                                                  DuplicateRequestError, "a"),
            "duplicate id within the plan": (StepPlan(new_requests=(c, zoo.new_request("c", C))),
                                             DuplicateRequestError, "c"),
            "table full": (StepPlan(new_requests=(c, d)), SlotTableFullError, "d"),
            "release a live request": (StepPlan(releases=("b",)), LifecycleError, "b"),
            "resume a running request": (StepPlan(resumes=("b",)), LifecycleError, "b"),
            "row of a request aborted by the plan": (StepPlan(aborts=("b",), rows=(Span("b", 1),)), PlanError, "b"),
            "row of a request preempted by the plan": (StepPlan(preempts=("b",), rows=(Span("b", 1),)),
                                                       PlanError, "b"),
            "bad request in a good plan": (StepPlan(new_requests=(c, zoo.new_request("d", C, max_frames=0)),
                                                    rows=(Span("b", 1), Span("c", 1))), AdmissionError, "d"),
        }
        if a_live:
            cases["decode row of 2 tokens"] = (StepPlan(rows=(Span("b", 1), Span("a", 2))), PlanError, "a")
        for case, (plan, error, name) in cases.items():
            refused(engine, case, lambda plan=plan: engine.step(plan), error, name)
        assert "c" not in engine.requests() and "d" not in engine.requests()
        # Client calls on unknown requests are answers, not changes.
        before = snapshot(engine)
        assert engine.abort("zz") == "ignored" and engine.preempt("zz") is False
        assert_unchanged(before, engine, "abort / preempt of an unknown request")
        refused(engine, "state of an unknown request", lambda: engine.request_state("zz"), UnknownRequestError, "zz")


def _bad_requests(zoo: Zoo) -> dict[str, tuple[NewRequest, str]]:
    """Bad new requests, each with a phrase its refusal must contain."""
    bad = {
        "max_frames 0": (dict(max_frames=0), "max_frames"),
        "max_frames -1": (dict(max_frames=-1), "max_frames"),
        "max_frames True": (dict(max_frames=True), "max_frames"),
        "max_frames 2.0": (dict(max_frames=2.0), "max_frames"),
        "seed beyond 64 bits": (dict(seed=2**63), "seed"),
        "seed False": (dict(seed=False), "seed"),
        "sampling width 2": (dict(sampling_width=2), "sampling width"),
        "negative temperature": (dict(cb0_sampling=SamplingParams(-1.0, 0, 1.0)), "cb0 sampling: temperature"),
        "NaN temperature": (dict(mtp_sampling=SamplingParams(math.nan, 0, 1.0)), "mtp sampling: temperature"),
        "infinite temperature": (dict(cb0_sampling=SamplingParams(math.inf, 0, 1.0)), "cb0 sampling: temperature"),
        "negative top_k": (dict(cb0_sampling=SamplingParams(0.9, -1, 1.0)), "cb0 sampling: top_k"),
        "float top_k": (dict(mtp_sampling=SamplingParams(0.9, 2.5, 1.0)), "mtp sampling: top_k"),
        "top_p 0": (dict(cb0_sampling=SamplingParams(0.9, 0, 0.0)), "cb0 sampling: top_p"),
        "top_p 1.5": (dict(mtp_sampling=SamplingParams(0.9, 0, 1.5)), "mtp sampling: top_p"),
        "inputs None": (dict(inputs=None), "inputs rejected by the model"),
        "inputs of another model": (dict(inputs=object()), "inputs rejected by the model"),
    }
    if not zoo.spec.has_feed:  # the conditioned model's text goes to its feed (capacity: see the feed test)
        bad["text longer than the context"] = (dict(inputs=zoo.package.text_inputs("x" * (zoo.spec.max_context + 1))),
                                               "")
    return {case: (zoo.new_request("bad", C, **fields), phrase) for case, (fields, phrase) in bad.items()}


def test_bad_new_requests_raise_admission_errors_naming_them(zoo):
    """max_frames 0 / negative / bool / float, seeds out of range, sampling width 2, bad CB0 or
    MTP sampling (also where the model fixes its own sampling), inputs the model cannot prepare
    and prompts beyond the context: AdmissionError naming the request, from add_request, from a
    StepPlan and from check_new, with the engine left as it was."""
    with two_running(zoo) as (engine, _, _):
        for case, (request, phrase) in _bad_requests(zoo).items():
            error = refused(engine, f"add_request: {case}", lambda r=request: engine.add_request(r), AdmissionError,
                            "bad")
            assert phrase in str(error), f"{case}: {error}"
            refused(engine, f"StepPlan: {case}", lambda r=request: engine.step(StepPlan(
                new_requests=(r,), rows=(Span("b", 1),))), AdmissionError, "bad")
            if "inputs" not in case and "text" not in case:
                assert engine.check_new(request), f"check_new finds nothing wrong with {case}"
        assert "bad" not in engine.requests()


def test_bad_feeds_are_refused_naming_the_request(zoo):
    """engine.feed: on a model without a feed, for an unknown request, rows of the wrong width,
    non-finite or integer rows, rows beyond the capacity, rows after done: FeedError naming the
    request, nothing changed."""
    with two_running(zoo) as (engine, _, _):
        if not zoo.spec.has_feed:
            refused(engine, "feed without a feed", lambda: engine.feed("b", torch.zeros(1, 4)), FeedError, "b")
            return
        width = zoo.spec.feed_width or zoo.spec.hidden_size
        c, _ = zoo.late_request("c", C, keep=1)
        engine.add_request(c)  # queued, its feed not done: fed rows are held for its admission
        cases = {
            "unknown request": ("zz", torch.zeros(1, width), False),
            "a request that was fed done": ("b", torch.zeros(1, width), False),
            "wrong width": ("c", torch.zeros(2, width + 1), False),
            "one-dimensional rows": ("c", torch.zeros(width), False),
            "NaN rows": ("c", torch.full((1, width), math.nan), False),
            "integer rows": ("c", torch.zeros(1, width, dtype=torch.int64), False),
            "beyond the capacity": ("c", torch.zeros(zoo.spec.feed_capacity + 1, width), False),
            "not a tensor": ("c", [[0.0] * width], False),
        }
        for case, (rid, rows, done) in cases.items():
            refused(engine, case, lambda rid=rid, rows=rows, done=done: engine.feed(rid, rows, done=done),
                    FeedError, rid)
        assert engine.abort("c") == "dropped"


def test_a_starved_request_is_refused_rows_and_resumes_until_its_row_arrives(zoo):
    """A model with a conditioning feed: a request admitted with none of its feed rows samples
    frame 0 from its prompt and then starves. Scheduling it, or resuming it after a preemption,
    is refused (PlanError naming it, nothing changed) until engine.feed brings the row; then it
    finishes with its alone frames."""
    if not zoo.spec.has_feed:
        pytest.skip(f"{zoo.name} takes no conditioning feed")
    frames, finished = {}, {}
    with zoo.engine(2) as engine:
        c, rest = zoo.late_request("c", A, keep=0)
        n = int(engine.prepare(c).prompt_embeds.shape[0])
        collect(engine.step(StepPlan(new_requests=(c,), rows=(Span("c", n),))), frames, finished)
        assert engine.requests() == {"c": "starved"} and len(frames["c"]) == 1
        refused(engine, "row of a starved request", lambda: engine.step(StepPlan(rows=(Span("c", 1),))), PlanError, "c")
        assert engine.step() is None  # the built-in policy has nothing to run either
        collect(engine.step(StepPlan(preempts=("c",))), frames, finished)
        assert engine.requests() == {"c": "preempted"}
        refused(engine, "resume before the row arrives",
                lambda: engine.step(StepPlan(resumes=("c",), rows=(Span("c", n + 1),))), PlanError, "c")
        engine.feed("c", rest, done=True)  # a preempted request's rows are kept for its resume
        collect(engine.step(StepPlan(resumes=("c",), rows=(None, Span("c", n + 1)))), frames, finished)
        while "c" not in finished:
            collect(engine.step(StepPlan(rows=(Span("c", 1),))), frames, finished)
    assert_alone(zoo, {"c": A}, frames, finished)


# Request fields the admission checks accept but the slot table cannot hold (int64 columns) or
# the sampler cannot use (a bool top_k reaches torch.topk as k=True). Each crashes inside
# step() *after* the plan was committed on the host, instead of an AdmissionError before it:
# the request then holds a slot whose device row was never initialised, and every later step of
# the engine (even one only aborting it) raises EngineInvariantError (sticky error bits) or the
# same TypeError. Engine bug, reported; these pass once admission refuses such values.
UNREPRESENTABLE = {
    "max_frames 2**63": dict(max_frames=2**63),
    "cb0 top_k 2**63": dict(cb0_sampling=SamplingParams(0.9, 2**63, 1.0)),
    "mtp top_k 2**63": dict(mtp_sampling=SamplingParams(0.9, 2**63, 1.0)),
    "cb0 top_k True": dict(cb0_sampling=SamplingParams(0.9, True, 1.0)),
    "max_frames 2**31": dict(max_frames=2**31),
}


# Once accepted, these crashed step() after the plan was committed and left the slot broken.
@pytest.mark.parametrize("case", sorted(UNREPRESENTABLE))
def test_unrepresentable_request_fields_are_refused_at_admission(zoo, case):
    with zoo.engine(2) as engine:
        request = zoo.new_request("bad", C, **UNREPRESENTABLE[case])
        refused(engine, f"StepPlan: {case}", lambda: engine.step(StepPlan(new_requests=(request,), rows=(
            Span("bad", int(engine.prepare(request).prompt_embeds.shape[0])),))), AdmissionError, "bad")
        refused(engine, f"add_request: {case}", lambda: engine.add_request(request), AdmissionError, "bad")
