"""The Triton executor follows the spec too: with a mutated guard, the Triton engine (under
the interpreter on a CPU) publishes what the reference interpreter says for that spec."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from mtp_fsm.engine import LockstepEngine, SchedulingPolicy  # noqa: E402
from mtp_fsm.kernels import triton_kernels as TK  # noqa: E402
from mtp_fsm.lifecycle import Guard, State, Trigger, mtp_lifecycle, single_codebook_lifecycle  # noqa: E402
from mtp_fsm.sampling import SamplingParams  # noqa: E402
from mtp_fsm.testing.alone import RequestDef, scripted_mtp, scripted_single, torch_threads  # noqa: E402
from mtp_fsm.testing.interpreter import interpret  # noqa: E402
from mtp_fsm.testing.scripted import ScriptInputs  # noqa: E402

if TK.unsupported(torch.device("cpu")) is not None:
    pytest.skip("the scripted talkers run on the CPU; this needs the Triton interpreter", allow_module_level=True)


@pytest.mark.parametrize("variant", ["mtp", "single_codebook"])
def test_triton_engine_and_interpreter_follow_a_mutated_guard(variant):
    factory, declared = {"mtp": (scripted_mtp, mtp_lifecycle()),
                         "single_codebook": (scripted_single, single_codebook_lifecycle())}[variant]
    # EOS honoured only when it is NOT sampled: every kept sample ends the request at once.
    mutated = declared.with_edge(Trigger.EOS, State.SAMPLED if variant == "mtp" else State.FRAME_READY,
                                 guard=Guard(unless=("eos_sampled",)))
    defs = [RequestDef(ScriptInputs(tuple(range(i, i + 4)), eos_at=2 if i == 1 else None), 5, seed=i,
                       cb0=SamplingParams(0.9, 8, 0.9)) for i in range(3)]
    with torch_threads(1):
        engine = LockstepEngine(factory(), 2, kernels="triton", lifecycle=mutated, policy=SchedulingPolicy(64, 3))
        results = engine.generate([d.new_request(f"r{i}") for i, d in enumerate(defs)])
        for i, d in enumerate(defs):
            want, before = interpret(factory(), mutated, d), interpret(factory(), declared, d)
            got = results[f"r{i}"]
            assert ([tuple(f.codes.tolist()) for f in got.frames], got.finished.reason) == (list(want.frames), want.reason)
            assert (want.frames, want.reason) != (before.frames, before.reason)
