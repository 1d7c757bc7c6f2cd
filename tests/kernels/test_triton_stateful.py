"""The lifecycle state machine with the Triton backend (interpreter on a CPU): the engine's
Triton executor of the compiled chains against the oracle driver and the reference
interpreter, both variants. Fewer examples than the torch run (the interpreter is slow);
the torch run in tests/test_stateful.py covers every declared edge."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

pytest.importorskip("triton")

from mtp_fsm.kernels import triton_kernels as TK  # noqa: E402
from mtp_fsm.testing.alone import scripted_delay, scripted_mtp, scripted_single, torch_threads  # noqa: E402
from mtp_fsm.testing.stateful import LifecycleMachine  # noqa: E402

DEVICE = torch.device("cpu") if TK.interpreted() else torch.device("cuda")
if TK.unsupported(DEVICE) is not None:
    pytest.skip(f"Triton backend unusable here: {TK.unsupported(DEVICE)}", allow_module_level=True)

SETTINGS = settings(max_examples=4, stateful_step_count=14, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.mark.parametrize("factory", [scripted_mtp, scripted_single, scripted_delay],
                         ids=["mtp", "single_codebook", "delay_pattern"])
def test_lifecycle_machine_on_triton(factory):
    if DEVICE.type != "cpu":
        pytest.skip("the scripted talkers run on the CPU; `make gpu-check` covers the GPU")
    with torch_threads(1):
        run_state_machine_as_test(lambda: LifecycleMachine(factory, kernels="triton"), settings=SETTINGS)
