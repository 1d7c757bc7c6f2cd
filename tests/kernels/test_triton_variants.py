"""The Triton backend runs every lifecycle variant's engine like the torch one (interpret mode on
the CPU): MTP-decided stops, the deferred schedule, the conditioning feed, the delay pattern, the stop head's float payload."""

from __future__ import annotations

import pytest
import torch

from mtp_fsm.engine import LockstepEngine, NewRequest, SchedulingPolicy  # noqa: E402
from mtp_fsm.sampling import SamplingParams  # noqa: E402
from mtp_fsm.testing import ScriptInputs  # noqa: E402
from mtp_fsm.testing.alone import (  # noqa: E402
    scripted_conditioned, scripted_delay, scripted_mtp_stop, scripted_mtp_stop_deferred, scripted_stop_head,
    torch_threads,
)

REQUESTS = [
    NewRequest("a", ScriptInputs((1, 2, 3, 4, 5), feed=(3, 4)), 5, 1, SamplingParams(), SamplingParams(0.8, 4, 0.9)),
    NewRequest("b", ScriptInputs((7, 8), eos_at=2, feed=(5,), feed_upfront=0), 5, 2),
    NewRequest("c", ScriptInputs((9,), mtp_nan_at=1, feed=(6, 7, 8)), 5, 3),
    NewRequest("d", ScriptInputs((4, 4, 4), nan_at=2, feed=(1, 2, 3, 4)), 5, 4),
]


def run(factory, kernels: str):
    model = factory()
    engine = LockstepEngine(model, 2, kernels=kernels, policy=SchedulingPolicy(token_budget=6, prefill_chunk=2,
                                                                               preempt_after_steps=1))
    for r in REQUESTS:
        engine.add_request(r)
    log, fed = [], False
    for step in range(200):
        out = engine.step()
        if out is None:
            if fed or not engine.ledger.records:
                break
            engine.feed("b", model.feed_rows((5,)), done=True)  # the starved request's row arrives
            fed = True
            continue
        log += [(step, f.request_id, f.index, tuple(f.codes.tolist())) for f in out.frames]
        log += [(step, f.request_id, f.reason, f.detail) for f in out.finished]
    return log


@pytest.mark.parametrize("factory", [scripted_mtp_stop, scripted_mtp_stop_deferred, scripted_conditioned,
                                     scripted_delay, scripted_stop_head],
                         ids=["mtp_stop", "mtp_stop_deferred", "conditioned", "delay_pattern", "stop_head"])
def test_triton_engine_equals_torch_engine(factory):
    if torch.cuda.is_available():
        pytest.skip("the scripted talkers run on the CPU; `make gpu-check` covers the GPU")
    with torch_threads(1):
        assert run(factory, "triton") == run(factory, "torch")
