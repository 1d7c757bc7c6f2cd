"""Determinism workloads: every talker and scripted variant run under the row-invariance probe, frames fingerprinted.

`python -m mtp_fsm.testing.determinism [NAME ...] [--probe all|scripted|none]` prints one JSON object: per workload, the
row-invariance problems, the hooks checked with two rows or more, and a SHA-256 of every
published frame (request id, index, codes and payload bits). tests/test_kernel_sets.py runs
it in processes with other CPU kernel sets (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS)
and holds the fingerprints equal to this process's.
"""

from __future__ import annotations

import argparse
import hashlib
import json

import attrs
import torch

from .._util.threads import torch_threads
from ..engine import LockstepEngine, NewRequest, SchedulingPolicy
from ..model_api import TalkerModel
from .alone import (
    scripted_conditioned, scripted_delay, scripted_mtp, scripted_mtp_stop, scripted_mtp_stop_deferred, scripted_single,
    scripted_stop_head,
)
from .row_invariance import RowInvarianceProbe
from .scripted import ScriptInputs

TEXTS = ("Hello there.", "The quick brown fox jumps.", "Turn left.", "Rain later today, maybe.", "Hi.")
SCRIPTED = {"scripted_mtp": scripted_mtp, "scripted_single": scripted_single, "scripted_mtp_stop": scripted_mtp_stop,
            "scripted_deferred": scripted_mtp_stop_deferred, "scripted_conditioned": scripted_conditioned,
            "scripted_delay": scripted_delay, "scripted_stop_head": scripted_stop_head}
# The shipped talkers (short names of mtp_fsm.serving.model_loader), loaded by import string.
TALKERS = ("qwen3_tts", "qwen3_omni", "moss_tts_local", "chatterbox", "higgs_audio_v3", "voxcpm2", "mtp_lm")
WORKLOADS = (*SCRIPTED, *TALKERS, "mtp_lm_speculative")


@attrs.frozen
class Workload:
    model: TalkerModel
    requests: tuple[NewRequest, ...]
    speculate: int = 0


def _scripted_inputs(i: int, conditioned: bool) -> ScriptInputs:
    prompt = tuple(range(3 + 2 * i, 3 + 2 * i + 2 + 3 * i))
    feed = tuple(range(5 + i, 12 + i)) if conditioned else ()
    return ScriptInputs(prompt=prompt, eos_at=4 + i if i % 2 else None, feed=feed)


def workload(name: str, num_requests: int = 5, max_frames: int = 6) -> Workload:
    if name in SCRIPTED:
        model = SCRIPTED[name]()
        inputs = [_scripted_inputs(i, name == "scripted_conditioned") for i in range(num_requests)]
        speculate = 0
    else:
        from ..serving.model_loader import load_talker

        talker = load_talker(name.removesuffix("_speculative"), seed=0)
        model, inputs = talker.model, [talker.text_inputs(TEXTS[i % len(TEXTS)]) for i in range(num_requests)]
        speculate = 2 if name.endswith("_speculative") else 0
    requests = tuple(NewRequest(f"r{i}", inputs[i], max_frames=max_frames, seed=11 + i) for i in range(num_requests))
    return Workload(model, requests, speculate)


def fingerprint(generations) -> str:
    digest = hashlib.sha256()
    for rid in sorted(generations):
        for frame in generations[rid].frames:
            digest.update(f"{rid}:{frame.index}:".encode())
            digest.update(frame.codes.numpy().tobytes())
    return digest.hexdigest()


def run(name: str, *, probe: bool = True, max_slots: int = 4) -> dict:
    """One workload through the engine (chunked prefill beside decode rows, 4 slots)."""
    load = workload(name)
    watcher = RowInvarianceProbe(load.model) if probe else None
    engine = LockstepEngine(load.model, max_slots, kernels="torch", speculate=load.speculate,
                            policy=SchedulingPolicy(token_budget=24, prefill_chunk=7))
    try:
        with torch_threads(1):
            generations = engine.generate(load.requests)
    finally:
        engine.close()
        if watcher is not None:
            watcher.close()
    return {"fingerprint": fingerprint(generations), "frames": sum(len(g.frames) for g in generations.values()),
            "problems": watcher.problems[:20] if watcher else [], "batched_calls": dict(watcher.calls) if watcher else {},
            "capability": torch.backends.cpu.get_cpu_capability()}


def run_all(names: tuple[str, ...] = WORKLOADS, probed: tuple[str, ...] = WORKLOADS) -> dict[str, dict]:
    """Every workload in `names`, those in `probed` under the row-invariance probe."""
    return {name: run(name, probe=name in probed) for name in names}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(WORKLOADS), help="workloads (default: all)")
    parser.add_argument("--probe", choices=("all", "scripted", "none"), default="all",
                        help="which workloads run under the row-invariance probe (the rest: fingerprints only)")
    args = parser.parse_args(argv)
    probed = {"all": WORKLOADS, "scripted": tuple(SCRIPTED), "none": ()}[args.probe]
    print(json.dumps(run_all(tuple(args.names), probed), sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
