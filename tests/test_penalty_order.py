"""Where the CB0 repetition penalty acts (ModelSpec.repetition_penalty_order, issue 31 mismatch 2).

Qwen3-TTS (HF `generate`) penalises the logits before temperature / top-k / top-p;
chatterbox-tts 0.1.7's `T3.inference_turbo` builds its processor list as temperature, top-k,
top-p, then the penalty, so the penalty reweighs only what the filters kept. Checked here:
the rule's properties, transformers' own processors composed in upstream's order (a separate
restatement, and the order read from upstream's source when the package or wheel is at hand),
the Chatterbox regression (top_k=1 with a penalty stays greedy, as upstream does), and the
engine against the interpreter. Triton == torch: tests/kernels/test_triton_penalty_order.py.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import zipfile
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from models.chatterbox import ChatterboxInputs, demo_conditioning, tiny_config, tiny_demo_talker
from mtp_fsm.engine import LockstepEngine, NewRequest
from mtp_fsm.lifecycle import single_codebook_lifecycle
from mtp_fsm.model_api import ModelSpec
from mtp_fsm.sampling import SamplingParams, filter_mask, sample_tokens
from mtp_fsm.sampling.noise import codebook_key, frame_key, gumbel_noise
from mtp_fsm.sampling.params import sampler_facts
from mtp_fsm.sampling.penalties import (
    PENALTY_AFTER_FILTERS, PENALTY_BEFORE_TEMPERATURE, PENALTY_ORDERS, apply_repetition_penalty,
)
from mtp_fsm.serving.model_loader import MODEL_NAMES, load_talker
from mtp_fsm.testing.alone import run_alone, scripted_single, torch_threads
from mtp_fsm.testing.interpreter import interpret
from mtp_fsm.testing.stateful import scripted_requests

PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NEG_INF = float("-inf")
UPSTREAM_VERSION = "0.1.7"
WHEEL_ENV = "CHATTERBOX_TTS_WHEEL"  # a downloaded chatterbox_tts-0.1.7 wheel; never fetched by the tests


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


def _counts(generated: list[list[int]], vocab: int) -> torch.Tensor:
    rows = [torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=vocab) for ids in generated]
    return torch.stack(rows).int()


def _sample(logits, params: list[SamplingParams], counts, seeds, frames, order: str, shortcuts: bool = True):
    """The engine's CB0 draw (reference.draw_cb0's wiring) for rows with these parameters."""
    penalty = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)

    def penalise(x):
        return apply_repetition_penalty(x, counts, penalty)

    k_max, any_p, k_min = sampler_facts(params)
    facts = dict(top_k_max=k_max, any_top_p=any_p, top_k_min=k_min) if shortcuts else {}
    before = order == PENALTY_BEFORE_TEMPERATURE
    return sample_tokens(
        logits, torch.tensor([p.temperature for p in params]), torch.tensor([p.top_k for p in params]),
        torch.tensor([p.top_p for p in params]), torch.tensor(seeds), torch.tensor(frames), 0,
        apply_filters=any(p.filters for p in params), rules=penalise if before else None,
        late=None if before else penalise, **facts)


@st.composite
def rows(draw, top_k=None, penalties=(0.05, 0.6, 1.0, 1.05, 1.2, 1.3, 2.0, 7.0, 1e6)):
    """Logits (some -inf masked, ties on request), per-row parameters, generated ids, seeds, frames."""
    b, v = draw(st.integers(1, 5)), draw(st.integers(2, 60))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if draw(st.booleans()):
        logits = torch.randint(-3, 4, (b, v), generator=g).float()  # ties everywhere
    else:
        logits = torch.randn(b, v, generator=g) * draw(st.sampled_from([0.01, 1.0, 8.0]))
    logits[torch.rand(b, v, generator=g) < draw(st.sampled_from([0.0, 0.3]))] = NEG_INF
    logits[:, draw(st.integers(0, v - 1))] = 0.5  # a finite id in every row
    params = [SamplingParams(draw(st.sampled_from([0.0, 0.3, 0.8, 1.0, 1.7])),
                             top_k if top_k is not None else draw(st.integers(0, v + 1)),
                             draw(st.sampled_from([1.0, 0.95, 0.5])), draw(st.sampled_from(penalties)))
              for _ in range(b)]
    generated = [draw(st.lists(st.integers(0, v - 1), max_size=2 * v)) for _ in range(b)]
    seeds = draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=b, max_size=b))
    frames = draw(st.lists(st.integers(0, 500), min_size=b, max_size=b))
    return logits, params, _counts(generated, v), seeds, frames, generated


# -- the rule ---------------------------------------------------------------------------------


@PROPS
@given(rows(top_k=1))
def test_top_k_1_with_the_penalty_after_the_filters_is_greedy_for_any_penalty(case):
    """Only the top score survives top_k=1, and a penalty cannot unmask an id: the token is
    one of the maxima of the unpenalised logits (the only one when they are distinct)."""
    logits, params, counts, seeds, frames, _ = case
    tokens, fault = _sample(logits, params, counts, seeds, frames, PENALTY_AFTER_FILTERS)
    assert (fault == 0).all()
    peak = logits.amax(dim=-1)
    assert (logits.gather(1, tokens[:, None])[:, 0] == peak).all()
    distinct = (logits == peak[:, None]).sum(-1) == 1
    assert torch.equal(tokens[distinct], logits.argmax(-1)[distinct])


@PROPS
@given(rows(penalties=(1.0,)), st.booleans(), st.booleans())
def test_both_orders_sample_the_same_tokens_when_no_penalty_applies(case, inactive_by_counts, shortcuts):
    """With penalty 1 (or no id seen) the orders agree bit for bit, the engine's host-known
    shortcuts (all-greedy argmax, top-k candidates) included: the late path changes nothing else."""
    logits, params, counts, seeds, frames, _ = case
    if inactive_by_counts:
        params = [attrs.evolve(p, repetition_penalty=1.3) for p in params]
        counts = torch.zeros_like(counts)
    got = [_sample(logits, params, counts, seeds, frames, order, shortcuts) for order in PENALTY_ORDERS]
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


def test_the_order_changes_tokens_where_the_penalty_moves_the_kept_set():
    """Two ids, the seen one on top: before the filters the penalty hands top_k=1 the other id."""
    logits, counts = torch.tensor([[2.0, 1.9]]), torch.tensor([[1, 0]], dtype=torch.int32)
    params = [SamplingParams(0.8, 1, 1.0, 1.3)]
    before = _sample(logits, params, counts, [5], [3], PENALTY_BEFORE_TEMPERATURE)[0]
    after = _sample(logits, params, counts, [5], [3], PENALTY_AFTER_FILTERS)[0]
    assert before.tolist() == [1] and after.tolist() == [0]


def test_model_spec_validates_the_order():
    fields = dict(name="m", hidden_size=4, num_codebooks=1, backbone_vocab_size=8, codebook_size=6, eos_token_id=6,
                  max_context=8)
    assert ModelSpec(**fields).repetition_penalty_order == PENALTY_BEFORE_TEMPERATURE
    with pytest.raises(ValueError, match=r"m: repetition_penalty_order must be one of .*'after_filters'.*got 'after'"):
        ModelSpec(**fields, repetition_penalty_order="after")


def test_each_talker_declares_its_upstream_order_and_default():
    declared = {name: load_talker(name).model.spec for name in MODEL_NAMES}
    orders = {name: (spec.repetition_penalty_order, spec.repetition_penalty) for name, spec in declared.items()}
    assert orders.pop("chatterbox") == (PENALTY_AFTER_FILTERS, 1.2)  # tts_turbo.generate / inference_turbo
    assert orders.pop("qwen3_tts") == (PENALTY_BEFORE_TEMPERATURE, 1.05)  # HF generate, generation_config
    assert all(order == PENALTY_BEFORE_TEMPERATURE for order, _ in orders.values()), orders


# -- upstream's order, with transformers' own processors ---------------------------------------


def _hf():
    return pytest.importorskip("transformers", reason="transformers' logits processors are the upstream pieces")


def restated_turbo_processors(temperature, top_k, top_p, repetition_penalty):
    """chatterbox-tts 0.1.7 T3.inference_turbo's processor list, restated from its documented
    behaviour: each warper only when it changes something, the penalty last."""
    hf = _hf()
    out = hf.LogitsProcessorList()
    if temperature > 0 and temperature != 1.0:
        out.append(hf.TemperatureLogitsWarper(temperature))
    if top_k > 0:
        out.append(hf.TopKLogitsWarper(top_k))
    if top_p < 1.0:
        out.append(hf.TopPLogitsWarper(top_p))
    if repetition_penalty != 1.0:
        out.append(hf.RepetitionPenaltyLogitsProcessor(repetition_penalty))
    return out


def _upstream_tokens(build, logits, params, generated, seeds, frames):
    """Per row: Gumbel-max with the engine's noise over what upstream's processors hand
    softmax + multinomial (the same distribution), or None where its top-p and ours keep
    different sets (float softmax vs the fixed-point mass: a known, separate difference)."""
    out = []
    for r, p in enumerate(params):
        ids = torch.tensor([generated[r]], dtype=torch.int64).reshape(1, -1)
        processed = build(p.temperature, p.top_k, p.top_p, p.repetition_penalty)(ids, logits[r:r + 1].clone())
        unpenalised = build(p.temperature, p.top_k, p.top_p, 1.0)(ids, logits[r:r + 1].clone())
        ours = filter_mask(logits[r:r + 1] / p.temperature, torch.tensor([p.top_k]), torch.tensor([p.top_p]))
        if not torch.equal(unpenalised > NEG_INF, ours & (logits[r:r + 1] > NEG_INF)):
            return None
        key = codebook_key(frame_key(torch.tensor([seeds[r]]), torch.tensor([frames[r]])), 0)
        out.append(int(torch.argmax(processed + gumbel_noise(key, logits.shape[1]))))
    return out


def _check_against(build, case):
    logits, params, counts, seeds, frames, generated = case
    params = [p if p.temperature > 0 else attrs.evolve(p, temperature=1.0) for p in params]  # upstream has no greedy
    want = _upstream_tokens(build, logits, params, generated, seeds, frames)
    assume(want is not None)
    tokens, _ = _sample(logits, params, counts, seeds, frames, PENALTY_AFTER_FILTERS)
    assert tokens.tolist() == want


@PROPS
@given(rows())
def test_after_filters_equals_transformers_processors_in_turbo_order(case):
    _check_against(restated_turbo_processors, case)


def upstream_t3_source() -> str | None:
    """chatterbox/models/t3/t3.py of chatterbox-tts, from the installed package (the parity
    venv) or the wheel $CHATTERBOX_TTS_WHEEL names; None when neither is here."""
    found = importlib.util.find_spec("chatterbox")  # finds without importing the package
    if found is not None and found.submodule_search_locations:
        path = Path(next(iter(found.submodule_search_locations))) / "models" / "t3" / "t3.py"
        if path.exists():
            return path.read_text()
    wheel = os.environ.get(WHEEL_ENV)
    if wheel and Path(wheel).exists():
        with zipfile.ZipFile(wheel) as zf:
            return zf.read("chatterbox/models/t3/t3.py").decode()
    return None


def upstream_turbo_processors():
    """A function building the processor list exactly as upstream's inference_turbo does:
    its own leading statements (those naming `logits_processors`), compiled from its source."""
    hf = _hf()
    source = upstream_t3_source()
    if source is None:
        pytest.skip(f"chatterbox-tts {UPSTREAM_VERSION} is neither installed nor named by ${WHEEL_ENV} (the "
                    f"parity venv installs it; or `pip download --no-deps chatterbox-tts=={UPSTREAM_VERSION}`)")
    turbo = next(node for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.FunctionDef) and node.name == "inference_turbo")
    head = []
    for stmt in turbo.body:
        if "logits_processors" not in ast.unparse(stmt):
            break
        head.append(stmt)
    args = [a.arg for a in turbo.args.args]
    assert {"temperature", "top_k", "top_p", "repetition_penalty"} <= set(args)
    build = ast.parse("def build(temperature, top_k, top_p, repetition_penalty):\n    pass\n").body[0]
    build.body = head + [ast.parse("return logits_processors").body[0]]
    scope = {name: getattr(hf, name) for name in ("LogitsProcessorList", "TemperatureLogitsWarper", "TopKLogitsWarper",
                                                  "TopPLogitsWarper", "RepetitionPenaltyLogitsProcessor")}
    exec(compile(ast.fix_missing_locations(ast.Module([build], [])), "inference_turbo", "exec"), scope)  # noqa: S102
    defaults = dict(zip(args[-len(turbo.args.defaults):], (ast.literal_eval(d) for d in turbo.args.defaults)))
    return scope["build"], defaults


def test_upstream_inference_turbo_builds_the_penalty_last_and_defaults_to_1_2():
    build, defaults = upstream_turbo_processors()
    kinds = [type(p).__name__ for p in build(0.8, 1000, 0.95, 1.2)]
    assert kinds == ["TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper",
                     "RepetitionPenaltyLogitsProcessor"]
    assert defaults["repetition_penalty"] == tiny_demo_talker().spec.repetition_penalty == 1.2


@PROPS
@given(rows())
def test_after_filters_equals_upstream_inference_turbo_read_from_its_source(case):
    _check_against(upstream_turbo_processors()[0], case)


# -- Chatterbox in the engine ------------------------------------------------------------------


def _chatterbox_codes(params: SamplingParams, seed: int, max_frames: int = 24, model_seed: int = 0) -> list[int]:
    speaker, cond = demo_conditioning(tiny_config())
    req = NewRequest("a", ChatterboxInputs(text="Repetition, please: la la la la.", speaker_emb=speaker,
                                           cond_tokens=cond), max_frames=max_frames, seed=seed, cb0_sampling=params)
    result = LockstepEngine(tiny_demo_talker(model_seed), 1).generate([req])["a"]
    return [int(f.codes[0]) for f in result.frames]


@pytest.mark.parametrize("seed", [3, 9])
def test_chatterbox_top_k_1_with_penalty_1_3_stays_greedy_like_upstream(seed):
    """Upstream with top_k=1 samples its greedy token whatever the penalty; penalising before
    the filters (this engine before issue 31) left the greedy path at frame 11 (seed 3)."""
    greedy = _chatterbox_codes(SamplingParams(0.0, 0, 1.0, 1.0), seed)
    assert len(greedy) == 24 and len(set(greedy)) < len(greedy)  # ids repeat: the penalty has work
    assert _chatterbox_codes(SamplingParams(0.8, 1, 1.0, 1.3), seed) == greedy


def test_chatterbox_requests_default_to_penalty_1_2():
    model = tiny_demo_talker(0)
    speaker, cond = demo_conditioning(tiny_config())
    engine = LockstepEngine(model, 1)
    engine.add_request(NewRequest("d", ChatterboxInputs(text="hi", speaker_emb=speaker, cond_tokens=cond),
                                  max_frames=2))
    engine.step()
    assert engine.table.cb0_penalty_order == PENALTY_AFTER_FILTERS
    assert float(engine.table.cb0_penalty[engine.ledger.records["d"].slot]) == pytest.approx(1.2)


def _scripted_after():
    model = scripted_single()
    model.spec = attrs.evolve(model.spec, repetition_penalty_order=PENALTY_AFTER_FILTERS)
    return model


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scripted_requests(_scripted_after().spec))
def test_engine_equals_the_interpreter_with_the_penalty_after_the_filters(definition):
    engine = run_alone(_scripted_after, definition, kernels="torch", lifecycle=single_codebook_lifecycle())
    assert interpret(_scripted_after(), single_codebook_lifecycle(), definition) == engine
