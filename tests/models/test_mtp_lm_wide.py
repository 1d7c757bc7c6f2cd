"""The MTP LM of realistic width (config.wide_config, bfloat16): >= 100M parameters, its wired
drafter accepted most of the time, and on this machine its speculative frames are plain
decoding's (its linears and attention are plain kernels, so that identity rests on their
rows not depending on the batch here; the engine's frames-equal properties are proven on the
batch-invariant tiny model)."""

from __future__ import annotations

import functools

import pytest
import torch

from mtp_fsm.engine import LockstepEngine, NewRequest, SchedulingPolicy
from mtp_fsm.sampling import SamplingParams
from mtp_fsm.testing.alone import torch_threads

TEXTS = ("Hello, this is the lockstep engine.", "abc", "Speculative decoding drafts with MTP.")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


@functools.lru_cache(maxsize=1)
def wide():
    from models.mtp_lm import wide_demo_talker

    return wide_demo_talker()


def generate(k: int, batch: int, sampling: SamplingParams, frames: int = 16):
    engine = LockstepEngine(wide(), batch, kernels="torch", speculate=k, policy=SchedulingPolicy(token_budget=256))
    try:
        with torch.inference_mode():
            out = engine.generate([NewRequest(f"r{i}", _inputs(TEXTS[i % 3]), frames, seed=i,
                                              cb0_sampling=sampling) for i in range(batch)])
        return {rid: [int(f.codes[0]) for f in g.frames] for rid, g in out.items()}, engine.speculation
    finally:
        engine.close()


def _inputs(text: str):
    from models.mtp_lm import MtpLMInputs

    return MtpLMInputs(text=text)


def test_the_wide_config_is_realistic():
    model = wide()
    cfg = model.config
    assert model.num_parameters() >= 100_000_000
    assert model.spec.dtype == torch.bfloat16 and cfg.hidden_size >= 768 and cfg.num_hidden_layers >= 12


@pytest.mark.parametrize("sampling", [SamplingParams(top_k=1), SamplingParams(temperature=0.9, top_k=50)],
                         ids=["greedy", "sampled"])
def test_speculative_frames_are_plain_decodings_and_drafts_are_mostly_accepted(sampling):
    plain, _ = generate(0, 3, sampling)
    alone, _ = generate(0, 1, sampling)
    spec, stats = generate(3, 3, sampling)
    assert spec == plain and alone["r0"] == plain["r0"]
    assert all(len(v) == 16 for v in plain.values())
    assert stats.acceptance_rate > 0.6, stats
