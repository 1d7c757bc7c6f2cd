"""Determinism under other CPU kernel sets: each setting in a process of its own.

ATEN_CPU_CAPABILITY picks torch's vectorised kernels (default = no SIMD, avx2); MKL_ENABLE_INSTRUCTIONS=AVX2
sends MKL down its AVX2 gemm path, where a plain float64 [B, 6] @ [6, 16] row differs between B = 1
and B > 1 (also on AMD EPYC, where it broke `make test`). Under each: the batch-invariance
properties pass, the scripted talkers' hooks are row-invariant, and every talker publishes frames
byte-identical to this process's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtp_fsm.testing.determinism import WORKLOADS, run_all

ROOT = Path(__file__).resolve().parent.parent
KERNEL_SETS = {"aten-default": {"ATEN_CPU_CAPABILITY": "default"}, "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
               "mkl-avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}}
PROPERTIES = ("tests/test_engine_properties.py::test_frames_are_the_same_alone_or_batched",
              "tests/test_engine_properties.py::test_frames_do_not_depend_on_max_slots_or_slot_assignment")


def _env(setting: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")}
    env.update(KERNEL_SETS[setting], OMP_NUM_THREADS="1", MTP_FSM_MAX_EXAMPLES="12")
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


def _python(setting: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(setting), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def here() -> dict[str, dict]:
    return run_all(WORKLOADS, probed=())


@pytest.mark.parametrize("setting", KERNEL_SETS)
def test_frames_are_byte_identical_under_another_kernel_set(setting, here):
    done = _python(setting, "-m", "mtp_fsm.testing.determinism", "--probe", "scripted")
    assert done.returncode == 0, done.stderr[-3000:]
    there = json.loads(done.stdout)
    assert {n: r["problems"] for n, r in there.items() if r["problems"]} == {}
    differ = [n for n in WORKLOADS if there[n]["fingerprint"] != here[n]["fingerprint"]]
    assert differ == [], (f"frames differ under {setting} (torch kernels {there[WORKLOADS[0]]['capability']}) "
                          f"from this process's ({here[WORKLOADS[0]]['capability']}): {differ}")


@pytest.mark.parametrize("setting", KERNEL_SETS)
def test_invariance_properties_under_another_kernel_set(setting):
    done = _python(setting, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *PROPERTIES)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
