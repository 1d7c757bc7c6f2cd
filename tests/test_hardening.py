"""Regressions of the hardening issue: each found by driving the engine as a new user would."""

from __future__ import annotations

import gc

import pytest
import torch

from mtp_fsm.engine import LockstepEngine, NewRequest, Span, StepPlan
from mtp_fsm.errors import AdmissionError, DuplicateRequestError, ModelBindingError, MtpFsmError, PlanError
from mtp_fsm.lifecycle import FinishReason, State
from mtp_fsm.testing import ScriptedTalker, ScriptInputs


def request(rid: str, **kwargs) -> NewRequest:
    fields = dict(inputs=ScriptInputs((1, 2, 3, 4)), max_frames=4, seed=1)
    return NewRequest(rid, **{**fields, **kwargs})


def snapshot(engine: LockstepEngine):
    columns = {k: v.clone() for k, v in engine.table.columns().items()}
    records = {rid: (r.slot, r.state, r.num_frames) for rid, r in engine.ledger.all_records()}
    return columns, records, engine.num_free_slots


def assert_unchanged(engine: LockstepEngine, before) -> None:
    columns, records, free = snapshot(engine)
    assert records == before[1] and free == before[2]
    assert all(torch.equal(columns[k], before[0][k]) for k in columns)


def test_releasing_a_preempted_request_is_refused_before_anything_changes():
    engine = LockstepEngine(ScriptedTalker(), 2)
    engine.step(StepPlan(new_requests=(request("a"),), rows=(Span("a", 4),)))
    engine.step(StepPlan(preempts=("a",)))
    before = snapshot(engine)
    with pytest.raises(PlanError, match="'a' in state 'preempted': holds no slot to release"):
        engine.step(StepPlan(releases=("a",)))
    assert_unchanged(engine, before)
    assert engine.request_state("a") is State.PREEMPTED  # still resumable, nothing lost
    engine.step(StepPlan(resumes=("a",), rows=(Span("a", 5),)))


def test_published_tensors_are_ordinary_owned_tensors_also_after_a_failed_step():
    class Exploding(ScriptedTalker):
        explode = False

        def forward(self, *args):
            if self.explode:
                raise RuntimeError("boom")
            return super().forward(*args)

    model = Exploding()
    engine = LockstepEngine(model, 2)
    out = engine.step(StepPlan(new_requests=(request("a"),), rows=(Span("a", 4),)))
    model.explode = True
    failed = engine.step(StepPlan(new_requests=(request("b"),), rows=(Span("a", 1), Span("b", 4))))
    for tensor in (out.frames.codes, out.frames.frame_index, out.rows.codes, out.rows.valid, failed.rows.codes,
                   failed.rows.valid, failed.frames.codes):
        assert not tensor.is_inference()
        tensor.add_(0) if tensor.dtype != torch.bool else tensor.logical_not_()  # in-place works


def test_aborting_queued_requests_drops_their_prepared_prompts():
    engine = LockstepEngine(ScriptedTalker(), 1)
    held = [request(f"q{i}") for i in range(50)]  # the client keeps its request objects
    for req in held:
        engine.add_request(req)
    assert len(engine.ledger.admission._prepared) == 50
    for req in held:
        assert engine.abort(req.request_id) == "dropped"
    gc.collect()
    assert not engine.ledger.queued and not engine.ledger.admission._prepared and engine.idle


def test_a_model_bound_to_a_live_engine_cannot_be_bound_again():
    model = ScriptedTalker()
    first = LockstepEngine(model, 1)
    with pytest.raises(ModelBindingError, match="already bound to another live engine"):
        LockstepEngine(model, 1)
    first.close()
    LockstepEngine(model, 1)  # closed: the model may be bound again
    del first
    gc.collect()


def test_host_ended_requests_free_their_slot_at_once_device_ended_ones_keep_it():
    """One rule: a request the host ends (client abort, model fault) leaves the engine at the
    boundary; one the device ends (EOS, length, non-finite logits) keeps its slot until
    released, so a late (async) overrun row is still attributable."""
    engine = LockstepEngine(ScriptedTalker(), 2)
    engine.step(StepPlan(new_requests=(request("a", max_frames=1), request("b")), rows=(Span("a", 4), Span("b", 4))))
    assert engine.request_state("a") is State.FINISHED and engine.num_free_slots == 0
    out = engine.step(StepPlan(aborts=("b",), rows=(Span("a", 1),)))  # a: an overrun row
    assert [(f.request_id, f.reason) for f in out.finished] == [("b", FinishReason.ABORT)]
    assert engine.num_free_slots == 1 and "b" not in engine.requests()


