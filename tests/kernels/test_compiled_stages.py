"""kernels="compiled" (the reference's lifecycle stages compiled by TorchInductor) vs the torch
reference: twin engines on the same plans publish the same frames and hold bit-equal slot
tables after every step (admission, chunked prefill, decode, preemption and resume, aborts,
EOS, NaN faults in CB0 and MTP) and every batch size the plans make (static, then dynamic
shapes). One lifecycle (the default MTP one): the stages are lifecycle-generic, and each
further variant costs a cold compile of about a minute."""

from __future__ import annotations

import pytest
import torch

from mtp_fsm.engine import LockstepEngine
from mtp_fsm.gpu.step_harness import lockstep_plans, outputs_equal, scripted_requests, tables_equal
from mtp_fsm.kernels import compiled, reference, select_backend
from mtp_fsm.testing import ScriptedTalker

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(autouse=True)
def _every_call_compiled():
    # Past the recompile limit dynamo would run a stage eagerly (the reference itself) and the
    # comparison would prove nothing: make that an error instead.
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield


def test_backend_is_selected_by_name():
    assert select_backend("compiled", torch.device("cpu")) is compiled
    assert select_backend("auto", torch.device("cpu")) is reference


def _twins_in_lockstep(max_slots: int, max_context: int, requests: int, max_frames: int, steps: int):
    """Torch and compiled engines stepped on the same plans and compared after every step.
    Returns the torch engine's outputs and whether every request ended within `steps`."""
    engines = [LockstepEngine(ScriptedTalker(max_context=max_context), max_slots, kernels=k)
               for k in ("torch", "compiled")]
    pending, state, outputs = scripted_requests(requests, max_frames=max_frames), {}, []
    for step in range(steps):
        plan, done = lockstep_plans(engines[0], pending, state)
        if done:
            return outputs, True
        a, b = (e.step(plan) for e in engines)
        assert outputs_equal(a, b), f"{max_slots} slots, step {step}: outputs differ"
        assert tables_equal(engines[0].table, engines[1].table) == [], f"{max_slots} slots, step {step}"
        outputs.append(a)
    return outputs, False


def test_compiled_stages_equal_the_reference():
    outputs, done = _twins_in_lockstep(3, max_context=96, requests=7, max_frames=7, steps=80)
    frames = sum(len(out.frames) for out in outputs)
    reasons = {f.reason.name.lower() for out in outputs for f in out.finished}
    assert done and frames > 20
    assert {"eos", "length", "error", "abort"} <= reasons, reasons  # every ending ran compiled


@pytest.mark.parametrize("slots", [(2, 5)])
def test_compiled_stages_serve_tables_of_every_size(slots):
    """Engines of different table sizes share the compiled stages (dynamic in the slot count
    once a second size is seen). Regression: a blocked column (`SlotTable.progress` row) read
    through its own view attribute inside a compiled stage made the generalised graph's guard
    fail ('sources must not be empty'); the stages reach those columns through their block."""
    torch._dynamo.reset()  # the first size compiles static whatever ran before in this process
    for max_slots in slots:
        _twins_in_lockstep(max_slots, max_context=64, requests=max_slots + 1, max_frames=4, steps=30)
