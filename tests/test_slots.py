"""The slot allocator (deterministic, lowest free first) and the slot table (every column
re-initialised on admit)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mtp_fsm.engine import LockstepEngine, NewRequest, Span, StepPlan
from mtp_fsm.kernels.contract import StagedAdmits
from mtp_fsm.kernels.reference import apply_admits
from mtp_fsm.lifecycle import FinishReason, State, Trigger, compile_lifecycle, mtp_lifecycle
from mtp_fsm.model_api import ColumnSpec, PreparedPrompt
from mtp_fsm.slots import (
    ERR_ILLEGAL, PROGRESS_COMPUTED, PROGRESS_FRAMES, PROGRESS_MAX_FRAMES, PROGRESS_PROMPT_LEN, PROGRESS_SERIAL, WORD_ERROR,
    WORD_FAULT, WORD_REASON, WORD_STATE, SlotAllocator, SlotTable,
)
from mtp_fsm.testing import ScriptedTalker, ScriptInputs

SPEC = ScriptedTalker().spec


# -- allocator ----------------------------------------------------------------------------


def test_lowest_free_slot_first():
    a = SlotAllocator(4)
    assert [a.allocate() for _ in range(4)] == [0, 1, 2, 3]
    assert a.allocate() is None and a.num_free == 0
    a.release(2)
    a.release(0)
    assert a.in_use() == {1, 3} and a.num_free == 2
    assert a.allocate() == 0 and a.allocate() == 2


def test_double_release_and_foreign_release_are_errors():
    a = SlotAllocator(2)
    slot = a.allocate()
    a.release(slot)
    with pytest.raises(ValueError, match="double release"):
        a.release(slot)
    with pytest.raises(ValueError, match="slot 1 is not allocated"):
        a.release(1)
    assert a.num_free == 2


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=40))
def test_allocator_is_deterministic_and_matches_a_sorted_model(max_slots, ops):
    """Two allocators fed the same events agree on every slot, and both always hand out
    min(free) (the property that keeps tensor-parallel ranks in step)."""
    a, b = SlotAllocator(max_slots), SlotAllocator(max_slots)
    free = set(range(max_slots))
    for allocate, pick in ops:
        if allocate:
            got = a.allocate()
            assert got == b.allocate() == (min(free) if free else None)
            free.discard(got)
        elif max_slots - len(free):
            slot = sorted(set(range(max_slots)) - free)[pick % (max_slots - len(free))]
            a.release(slot)
            b.release(slot)
            free.add(slot)
        assert a.in_use() == b.in_use() == set(range(max_slots)) - free
        assert a.num_free + len(a.in_use()) == max_slots


def test_engine_allocates_the_same_slots_for_the_same_events():
    def run():
        e = LockstepEngine(ScriptedTalker(), 3, kernels="torch")
        reqs = [NewRequest(f"r{i}", ScriptInputs((i, 1)), max_frames=1) for i in range(3)]
        e.step(StepPlan(new_requests=tuple(reqs), rows=(Span("r1", 2),)))
        e.step(StepPlan(releases=("r1",), aborts=("r0",), new_requests=(NewRequest("r3", ScriptInputs((5,)), 1),)))
        return {rid: r.slot for rid, r in e.ledger.records.items()}

    assert run() == run() == {"r2": 2, "r3": 0}


# -- slot table ----------------------------------------------------------------------------


def test_table_shapes_dtypes_and_scratch_row():
    extra = {"cursor": ColumnSpec((), torch.int64, -1.0), "buf": ColumnSpec((3, 2), torch.float32, 0.5)}
    t = SlotTable.allocate(4, SPEC, "cpu", extra)
    cols = t.columns()
    assert all(c.shape[0] == 5 for c in cols.values())  # max_slots + 1 (scratch)
    assert t.frame_embed.shape == (5, SPEC.hidden_size) and t.frame_embed.dtype == SPEC.dtype
    assert t.frame_codes.shape == (5, SPEC.num_codebooks) and t.frame_log.shape == (5, SPEC.max_context, SPEC.num_codebooks)
    assert t.prompt_embeds.shape == (5, SPEC.max_context, SPEC.hidden_size)
    assert t.state.dtype == torch.int32 and t.error.dtype == torch.int32 and t.seed.dtype == torch.int64
    assert (t.extra["cursor"] == -1).all() and (t.extra["buf"] == 0.5).all() and t.extra["buf"].shape == (5, 3, 2)
    assert (t.state == State.FREE).all() and not t.error.any()
    row = t.row(2)
    row["seed"] += 1
    assert int(t.seed[2]) == 0  # row() returns copies


def test_blocked_columns_are_views_of_their_block_rows_and_clone_keeps_them():
    """state..fault and serial..max_frames live in one block each (the stages gather a block
    at once): a write through a column shows in its block's row at the row constant, and a
    clone (also onto another device) is again one block, not separate copies."""
    t = SlotTable.allocate(3, SPEC)
    words, progress = "lifecycle_words", "progress"
    rows = {"state": (words, WORD_STATE), "finish_reason": (words, WORD_REASON), "error": (words, WORD_ERROR),
            "fault": (words, WORD_FAULT), "serial": (progress, PROGRESS_SERIAL),
            "prompt_len": (progress, PROGRESS_PROMPT_LEN), "num_computed": (progress, PROGRESS_COMPUTED),
            "num_frames": (progress, PROGRESS_FRAMES), "max_frames": (progress, PROGRESS_MAX_FRAMES)}
    assert words not in t.columns() and progress not in t.columns()
    for table in (t, t.clone("cpu")):
        for i, (name, (block, row)) in enumerate(rows.items()):
            table.columns()[name][1] = 10 + i
            assert int(getattr(table, block)[row, 1]) == 10 + i, name
    assert not t.lifecycle_words[:, 1].eq(0).all()
    c = t.clone()
    c.state[1] = 99
    assert int(t.state[1]) != 99  # a copy, not a view of the original


def test_table_rejects_bad_sizes_and_clashing_columns():
    with pytest.raises(ValueError, match="max_slots must be >= 1"):
        SlotTable.allocate(0, SPEC)
    with pytest.raises(ValueError, match="'seed' clashes"):
        SlotTable.allocate(2, SPEC, "cpu", {"seed": ColumnSpec((), torch.int64)})


def test_column_defaults():
    t = SlotTable.allocate(2, SPEC)
    d = t.column_defaults()
    assert set(d) == set(t.columns()) - {"state", "error"}  # admission itself writes those two
    assert d["finish_reason"] == FinishReason.NONE and d["seed"] == 0.0


def _garbage(t: SlotTable, slot: int) -> None:
    g = torch.Generator().manual_seed(slot)
    for name, col in t.columns().items():
        if col.dtype.is_floating_point:
            col[slot] = torch.randn(col[slot].shape, generator=g).to(col.dtype) + 3.0
        else:
            col[slot] = torch.randint(1, 7, col[slot].shape, generator=g).to(col.dtype)
    t.state[slot] = State.FINISHED  # a legal admit source is FREE; set it back below


def test_every_column_is_reinitialised_on_admit():
    """A row full of a previous owner's data is admitted: each column is exactly what
    admission writes, or the fresh-row default; nothing of the previous owner survives."""
    extra = {"cursor": ColumnSpec((), torch.int64, 0.0), "buf": ColumnSpec((4,), torch.float32, 0.0)}
    t = SlotTable.allocate(3, SPEC, "cpu", extra)
    for slot in range(3):
        _garbage(t, slot)
        t.state[slot] = State.FREE
    slots = torch.tensor([2, 0])
    values = {
        "serial": torch.tensor([5, 6]), "seed": torch.tensor([-9, 9]), "prompt_len": torch.tensor([3, 1]),
        "prompt_embeds": torch.ones(2, 3, SPEC.hidden_size, dtype=SPEC.dtype),  # shorter leading dim
        "buf": torch.tensor([[1.0, 2.0], [3.0, 4.0]]),  # shorter leading dim of a model column
    }
    untouched = t.row(1)
    apply_admits(t, compile_lifecycle(mtp_lifecycle()).to("cpu"), StagedAdmits(slots, values, int(Trigger.ADMIT)))
    defaults = t.column_defaults()
    for i, slot in enumerate(slots.tolist()):
        for name, col in t.columns().items():
            got = col[slot]
            if name == "prompt_embeds":
                assert (got[:3] == 1).all() and not got[3:].any()
            elif name == "buf":
                assert got.tolist() == [*values["buf"][i].tolist(), 0.0, 0.0]
            elif name in values:
                assert torch.equal(got, values[name][i].to(col.dtype)), name
            elif name == "error":
                assert int(got) == 0
            elif name == "state":
                assert int(got) == State.WAITING  # admit's destination in the table
            else:
                assert (got == defaults[name]).all(), f"column {name} kept the previous owner's data"
    for name, value in untouched.items():  # a row not admitted is not touched
        assert torch.equal(t.columns()[name][1], value), name


def test_admitting_a_row_that_is_not_free_sets_the_sticky_error():
    t = SlotTable.allocate(2, SPEC)
    t.state[1] = State.DECODING
    apply_admits(t, compile_lifecycle(mtp_lifecycle()).to("cpu"), StagedAdmits(torch.tensor([1]), {}, int(Trigger.ADMIT)))
    assert int(t.error[1]) == ERR_ILLEGAL and int(t.state[1]) == State.DECODING


class LeanScripted(ScriptedTalker):
    """Leaves out the columns whose declared fill already says what it wants (-1 = never)."""

    def prepare(self, inputs):
        p = super().prepare(inputs)
        return PreparedPrompt(p.prompt_embeds, {k: v for k, v in p.columns.items() if k in ("prompt_len0", "text_key")})


def test_model_columns_not_set_at_admission_get_their_declared_fill():
    # Regression: a model column the model leaves out of PreparedPrompt.columns was reset to
    # 0 instead of its ColumnSpec fill; the scripted talker's eos_at=-1 ("never") became 0
    # and the request ended with EOS before its first frame.
    e = LockstepEngine(LeanScripted(), 2, kernels="torch")
    out = e.step(StepPlan(new_requests=(NewRequest("a", ScriptInputs((1, 2, 3)), max_frames=3),), rows=(Span("a", 3),)))
    assert int(e.table.extra["eos_at"][0]) == -1 and int(e.table.extra["nan_at"][0]) == -1
    assert len(out.frames) == 1 and out.finished == ()
