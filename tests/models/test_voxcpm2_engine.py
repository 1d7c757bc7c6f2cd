"""VoxCPM2 in the engine (variant stop_head, float patch payload), against a plain loop over the
model's own step functions written here (upstream `_inference` order): same patches bit for bit,
the stop patch published, the minimum length honoured; a preempted request resumes to the same
patches; a non-finite patch ends its request alone with reason error."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from mtp_fsm.engine import LockstepEngine, NewRequest, SchedulingPolicy
from mtp_fsm.lifecycle import FinishReason
from mtp_fsm.sampling.gaussian import gaussian_noise
from mtp_fsm.sampling.noise import frame_key
from mtp_fsm.testing.alone import torch_threads

voxcpm2 = pytest.importorskip("models.voxcpm2")


@pytest.fixture(scope="module")
def model():
    with torch_threads(1):
        yield voxcpm2.tiny_demo_talker(seed=0)


def reference(model, text: str, seed: int, max_frames: int) -> tuple[list[torch.Tensor], FinishReason]:
    """One request by hand: prefill the text, then per step stop logits and the CFM patch from
    the same hidden state (noise keyed by (seed, patch index), the previous patch as prefix),
    the patch emitted, stop (argmax 1, only past min_len) ends after it."""
    cfg = model.config
    model.bind_slots(1, model.device)
    model.reset_slots(torch.tensor([0]))
    ids = torch.tensor(model.tokenize(text))
    x, slots = model.prompt_embeds(ids), torch.zeros(len(ids), dtype=torch.long)
    hidden = voxcpm2.VoxCPM2Core.forward(model, x, torch.arange(len(ids)), slots, torch.zeros(len(ids), dtype=torch.bool))[-1:]
    patches, prefix, position = [], torch.zeros(1, cfg.patch_size, cfg.feat_dim), len(ids)
    for i in range(max_frames):
        stop = model.stop_logits(hidden)
        noise = gaussian_noise(frame_key(torch.tensor([seed]), torch.tensor([i])), (cfg.patch_size, cfg.feat_dim))
        patch = model.patch(hidden, prefix, noise)
        patches.append(patch[0])
        if bool(stop[0, 1] > stop[0, 0]) and i > cfg.min_len:
            return patches, FinishReason.EOS
        prefix = patch
        hidden = voxcpm2.VoxCPM2Core.forward(model, model.next_embed(patch), torch.tensor([position]),
                                             torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.bool))
        position += 1
    return patches, FinishReason.LENGTH


TEXTS = st.text(alphabet="ab xyz.", min_size=1, max_size=8)


@settings(deadline=None, max_examples=6, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(texts=st.lists(TEXTS, min_size=1, max_size=3), seeds=st.lists(st.integers(0, 2**40), min_size=3, max_size=3),
       max_frames=st.integers(1, 20), budget=st.integers(1, 16), preempt=st.booleans())
def test_engine_patches_equal_the_hand_loop(model, texts, seeds, max_frames, budget, preempt):
    with torch_threads(1):
        want = [reference(model, t, seeds[i], max_frames) for i, t in enumerate(texts)]
        policy = SchedulingPolicy(token_budget=budget, prefill_chunk=3, preempt_after_steps=1 if preempt else None)
        engine = LockstepEngine(model, 2, kernels="torch", policy=policy)
        try:
            got = engine.generate([NewRequest(f"r{i}", voxcpm2.text_inputs(t), max_frames, seeds[i])
                                   for i, t in enumerate(texts)])
        finally:
            engine.close()
    for i, (patches, reason) in enumerate(want):
        result = got[f"r{i}"]
        assert result.finished.reason is reason
        assert len(result.frames) == len(patches)
        for frame, patch in zip(result.frames, patches):
            assert frame.payload.dtype == torch.float32 and torch.equal(frame.payload, patch)
            assert int(frame.codes[0]) == (1 if frame is result.frames[-1] and reason is FinishReason.EOS else 0)


def test_preempted_request_resumes_to_the_same_patches(model):
    """Preempted mid-stream (twice), the request replays its published patches into its prompt
    and continues from the last one as the DiT prefix: every patch is bit-identical."""
    text, seed = "resume me", 11
    want, reason = reference(model, text, seed, 30)
    engine = LockstepEngine(model, 1, kernels="torch", policy=SchedulingPolicy(token_budget=64, prefill_chunk=64))
    try:
        engine.add_request(NewRequest("a", voxcpm2.text_inputs(text), 30, seed))
        frames, preempted, ended = [], 0, []
        for step in range(200):
            if step in (5, 9) and engine.preempt("a"):
                preempted += 1
            out = engine.step()
            if out is None:
                break
            frames += [f.payload for f in out.frames]
            ended += [f.reason for f in out.finished]
    finally:
        engine.close()
    assert preempted == 2 and ended == [reason]
    assert len(frames) == len(want) and all(torch.equal(a, b) for a, b in zip(frames, want))


def test_a_non_finite_patch_ends_its_request_alone(model):
    """A NaN in one request's patch is an MTP fault: that request ends with reason error, the
    one beside it is untouched."""
    patch = type(model).patch

    def poisoned(self, hidden, prefix, noise):
        out = patch(self, hidden, prefix, noise)
        bad = (noise[:, 0, 0] > 2.5)[:, None, None]  # a row whose own noise says so
        return torch.where(bad, float("nan"), out)

    seed_bad = next(s for s in range(500)
                    if gaussian_noise(frame_key(torch.tensor([s]), torch.tensor([2])), (4, 8))[0, 0, 0] > 2.5
                    and all(gaussian_noise(frame_key(torch.tensor([s]), torch.tensor([i])), (4, 8))[0, 0, 0] <= 2.5
                            for i in range(2)))
    seed_ok = next(s for s in range(500) if all(
        gaussian_noise(frame_key(torch.tensor([s]), torch.tensor([i])), (4, 8))[0, 0, 0] <= 2.5 for i in range(8)))
    want_ok, _ = reference(model, "fine", seed_ok, 8)
    model.patch = poisoned.__get__(model)
    try:
        engine = LockstepEngine(model, 2, kernels="torch")
        got = engine.generate([NewRequest("bad", voxcpm2.text_inputs("nan"), 8, seed_bad),
                               NewRequest("ok", voxcpm2.text_inputs("fine"), 8, seed_ok)])
        engine.close()
    finally:
        del model.patch
    assert got["bad"].finished.reason is FinishReason.ERROR and len(got["bad"].frames) == 2
    assert "payload" in got["bad"].finished.detail
    assert [f.payload for f in got["ok"].frames] and all(
        torch.equal(f.payload, p) for f, p in zip(got["ok"].frames, want_ok))
