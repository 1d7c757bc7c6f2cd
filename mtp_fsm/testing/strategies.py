"""Hypothesis strategies for scripted requests, and the host events a state machine stages."""

from __future__ import annotations

import attrs
from hypothesis import strategies as st

from ..engine import NewRequest, StepPlan
from ..lifecycle import lifecycle_for
from ..model_api import ModelSpec
from ..sampling import GREEDY, SamplingParams
from .alone import RequestDef
from .scripted import ScriptInputs

SAMPLING = (
    GREEDY, SamplingParams(), SamplingParams(0.7, 5, 0.9), SamplingParams(1.3, 0, 0.5),
    SamplingParams(1.0, 1, 1.0), SamplingParams(0.9, 0, 1e-6), SamplingParams(0.0, 3, 0.8),
)
# CB0 only: the repetition penalty (> 1 discourages repeats, < 1 favours them; with greedy too).
CB0_SAMPLING = SAMPLING + (
    SamplingParams(0.0, 0, 1.0, 1.7), SamplingParams(0.9, 5, 1.0, 1.3), SamplingParams(1.1, 0, 0.8, 0.6),
)
MIN_FRAMES = (None, None, 0, 1, 3)


def scripted_requests(spec: ModelSpec, max_prompt: int = 8, max_frames: int = 6) -> st.SearchStrategy[RequestDef]:
    """Random request definitions for the ScriptedTalker: prompt, budget, seed, sampling,
    and an optional forced EOS / NaN / MTP-NaN frame."""
    # A delay pattern's wind-down takes Q - 1 frames after the EOC one: budgets leave room for it.
    frames = st.integers(1, max_frames + (spec.num_codebooks if spec.delay_pattern else 0))
    # A deferred lifecycle publishes frame f after CB0 f+1 is sampled, and a delay pattern owns
    # the stop and fills codebooks with BOC / EOC: history rules are refused for both.
    history = not lifecycle_for(spec.lifecycle).deferred and spec.delay_pattern is None

    @st.composite
    def build(draw):
        n = draw(st.integers(1, min(max_prompt, spec.max_context - 1)))
        budget = draw(frames)

        def at(first: int = 0, odds: int = 5):  # a forced event at some frame, for one request in `odds`
            if draw(st.integers(0, odds - 1)) != 0:
                return None
            # `first` in 3: often the prompt's own frame (a fault there ends a prefilling row)
            return 0 if draw(st.integers(0, 2)) < first else draw(st.integers(0, budget - 1))

        prompt = tuple(draw(st.lists(st.integers(0, 96), min_size=n, max_size=n)))
        feed, feed_done = (), True
        if spec.has_feed:  # the whole feed: a request never starves for more than it will get
            feed = tuple(draw(st.lists(st.integers(0, 96), max_size=budget + 1)))
            feed_done = len(feed) < budget or draw(st.booleans())
        # Faults often (one request in three): every variant has a fault edge from each live state.
        eos_at, nan_at, mtp_nan_at = at(), at(first=1, odds=3), at(odds=3) if spec.has_mtp else None
        if spec.delay_pattern is not None and eos_at is not None and draw(st.integers(0, 1)) == 0:
            # The wind-down lasts Q - 1 frames: aim a fault into it (else it is rarely hit).
            nan_at = eos_at + draw(st.integers(1, spec.num_codebooks - 1))
        inputs = ScriptInputs(prompt, eos_at=eos_at, nan_at=nan_at, mtp_nan_at=mtp_nan_at, feed=feed,
                              feed_done=feed_done)
        seed = draw(st.one_of(st.integers(0, 3), st.integers(-(2**63), 2**63 - 1)))
        if history:
            cb0 = draw(st.sampled_from(CB0_SAMPLING))
            # min_frames masks a CB0 EOS: refused where the MTP stage decides the stop.
            min_frames = draw(st.sampled_from(MIN_FRAMES)) if spec.eos_token_id is not None else None
        else:
            cb0, min_frames = draw(st.sampled_from(SAMPLING)), None
        return RequestDef(inputs, budget, seed, cb0, draw(st.sampled_from(SAMPLING)), min_frames)

    return build()


@attrs.define
class Pending:
    """Host events staged for the next plan."""

    new: list[NewRequest] = attrs.field(factory=list)
    aborts: list[str] = attrs.field(factory=list)
    preempts: list[str] = attrs.field(factory=list)
    resumes: list[str] = attrs.field(factory=list)
    releases: list[str] = attrs.field(factory=list)

    def touched(self) -> set[str]:
        return {*self.aborts, *self.preempts, *self.resumes, *self.releases, *(q.request_id for q in self.new)}

    def plan(self, rows=(), **extra) -> StepPlan:
        parts = dict(new_requests=tuple(self.new), aborts=tuple(self.aborts), preempts=tuple(self.preempts),
                     resumes=tuple(self.resumes), releases=tuple(self.releases))
        for key, value in extra.items():
            parts[key] = parts[key] + tuple(value)
        return StepPlan(rows=tuple(rows), **parts)


def draft_policies() -> st.SearchStrategy:
    """Speculative engines' draft policies: the engine's default (None), fixed k, and adaptive
    ones over their inputs (costs that make drafting pay or never pay, priors, smoothing and
    probe intervals), so the draft count varies from step to step in different ways."""
    from ..engine.draft_policy import DraftPolicy

    adaptive = st.builds(
        lambda cost, prior, smoothing, probe, factor: DraftPolicy(
            position_cost=cost, prior=prior, smoothing=smoothing, probe_every=probe, max_probe_every=probe * factor),
        st.sampled_from([0.0, 0.1, 0.5, 1.0, 3.0]), st.floats(0.0, 1.0), st.floats(0.05, 1.0), st.integers(1, 4),
        st.integers(1, 4))
    return st.one_of(st.none(), st.just(DraftPolicy(adaptive=False)), adaptive)
