"""The conditioning feed (variant `conditioned`, Qwen3-Omni's thinker rows): rows arriving
over time, the `starved` rest state, and the bad-input errors of engine.feed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from mtp_fsm.engine import FeedError, LockstepEngine, NewRequest, Span, StepPlan
from mtp_fsm.errors import MtpFsmError, PlanError
from mtp_fsm.lifecycle import FinishReason, State
from mtp_fsm.testing import ScriptInputs
from mtp_fsm.testing.alone import RequestDef, scripted_conditioned, scripted_mtp, torch_threads
from mtp_fsm.testing.references import reference_runs
from mtp_fsm.testing.stateful import scripted_requests

SPEC = scripted_conditioned().spec
FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


@st.composite
def fed_requests(draw):
    """(request def with part of its feed upfront, the ids still to feed)."""
    d = draw(scripted_requests(SPEC))
    return d, draw(st.integers(0, len(d.inputs.feed)))


@FAST
@given(st.lists(fed_requests(), min_size=1, max_size=3), st.integers(1, 3), st.data())
def test_frames_do_not_depend_on_when_conditioning_rows_arrive(requests, max_slots, data):
    """Rows fed late (one by one, in bursts, while preempted) give exactly the frames of a
    run that had every row from the start; a request missing its next row rests in starved."""
    import attrs

    model = scripted_conditioned()
    refs = reference_runs(scripted_conditioned)
    engine = LockstepEngine(model, max_slots, kernels="torch")
    pending, frames, ended = {}, {}, {}
    for i, (d, upfront) in enumerate(requests):
        rid = f"r{i}"
        late = attrs.evolve(d.inputs, feed_upfront=upfront)
        engine.add_request(d.new_request(rid, inputs=late))
        pending[rid] = list(d.inputs.feed[upfront:])
        frames[rid] = []
    starved_seen = 0
    for _ in range(400):
        out = engine.step()
        if out is not None:
            for f in out.frames:
                frames[f.request_id].append(tuple(f.codes.tolist()))
            ended.update((f.request_id, f) for f in out.finished)
        states = engine.requests()
        starved_seen += sum(s == "starved" for s in states.values())
        for rid, rest in pending.items():
            if rid in ended or rid not in states:
                continue
            if rest and (out is None or data.draw(st.booleans(), label=f"feed {rid} now")):
                n = data.draw(st.integers(0, len(rest)), label="rows") if out is not None else max(1, len(rest))
                n = min(n, len(rest))
                d = requests[int(rid[1:])][0]
                engine.feed(rid, model.feed_rows(rest[:n]), done=d.inputs.feed_done and n == len(rest))
                del rest[:n]
            elif out is not None and rid in states and states[rid] == "decoding" and data.draw(
                    st.integers(0, 9), label="preempt") == 0:
                engine.preempt(rid)
        if out is None and all(rid in ended for rid in pending):
            break
    assert set(ended) == set(pending), (engine.requests(), pending)
    for i, (d, _) in enumerate(requests):
        ref = refs.get(d)
        rid = f"r{i}"
        assert (tuple(frames[rid]), ended[rid].reason) == (ref.frames, ref.reason), rid


def test_a_request_waits_in_starved_and_resumes_when_fed():
    model = scripted_conditioned()
    engine = LockstepEngine(model, 2, kernels="torch")
    feed = (5, 6, 7)
    engine.add_request(NewRequest("a", ScriptInputs((1, 2), feed=feed, feed_upfront=0), 5, 1))
    outputs = []
    while (out := engine.step()) is not None:
        outputs.append(out)
    assert engine.request_state("a") is State.STARVED and len(outputs) == 1  # prefill published frame 0
    with pytest.raises(PlanError, match="'a' in state 'starved'.*waits for conditioning row 0"):
        engine.step(StepPlan(rows=(Span("a", 1),)))
    engine.feed("a", model.feed_rows(feed), done=True)
    while (out := engine.step()) is not None:
        outputs.append(out)
    ref = reference_runs(scripted_conditioned).get(RequestDef(ScriptInputs((1, 2), feed=feed), 5, 1))
    got = tuple(tuple(f.codes.tolist()) for out in outputs for f in out.frames)
    ended = [f for out in outputs for f in out.finished]
    assert got == ref.frames and [(f.request_id, f.reason) for f in ended] == [("a", ref.reason)]


def test_a_starved_request_can_be_aborted_and_preempted_but_not_resumed_early():
    model = scripted_conditioned()
    engine = LockstepEngine(model, 2, kernels="torch")
    engine.add_request(NewRequest("a", ScriptInputs((1, 2), feed=(4,), feed_upfront=0), 5, 1))
    engine.add_request(NewRequest("b", ScriptInputs((3,), feed=(4, 5), feed_upfront=0, feed_done=False), 5, 1))
    while engine.step() is not None:
        pass
    assert engine.requests() == {"a": "starved", "b": "starved"}
    out = engine.step(StepPlan(aborts=("a",), preempts=("b",)))
    assert [(f.request_id, f.reason) for f in out.finished] == [("a", FinishReason.ABORT)]
    with pytest.raises(PlanError, match="cannot resume before conditioning row 0 arrives"):
        engine.step(StepPlan(resumes=("b",), rows=(Span("b", 2),)))
    engine.feed("b", model.feed_rows((4, 5)), done=True)
    ended = []
    while (out := engine.step()) is not None:
        ended += out.finished
    assert [f.request_id for f in ended] == ["b"] and ended[0].reason in (FinishReason.EOS, FinishReason.LENGTH)


def test_feed_bad_input_is_refused_whole():
    model = scripted_conditioned()
    engine = LockstepEngine(model, 1, kernels="torch")
    engine.add_request(NewRequest("a", ScriptInputs((1,), feed=(2,), feed_upfront=0, feed_done=False), 3, 1))
    h = SPEC.hidden_size
    cases = [
        ("nope", torch.zeros(1, h), "not in the engine"),
        ("a", torch.zeros(h), r"tensor \[n, 16\]"),
        ("a", torch.zeros(1, h + 1), r"tensor \[n, 16\]"),
        ("a", torch.full((1, h), float("nan")), "finite"),
        ("a", torch.zeros(1, h, dtype=torch.int64), "finite floating-point"),
        ("a", torch.zeros(SPEC.feed_capacity + 1, h), "exceed the model's capacity"),
    ]
    for rid, rows, message in cases:
        with pytest.raises(FeedError, match=message) as exc:
            engine.feed(rid, rows)
        assert isinstance(exc.value, MtpFsmError)
    assert engine.ledger.queued["a"].feed_count == 0  # nothing was taken
    engine.feed("a", model.feed_rows((2,)), done=True)
    with pytest.raises(FeedError, match="after its feed was declared done"):
        engine.feed("a", model.feed_rows((3,)))
    engine.generate([])
    with pytest.raises(FeedError, match="not in the engine"):
        engine.feed("a", model.feed_rows((3,)))
    plain = LockstepEngine(scripted_mtp(), 1, kernels="torch")
    plain.add_request(NewRequest("x", ScriptInputs((1,)), 2, 1))
    with pytest.raises(FeedError, match="takes no conditioning feed"):
        plain.feed("x", torch.zeros(1, h))


def test_the_serving_loop_pauses_on_starved_requests_and_resumes_when_fed():
    from mtp_fsm.serving import InMemorySink, ServingLoop

    model = scripted_conditioned()
    sink = InMemorySink()
    loop = ServingLoop(LockstepEngine(model, 2, kernels="torch"), [sink])
    feed = (3, 1, 4, 1, 5)
    definition = RequestDef(ScriptInputs((2, 7), feed=feed), 6, 9)
    loop.submit(definition.new_request("a", inputs=ScriptInputs((2, 7), feed=feed, feed_upfront=1)))
    loop.run_until_idle()
    assert loop.engine.requests() == {"a": "starved"} and loop.engine.waiting_for_feed == 1 and not loop.idle
    for i in range(1, len(feed)):
        loop.feed("a", model.feed_rows(feed[i:i + 1]), done=i == len(feed) - 1)
        loop.run_until_idle()
    ref = reference_runs(scripted_conditioned).get(definition)
    assert [tuple(codes) for _, codes in sink.frames["a"]] == list(ref.frames)
    assert sink.finished["a"].reason is ref.reason and loop.idle
    assert max(loop.metrics.state_history()["starved"]) == 1


def test_a_starved_request_yields_its_slot_under_pressure():
    """engine.preempt takes a starved request, and a policy that preempts under pressure
    picks it before a running one: a queued request is not stuck behind missing rows."""
    from mtp_fsm.engine import SchedulingPolicy

    model = scripted_conditioned()
    engine = LockstepEngine(model, 1, kernels="torch", policy=SchedulingPolicy(preempt_after_steps=0))
    engine.add_request(NewRequest("a", ScriptInputs((1, 2), feed=(5, 6), feed_upfront=0), 5, 1))
    engine.add_request(NewRequest("b", ScriptInputs((3,)), 3, 1))
    ended = {}
    while (out := engine.step()) is not None:
        ended.update((f.request_id, f.reason) for f in out.finished)
    assert ended == {"b": ended.get("b")} and "b" in ended  # b ran to its end while a waited preempted
    assert engine.requests() == {"a": "preempted"}
    engine.feed("a", model.feed_rows((5, 6)), done=True)
    while (out := engine.step()) is not None:
        ended.update((f.request_id, f.reason) for f in out.finished)
    assert set(ended) == {"a", "b"}

    manual = LockstepEngine(scripted_conditioned(), 1, kernels="torch")
    manual.add_request(NewRequest("a", ScriptInputs((1, 2), feed=(5,), feed_upfront=0), 5, 1))
    while manual.step() is not None:
        pass
    assert manual.requests() == {"a": "starved"} and manual.preempt("a") is True
    manual.step()
    assert manual.requests() == {"a": "preempted"}
