"""The host request table is the device slot table's twin after every step (one owner per field:
README, "One owner for each field"), whatever the schedule: admissions, chunked prefill, aborts,
preemption and resume, EOS / NaN faults, speculative verify rows, a conditioning feed."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from mtp_fsm.engine import LockstepEngine, SchedulingPolicy
from mtp_fsm.testing.alone import scripted_conditioned, scripted_delay, scripted_mtp, scripted_stop_head
from mtp_fsm.testing.scripted import ScriptedTalker
from mtp_fsm.testing.strategies import scripted_requests

FIELDS = {"state": "state", "serial": "serial", "prompt_len": "prompt_len", "num_computed": "num_computed",
          "num_frames": "num_frames", "finish_reason": "finish_reason"}
MODELS = {"mtp": scripted_mtp, "conditioned": scripted_conditioned, "delay_pattern": scripted_delay,
          "stop_head": scripted_stop_head, "speculative": lambda: ScriptedTalker(num_codebooks=1, draft_miss=3)}


def _check(engine: LockstepEngine) -> None:
    ledger, table = engine.ledger, engine.table
    device = {name: getattr(table, column).cpu() for name, column in FIELDS.items()}
    held = set()
    for rid, record in ledger.records.items():
        if record.slot is None:
            continue
        held.add(record.slot)
        for name in FIELDS:
            host, dev = int(getattr(record, name)), int(device[name][record.slot])
            assert host == dev, f"{rid} slot {record.slot}: {name} host {host} != device {dev}"
    assert held == set(ledger.allocator.in_use())
    for slot in set(range(engine.max_slots)) - held:  # vacant rows agree too
        assert int(ledger.rows.state[slot]) == int(device["state"][slot])


@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(variant=st.sampled_from(sorted(MODELS)), slots=st.integers(1, 3), budget=st.sampled_from([6, 16, 64]),
       data=st.data())
def test_host_request_table_equals_the_slot_table_after_every_step(variant, slots, budget, data):
    model = MODELS[variant]()
    k = 2 if variant == "speculative" else 0
    engine = LockstepEngine(model, slots, kernels="torch", speculate=k,
                            policy=SchedulingPolicy(token_budget=budget, prefill_chunk=3, preempt_after_steps=1))
    defs = data.draw(st.lists(scripted_requests(model.spec, max_frames=6), min_size=1, max_size=5), label="requests")
    for i, d in enumerate(defs):
        engine.add_request(d.new_request(f"r{i}"))
    for step in range(300):
        held = sorted(engine.ledger.records)
        if held and data.draw(st.integers(0, 5), label="event") == 0:
            rid = data.draw(st.sampled_from(held), label="who")
            (engine.abort if data.draw(st.booleans(), label="abort") else engine.preempt)(rid)
        if engine.step() is None:
            break
        _check(engine)
    assert engine.idle or engine.waiting_for_feed


def test_a_record_without_a_slot_parks_its_counters():
    engine = LockstepEngine(scripted_mtp(), 1, kernels="torch", policy=SchedulingPolicy(preempt_after_steps=0))
    from mtp_fsm.testing.scripted import ScriptInputs
    from mtp_fsm.engine import NewRequest
    engine.add_request(NewRequest("a", ScriptInputs(prompt=(1, 2)), max_frames=8))
    engine.add_request(NewRequest("b", ScriptInputs(prompt=(3,)), max_frames=2))
    for _ in range(4):
        engine.step()
        _check(engine)
    record = engine.ledger.records.get("a")
    if record is not None and record.slot is None:  # preempted: frames kept, no row
        assert record.state.label == "preempted" and record.num_frames >= 1
    assert torch.equal(engine.table.state[:1].cpu().long(), torch.from_numpy(engine.ledger.rows.state[:1]))


def test_debug_mode_runs_clean_on_every_variant():
    """debug=True checks every step (host vs device table, state moves vs the transitions machine)."""
    from mtp_fsm.testing.determinism import SCRIPTED, workload

    for name in (*SCRIPTED, "mtp_lm_speculative"):
        load = workload(name, num_requests=4, max_frames=5) if name != "mtp_lm_speculative" else None
        model, requests, k = (load.model, load.requests, 0) if load else (
            ScriptedTalker(num_codebooks=1, draft_miss=2), None, 2)
        engine = LockstepEngine(model, 2, kernels="torch", speculate=k, debug=True,
                                policy=SchedulingPolicy(token_budget=12, prefill_chunk=3, preempt_after_steps=1))
        if requests is None:
            from mtp_fsm.engine import NewRequest
            from mtp_fsm.testing.scripted import ScriptInputs
            requests = [NewRequest(f"r{i}", ScriptInputs(prompt=(1, 2 + i)), max_frames=6) for i in range(3)]
        results = engine.generate(requests)
        assert all(g.finished is not None for g in results.values()), name


def test_debug_mode_names_the_request_when_host_and_device_disagree():
    import pytest

    from mtp_fsm.engine import NewRequest
    from mtp_fsm.errors import EngineInvariantError
    from mtp_fsm.testing.scripted import ScriptInputs

    engine = LockstepEngine(scripted_mtp(), 2, kernels="torch", debug=True)
    engine.add_request(NewRequest("victim", ScriptInputs(prompt=(1, 2, 3)), max_frames=6))
    engine.step()
    slot = engine.ledger.records["victim"].slot
    engine.table.prompt_len[slot] += 7  # a kernel bug writing a column only admission may write
    with pytest.raises(EngineInvariantError, match="'victim'.*prompt_len"):
        engine.step()


def test_debug_mode_refuses_a_move_no_stage_sequence_allows(monkeypatch):
    import pytest

    from mtp_fsm.engine import NewRequest
    from mtp_fsm.engine.debug_checks import reachable_in_a_step
    from mtp_fsm.errors import EngineInvariantError
    from mtp_fsm.kernels.contract import OUT_STATE
    from mtp_fsm.lifecycle import State
    from mtp_fsm.testing.scripted import ScriptInputs

    engine = LockstepEngine(scripted_mtp(), 2, kernels="torch", debug=True)
    reach = reachable_in_a_step(engine.lifecycle)
    assert State.FINISHED in reach[State.DECODING] and State.WAITING not in reach[State.DECODING]
    engine.add_request(NewRequest("r", ScriptInputs(prompt=(1, 2)), max_frames=6))
    engine.step()
    engine.step()  # decoding now
    original = engine.kernels.publish_frames

    def rewinding(table, lc, batch, *args, **kwargs):  # a kernel bug: decoding rows jump back to waiting
        packed = original(table, lc, batch, *args, **kwargs)
        table.state[batch.idx_mapping] = int(State.WAITING)
        packed[:, OUT_STATE] = int(State.WAITING)
        return packed
    # engine.kernels is the backend module, shared by every engine: patched for this test only.
    monkeypatch.setattr(engine.kernels, "publish_frames", rewinding)
    with pytest.raises(EngineInvariantError, match="'r' moved 'decoding' -> 'waiting'"):
        engine.step()


def test_device_written_block_is_the_packed_output_layout():
    """Ledger.observe takes the output's OUT_STATE..OUT_CODES columns into the request table's
    device-written block in one assignment: the two orders must be the same."""
    from mtp_fsm.engine.records import DEVICE_WRITTEN, RequestTable
    from mtp_fsm.kernels import contract

    layout = {name: getattr(contract, f"OUT_{name.upper()}") for name in DEVICE_WRITTEN}
    assert list(layout.values()) == list(range(contract.OUT_STATE, contract.OUT_CODES))
    table = RequestTable(3)
    for i, name in enumerate(DEVICE_WRITTEN):  # each column a view of its block column
        getattr(table, name)[1] = 10 + i
    assert table.device_written[1].tolist() == [10 + i for i in range(len(DEVICE_WRITTEN))]