def test_overrun_rows_take_exactly_one_token():
    engine = LockstepEngine(ScriptedTalker(), 1)
    engine.step(StepPlan(new_requests=(request("a", max_frames=1),), rows=(Span("a", 4),)))
    before = snapshot(engine)
    with pytest.raises(PlanError, match="'a' in state 'finished': an overrun row .* exactly 1 token, got 3"):
        engine.step(StepPlan(rows=(Span("a", 3),)))
    assert_unchanged(engine, before)


@pytest.mark.parametrize("field", ["aborts", "preempts", "resumes", "releases"])
def test_a_bare_string_is_not_a_list_of_ids(field):
    with pytest.raises(PlanError, match=f"StepPlan.{field} must be a sequence of request ids"):
        StepPlan(**{field: "req-1"})
    with pytest.raises(PlanError, match="expected Span or None"):
        StepPlan(rows=[("a", 1)])
    assert StepPlan(**{field: ["req-1"]}) == StepPlan(**{field: ("req-1",)})


@pytest.mark.parametrize("field,value", [("max_frames", True), ("seed", False), ("sampling_width", True)])
def test_booleans_are_not_numbers(field, value):
    engine = LockstepEngine(ScriptedTalker(), 1)
    with pytest.raises(AdmissionError, match=f"'x'.*{'sampling width' if field == 'sampling_width' else field}"):
        engine.add_request(request("x", **{field: value}))
    assert engine.idle


def test_messages_say_what_is_really_wrong():
    engine = LockstepEngine(ScriptedTalker(), 2)
    with pytest.raises(DuplicateRequestError, match="'a' \\(new\\): named twice among this plan's new requests"):
        engine.step(StepPlan(new_requests=(request("a"), request("a"))))
    engine.step(StepPlan(new_requests=(request("a", max_frames=1),), rows=(Span("a", 4),)))
    engine.step(StepPlan(releases=("a",)))
    with pytest.raises(PlanError, match="'a'.*not in the engine \\(never admitted, or already released or aborted\\)"):
        engine.step(StepPlan(rows=(Span("a", 1),)))


def test_every_refusal_is_an_mtp_fsm_error():
    for error in (PlanError, AdmissionError, ModelBindingError):
        assert issubclass(error, MtpFsmError)


class Masking(ScriptedTalker):
    """A talker whose heads write -inf (upstream suppress_tokens / stop heads): `cb0_mask`
    and `mtp_mask` are bool [V] of ids set to -inf; `mtp_poison` = (codebook, value) writes
    `value` into one logit of that MTP codebook."""

    cb0_mask: torch.Tensor | None = None
    mtp_mask: torch.Tensor | None = None
    mtp_poison: tuple[int, float] | None = None

    def cb0_logits(self, hidden):
        logits = super().cb0_logits(hidden)
        return logits if self.cb0_mask is None else logits.masked_fill(self.cb0_mask, float("-inf"))

    def mtp(self, hidden, cb0, sample):
        def masked(logits, codebook):
            if self.mtp_mask is not None:
                logits = logits.masked_fill(self.mtp_mask[: logits.shape[-1]], float("-inf"))
            if self.mtp_poison is not None and self.mtp_poison[0] == codebook:
                logits = logits.clone()
                logits[:, 1] = self.mtp_poison[1]
            return sample(logits, codebook)

        return super().mtp(hidden, cb0, masked)


