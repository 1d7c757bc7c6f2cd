"""The three designs run the same lifecycle: identical frames and finish reasons to the end."""

from __future__ import annotations

import pytest

from mtp_fsm.bench.drivers import BenchRequest, EngineDriver, check_same_frames, make_drivers
from mtp_fsm.lifecycle import FinishReason
from mtp_fsm.testing.scripted import ScriptedTalker, ScriptInputs

# (request id, inputs, max_frames, reason the request ends with)
CASES = [
    ("len", ScriptInputs((1, 2, 3)), 3, FinishReason.LENGTH),
    ("eos", ScriptInputs((4, 5, 6, 7), eos_at=2), 50, FinishReason.EOS),
    ("eos0", ScriptInputs((8, 9), eos_at=0), 50, FinishReason.EOS),  # EOS on the prefill step: no frame
    ("nan", ScriptInputs((10, 11, 12), nan_at=1), 50, FinishReason.ERROR),
    ("ctx", ScriptInputs((13,) * 6), 50, FinishReason.LENGTH),  # the context runs out first
    ("len1", ScriptInputs((14, 15)), 1, FinishReason.LENGTH),  # done on its first frame
]
MTP_NAN = ("mtp_nan", ScriptInputs((16, 17, 18), mtp_nan_at=2), 50, FinishReason.ERROR)


def _run(num_codebooks: int, cases, steps: int = 14):
    requests = [BenchRequest(rid, inputs, seed=100 + 17 * i, max_frames=m) for i, (rid, inputs, m, _) in enumerate(cases)]
    drivers = make_drivers(lambda: ScriptedTalker(num_codebooks=num_codebooks, max_context=12), requests)
    engine_finished, totals = {}, {name: [] for name in drivers}
    for step in range(steps):
        outputs = {}
        for name, d in drivers.items():
            out = d.admit() if step == 0 else d.step()
            outputs[name] = d.frames(out)
            if isinstance(d, EngineDriver):
                engine_finished.update({f.request_id: f.reason for f in out.finished})
        check_same_frames(outputs)
        for name, frames in outputs.items():
            totals[name] += frames
    return drivers, engine_finished, totals


@pytest.mark.parametrize("num_codebooks, cases", [(4, [*CASES, MTP_NAN]), (1, CASES)], ids=["mtp", "single_codebook"])
def test_designs_agree_through_eos_length_and_errors(num_codebooks, cases):
    drivers, engine_finished, totals = _run(num_codebooks, cases)
    want = {rid: reason for rid, _, _, reason in cases}
    assert engine_finished == want
    for name, d in drivers.items():
        if not isinstance(d, EngineDriver):
            assert d.finish_reasons() == want, name
    frames = {}
    for rid, index, _ in totals["engine"]:
        frames[rid] = frames.get(rid, 0) + 1
        assert index == frames[rid] - 1  # indices run 0, 1, 2, ... per request
    assert frames["len"] == 3 and frames["len1"] == 1 and frames["eos"] == 2 and "eos0" not in frames
    assert frames["nan"] == 1 and frames["ctx"] == 12 - 6 + 1
    if num_codebooks > 1:
        assert frames["mtp_nan"] == 2


def test_naive_step_bodies_name_no_trigger_or_state():
    import inspect

    from mtp_fsm.bench.drivers import DictLoopDriver, TransitionsDriver, _PerRequestDriver
    from mtp_fsm.lifecycle import State, Trigger

    for fn in (_PerRequestDriver.step, TransitionsDriver.run_phase, DictLoopDriver.run_phase):
        src = inspect.getsource(fn)
        assert "Trigger." not in src and "State." not in src, fn.__qualname__
        for label in [s.label for s in State] + [t.label for t in Trigger]:
            assert f'"{label}"' not in src and f"'{label}'" not in src, (fn.__qualname__, label)
