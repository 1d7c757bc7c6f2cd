"""The step inputs' persistent buffers hold exactly what a fresh, separately written build of the
rows gives, whatever rows came before (growth, shrinking, padding), and a steady batch is held."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from mtp_fsm.engine.plan import Span
from mtp_fsm.engine.step_inputs import StepInputs
from mtp_fsm.sampling import SamplingParams
from mtp_fsm.testing.scripted import ScriptedTalker

SCRATCH = 7


class _Record:
    """The fields StepInputs reads from a RequestRecord."""

    def __init__(self, slot: int, serial: int, top_k: int, prefill: bool) -> None:
        self.slot, self.serial, self.min_frames, self.in_prefill = slot, serial, 0, prefill
        self.sampling = (SamplingParams(top_k=top_k), SamplingParams())


def _reference(rows, records) -> dict[str, list[int]]:
    """The vectors as the StepBatch contract defines them, built row by row."""
    counts = [0 if s is None else s.num_tokens for s in rows]
    qsl = [0]
    for n in counts:
        qsl.append(qsl[-1] + n)
    token_rows = [i for i, n in enumerate(counts) for _ in range(n)]
    return {
        "idx_mapping": [SCRATCH if r is None else r.slot for r in records],
        "is_padding": [s is None for s in rows],
        "expected_serial": [0 if r is None else r.serial for r in records],
        "num_scheduled": counts,
        "query_start_loc": qsl,
        "token_rows": token_rows,
        "token_offsets": [t - qsl[row] for t, row in enumerate(token_rows)],
        "last_token": [max(qsl[i + 1] - 1, 0) for i in range(len(rows))],
    }


_row = st.one_of(st.none(), st.tuples(st.integers(1, 40), st.integers(0, 3), st.booleans()))


@settings(deadline=None, max_examples=60)
@given(steps=st.lists(st.lists(_row, max_size=12), min_size=1, max_size=5))
def test_loaded_rows_equal_a_fresh_build_whatever_came_before(steps):
    inputs = StepInputs(SCRATCH, ScriptedTalker().spec, torch.device("cpu"))
    for generation, step in enumerate(steps):
        rows = tuple(None if r is None else Span(f"r{i}", r[0]) for i, r in enumerate(step))
        records = [None if r is None else _Record(i % SCRATCH, 10 + i, r[1], r[2]) for i, r in enumerate(step)]
        loaded = inputs.load(rows, records, generation, steady=False)
        batch = loaded.batch
        for name, want in _reference(rows, records).items():
            assert getattr(batch, name).tolist() == want, name
        assert batch.is_padding.dtype == torch.bool and batch.num_tokens == sum(batch.num_scheduled.tolist())
        assert batch.has_prefill == any(r is not None and r.in_prefill for r in records)
        assert batch.cb0_top_k_max == max((r.sampling[0].top_k for r in records if r is not None), default=0)
        assert loaded.query_start_loc.tolist() == _reference(rows, records)["query_start_loc"]
        assert inputs.holds(rows, generation) is None  # loaded as not steady: validated again next step


def test_a_steady_batch_is_held_until_the_generation_or_the_rows_change():
    inputs = StepInputs(SCRATCH, ScriptedTalker().spec, torch.device("cpu"))
    rows = (Span("a", 1), None, Span("b", 1))
    records = [_Record(0, 1, 0, False), None, _Record(3, 2, 0, False)]
    loaded = inputs.load(rows, records, 4, steady=True)
    assert inputs.holds((Span("a", 1), None, Span("b", 1)), 4) is loaded
    assert inputs.holds(rows, 5) is None
    assert inputs.holds((Span("a", 1), Span("b", 1)), 4) is None