def _run(model, *requests):
    return LockstepEngine(model, max(len(requests), 1), kernels="torch").generate(list(requests))


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_minus_inf_logits_are_masks_not_errors(sampling):
    from mtp_fsm.sampling import SamplingParams

    model = Masking()
    spec = model.spec
    vocab = spec.backbone_vocab_size
    model.cb0_mask = torch.arange(vocab) % 2 == 1  # every odd id suppressed
    model.cb0_mask[spec.eos_token_id] = False
    model.mtp_mask = torch.arange(spec.codebook_size) < spec.codebook_size // 2  # the low half suppressed
    params = SamplingParams(temperature=0.9, top_k=5) if sampling == "sampled" else SamplingParams()
    result = _run(model, request("a", max_frames=12, cb0_sampling=params, mtp_sampling=params))["a"]
    assert result.finished.reason in (FinishReason.LENGTH, FinishReason.EOS), result.finished
    assert result.finished.detail == ""
    codes = torch.stack([f.codes for f in result.frames])
    assert len(codes) > 0
    assert not model.cb0_mask[codes[:, 0]].any(), "a -inf CB0 id was sampled"
    assert not model.mtp_mask[codes[:, 1:]].any(), "a -inf MTP id was sampled"


@pytest.mark.parametrize("inputs, poison, detail", [
    (ScriptInputs((1, 2, 3), nan_at=1), None, "CB0 sampling: a logit is NaN"),
    (ScriptInputs((1, 2, 3), mtp_nan_at=2), None, "MTP sampling, codebook 1: a logit is NaN"),
    (ScriptInputs((1, 2, 3)), (2, float("inf")), "MTP sampling, codebook 2: a logit is +inf"),
    (ScriptInputs((1, 2, 3)), (3, float("nan")), "MTP sampling, codebook 3: a logit is NaN"),
], ids=["cb0-nan", "mtp-nan", "mtp-posinf", "mtp-nan-cb3"])
def test_error_finishes_say_which_stage_codebook_and_value(inputs, poison, detail):
    model = Masking()
    model.mtp_poison = poison
    result = _run(model, request("a", inputs=inputs, max_frames=6), request("ok", max_frames=3))
    assert result["a"].finished.reason is FinishReason.ERROR
    assert result["a"].finished.detail == detail
    assert len(result["a"].frames) == (inputs.nan_at if inputs.nan_at is not None else inputs.mtp_nan_at or 0)
    # A poison hits every row; otherwise the neighbour is untouched by the faulty row.
    assert (result["ok"].finished.reason is FinishReason.ERROR) == (poison is not None)


def test_a_row_with_every_id_masked_is_an_error_that_says_so():
    model = Masking()
    model.cb0_mask = torch.ones(model.spec.backbone_vocab_size, dtype=torch.bool)
    done = _run(model, request("a"))["a"].finished
    assert (done.reason, done.detail) == (
        FinishReason.ERROR, "CB0 sampling: every allowed id is masked (-inf), nothing left to sample")


def test_a_recycled_slot_forgets_the_fault_of_its_last_owner():
    model = Masking()
    engine = LockstepEngine(model, 1, kernels="torch")
    first = engine.generate([request("bad", inputs=ScriptInputs((1, 2), nan_at=0))])["bad"].finished
    assert first.detail == "CB0 sampling: a logit is NaN"
    model.mtp_poison = (1, float("inf"))
    second = engine.generate([request("next", max_frames=2)])["next"].finished
    assert second.detail == "MTP sampling, codebook 1: a logit is +inf"


@pytest.mark.parametrize("field, value, message", [
    ("request_id", 5, "request id must be a non-empty str"),
    ("request_id", "", "request id must be a non-empty str"),
    ("max_frames", 2**63, "max_frames must be an int in"),
])
def test_unrepresentable_request_fields_are_refused_before_anything_changes(field, value, message):
    engine = LockstepEngine(ScriptedTalker(), 2)
    bad = request("x", **{field: value}) if field != "request_id" else NewRequest(value, ScriptInputs((1, 2)), 3, 1)
    before = snapshot(engine)
    with pytest.raises(AdmissionError, match=message):
        engine.add_request(bad)
    assert_unchanged(engine, before)


def test_a_dropped_engine_releases_its_model_without_the_garbage_collector():
    """No reference cycle keeps an engine (and its claim on the model) alive once dropped."""
    model = ScriptedTalker()
    gc.disable()
    try:
        for _ in range(3):
            engine = LockstepEngine(model, 1)
            engine.generate([request("a")])
            del engine
    finally:
        gc.enable()
