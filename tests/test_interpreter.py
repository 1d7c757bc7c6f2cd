"""The per-request reference interpreter against the engine: runs, sampler, real model, spec mutations."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from mtp_fsm.lifecycle import ALWAYS, FinishReason, Guard, Trigger, mtp_lifecycle, single_codebook_lifecycle
from mtp_fsm.lifecycle.variants import (
    conditioned_lifecycle, delay_pattern_lifecycle, mtp_stop_lifecycle, stop_head_lifecycle,
)
from mtp_fsm.sampling import GREEDY, SamplingParams, filter_mask, gumbel_noise_codebooks, sample_tokens
from mtp_fsm.sampling.noise import frame_key
from mtp_fsm.testing.alone import (
    AloneRun, RequestDef, run_alone, scripted_conditioned, scripted_delay, scripted_mtp, scripted_mtp_stop, scripted_single,
    scripted_stop_head, torch_threads,
)
from mtp_fsm.testing.interpreter import interpret, kept_ids, sample_row
from mtp_fsm.testing.scripted import ScriptInputs
from mtp_fsm.testing.stateful import scripted_requests

RUNS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VARIANTS = {"mtp": (scripted_mtp, mtp_lifecycle), "single": (scripted_single, single_codebook_lifecycle),
            "mtp_stop": (scripted_mtp_stop, mtp_stop_lifecycle),
            "conditioned": (scripted_conditioned, conditioned_lifecycle),
            "delay_pattern": (scripted_delay, delay_pattern_lifecycle),
            "stop_head": (scripted_stop_head, stop_head_lifecycle)}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


def both(factory, spec, definition: RequestDef) -> tuple[AloneRun, AloneRun]:
    """(engine alone run, interpreter run) of one request, both under lifecycle `spec`."""
    engine = run_alone(factory, definition, kernels="torch", lifecycle=spec)
    return engine, interpret(factory(), spec, definition)


# -- whole requests: the interpreter against the engine ---------------------------------------


def _equal_to_engine(variant: str):
    factory, lifecycle = VARIANTS[variant]

    @RUNS
    @given(scripted_requests(factory().spec))
    def check(definition):
        engine, interpreted = both(factory, lifecycle(), definition)
        assert interpreted == engine, f"{definition}\n  engine:      {engine}\n  interpreter: {interpreted}"

    return check


test_scripted_mtp_matches_engine = _equal_to_engine("mtp")
test_scripted_single_matches_engine = _equal_to_engine("single")
test_scripted_mtp_stop_matches_engine = _equal_to_engine("mtp_stop")
test_scripted_conditioned_matches_engine = _equal_to_engine("conditioned")
test_scripted_delay_pattern_matches_engine = _equal_to_engine("delay_pattern")
test_scripted_stop_head_matches_engine = _equal_to_engine("stop_head")


@pytest.mark.parametrize("definition, expected", [
    (RequestDef(ScriptInputs((5, 6, 7), eos_at=2), 6, 1), (2, FinishReason.EOS, None)),
    (RequestDef(ScriptInputs((5, 6, 7), nan_at=1), 6, 1), (1, FinishReason.ERROR, "cb0")),
    (RequestDef(ScriptInputs((5, 6, 7), mtp_nan_at=0), 6, 1), (0, FinishReason.ERROR, "mtp")),
    # The context (96 positions) runs out before the budget: frames at num_computed 90..96.
    (RequestDef(ScriptInputs((1,) * 90), 50, 3), (7, FinishReason.LENGTH, None)),
], ids=["eos", "cb0-nan", "mtp-nan", "context"])
def test_scripted_endings(definition, expected):
    engine, interpreted = both(scripted_mtp, mtp_lifecycle(), definition)
    assert interpreted == engine
    assert (len(interpreted.frames), interpreted.reason, interpreted.error_kind) == expected


# -- the sampler alone: per-row plain torch against the batched engine sampler ---------------


@st.composite
def sampling_batches(draw):
    b, v = draw(st.integers(1, 6)), draw(st.integers(2, 80))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if draw(st.booleans()):  # integer logits: many exact ties in scores and in the top-p threshold
        logits = torch.randint(-3, 4, (b, v), generator=g).float()
    else:
        logits = torch.randn(b, v, generator=g) * draw(st.sampled_from([0.01, 1.0, 8.0, 1e30]))
    for row in range(b):
        kind = draw(st.sampled_from(["ok"] * 5 + ["nan", "inf", "-inf", "masked", "all-masked"]))
        if kind == "masked":  # a model masking ids with -inf (suppress_tokens): not a fault
            logits[row, torch.rand(v, generator=g) < 0.5] = float("-inf")
        elif kind == "all-masked":  # nothing left to sample: a fault
            logits[row] = float("-inf")
        elif kind != "ok":
            logits[row, draw(st.integers(0, v - 1))] = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}[kind]
    temps = st.sampled_from([0.0, 0.0, 1e-30, 0.3, 0.9, 1.0, 1.7])
    top_ps = st.sampled_from([1.0, 0.9999999999, 0.95, 0.5, 0.1, 1e-6, 1e-9])
    params = [SamplingParams(draw(temps), draw(st.integers(0, v + 2)), draw(top_ps)) for _ in range(b)]
    seeds = draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=b, max_size=b))
    frames = draw(st.lists(st.integers(0, 600), min_size=b, max_size=b))
    allowed = None
    if draw(st.booleans()):
        allowed = torch.tensor(draw(st.lists(st.booleans(), min_size=v, max_size=v)))
        allowed[draw(st.integers(0, v - 1))] = True
    return logits, params, seeds, frames, draw(st.integers(0, 15)), allowed


@settings(max_examples=200, deadline=None)
@given(sampling_batches(), st.booleans())
def test_sampler_matches_engine_sampler(batch, shortcuts):
    logits, params, seeds, frames, codebook, allowed = batch
    col = {
        "temperature": torch.tensor([p.temperature for p in params], dtype=torch.float32),
        "top_k": torch.tensor([p.top_k for p in params], dtype=torch.int64),
        "top_p": torch.tensor([p.top_p for p in params], dtype=torch.float32),
        "seed": torch.tensor(seeds, dtype=torch.int64), "frame_index": torch.tensor(frames, dtype=torch.int64),
    }
    extra = {}
    if shortcuts:  # what the engine's staging derives from the rows (host facts, never results)
        k_max, any_p = max(p.top_k for p in params), any(p.top_p < 1.0 for p in params)
        key = frame_key(col["seed"], col["frame_index"])
        noise = gumbel_noise_codebooks(key, codebook, 1, logits.shape[1])[0]
        extra = dict(apply_filters=k_max > 0 or any_p, top_k_max=k_max, any_top_p=any_p, key=key, noise=noise)
    tokens, fault = sample_tokens(logits, *col.values(), codebook, allowed=allowed, **extra)
    for row, p in enumerate(params):
        mine = sample_row(logits[row], p, seeds[row], frames[row], codebook, allowed)
        assert mine == (int(tokens[row]), int(fault[row])), f"row {row} {p}: {mine} vs engine {tokens[row], fault[row]}"


@settings(max_examples=200, deadline=None)
@given(sampling_batches())
def test_kept_set_matches_engine_filter(batch):
    logits, params, _, _, _, allowed = batch
    scores = torch.nan_to_num(logits, nan=0.0, posinf=0.0, neginf=float("-inf"))
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    scores = scores / torch.tensor([p.temperature or 1.0 for p in params])[:, None]  # greedy rows: raw
    engine = filter_mask(scores, torch.tensor([p.top_k for p in params]),
                         torch.tensor([p.top_p for p in params], dtype=torch.float32))
    for row, p in enumerate(params):
        real = scores[row] > float("-inf")  # a -inf score loses whether it is "kept" or not
        assert torch.equal(kept_ids(scores[row], p.top_k, p.top_p) & real, engine[row] & real), p


def test_top_p_boundary_is_strict_and_float32():
    # Fixed-point weights 2**24, 2**24 - 4096 and 4096: with top_p = 0.5 the second id's mass
    # before (2**24) is exactly half the total, so it is not < top_p and is dropped.
    scores = torch.tensor([0.0, -1 / 4096, -34069 / 4096])
    # A fourth id of weight 1 tips the balance, but only for top_p taken in float32 as the
    # engine stores it: float32(0.5 - 2**-27) is 0.5, in float64 floor(p * 2**24) is 2**23 - 1.
    tipped = torch.tensor([0.0, -1 / 4096, -34069 / 4096, -64449 / 4096])
    cases = ((scores, 0.5, [1, 0, 0]), (scores, 0.5000001, [1, 1, 0]), (tipped, 0.5 - 2**-27, [1, 1, 0, 0]))
    for row, top_p, expected in cases:
        engine = filter_mask(row[None], torch.tensor([0]), torch.tensor([top_p], dtype=torch.float32))[0]
        assert kept_ids(row, 0, top_p).tolist() == engine.tolist() == [bool(e) for e in expected], top_p


# -- the tiny Qwen3-TTS model ----------------------------------------------------------------


def qwen_tiny():
    from models.qwen3_tts import Qwen3TTSTalker, tiny_config

    return Qwen3TTSTalker(tiny_config(), seed=0)


@pytest.mark.parametrize("text, max_frames, seed, cb0, mtp", [
    ("Hi there", 40, 1, SamplingParams(0.9, 50, 1.0), SamplingParams(0.9, 50, 1.0)),
    ("Second!", 5, 7, SamplingParams(0.8, 0, 0.7), GREEDY),
    ("abc", 40, 2**40, SamplingParams(1.0, 20, 0.9), SamplingParams(0.7, 0, 0.8)),
])
def test_qwen3_tts_matches_engine(text, max_frames, seed, cb0, mtp):
    from models.qwen3_tts import TTSInputs

    definition = RequestDef(TTSInputs(text=text), max_frames, seed, cb0, mtp)
    engine, interpreted = both(qwen_tiny, mtp_lifecycle(), definition)
    assert interpreted == engine
    assert interpreted.frames and all(len(f) == 16 for f in interpreted.frames)


# -- the interpreter follows the spec it is given --------------------------------------------


def _replace_guard(spec, trigger: Trigger, guard: Guard):
    edges = tuple(attrs.evolve(t, guard=guard) if t.trigger is trigger else t for t in spec.transitions)
    return attrs.evolve(spec, name=f"{spec.name}-mutated", transitions=edges)


PLAIN = RequestDef(ScriptInputs((3, 1, 4, 1, 5)), 6, 9)


def test_length_guard_always_stops_after_one_frame():
    spec = _replace_guard(mtp_lifecycle(), Trigger.FINISH_LENGTH, ALWAYS)
    normal = interpret(scripted_mtp(), mtp_lifecycle(), PLAIN)
    mutated = interpret(scripted_mtp(), spec, PLAIN)
    assert len(normal.frames) == 6 and normal.reason is FinishReason.LENGTH
    assert mutated == AloneRun(normal.frames[:1], FinishReason.LENGTH, None)
    engine, _ = both(scripted_mtp, spec, PLAIN)  # the engine compiles the same mutation
    assert engine == mutated


def test_inverted_eos_guard():
    spec = _replace_guard(mtp_lifecycle(), Trigger.EOS, Guard(unless=("eos_sampled",)))
    # No EOS is ever sampled: the inverted guard ends the request at once, with no frame.
    assert interpret(scripted_mtp(), spec, PLAIN) == AloneRun((), FinishReason.EOS, None)
    # A forced EOS at frame 0 is now kept as a frame (CB0 clamped into the codebook), then EOS.
    forced = RequestDef(ScriptInputs((3, 1, 4), eos_at=0), 6, 9)
    normal, mutated = interpret(scripted_mtp(), mtp_lifecycle(), forced), interpret(scripted_mtp(), spec, forced)
    assert normal == AloneRun((), FinishReason.EOS, None)
    size = scripted_mtp().spec.codebook_size
    assert len(mutated.frames) == 1 and mutated.frames[0][0] == size - 1 and mutated.reason is FinishReason.EOS
    # (run_alone holds a scripted run to the unmutated script, so only PLAIN goes to the engine.)
    engine, interpreted = both(scripted_mtp, spec, PLAIN)
    assert engine == interpreted
