"""How many drafts a speculative engine proposes each step: always k (fixed), or as many as pay (adaptive: the expected accepted length against the verify step's cost, from measured acceptance)."""

from __future__ import annotations

import math

import attrs

from ..errors import ModelBindingError


@attrs.frozen
class DraftPolicy:
    """The engine's choice of drafts per step under `speculate=k` (k is the most it drafts).

    adaptive=False: k drafts every step (what vLLM's scheduler plans, and what a caller that
    builds its own plans of 1 + k tokens per decode row expects).

    adaptive=True: per step and per batch (every decode row verifies the same number, so a
    step keeps one decode width: the decode buckets' k' + 1), d in 0..k maximising

        frames per step / cost = (1 - a^(d+1)) / (1 - a)  /  step_costs[d]

    where a is the estimated chance that a draft is accepted given the ones before it were
    (a geometric model: a row that verified d drafts and accepted m of them adds m
    acceptances and, if m < d, one rejection), smoothed over steps, and step_costs[d] the
    cost of a decode step verifying d drafts relative to a plain one (d = 0: 1). The costs
    are inputs, not clock readings, so the choice, and with it the step count, is a
    function of the published frames alone (the frames never depend on it: speculation is
    exact for any draft count). They depend on the model, batch and machine: measure them
    (bench_speculative's fixed-k rows are the calibration) or leave the default linear
    model. A batch that settles on d = 0 stops drafting (no drafter pass, one-token decode
    rows); after `probe_every` such steps it proposes one draft (a probe) to re-measure a,
    and the wait doubles, up to `max_probe_every`, while the probes keep choosing 0. The
    drafter's own state (an MTP layer's KV) is not written in steps without drafts: drafts
    after a pause may be worse (a drafter reads zeros there), never wrong.
    """

    adaptive: bool = True
    step_costs: tuple[float, ...] | None = attrs.field(default=None, converter=attrs.converters.optional(tuple))
    position_cost: float = 0.15  # step_costs[d] = 1 + position_cost * d when step_costs is None
    smoothing: float = 0.3  # weight of the newest step's acceptance in the estimate
    prior: float = 0.9  # the estimate before any draft is verified (optimistic: speculation starts on)
    probe_every: int = 8
    max_probe_every: int = 128

    def problems(self, k: int) -> list[str]:
        out = []
        if self.step_costs is not None and (len(self.step_costs) != k + 1 or not all(
                isinstance(c, (int, float)) and math.isfinite(c) and c > 0 for c in self.step_costs)):
            out.append(f"step_costs must hold k + 1 = {k + 1} positive costs (d = 0..k), got {self.step_costs!r}")
        if not (math.isfinite(self.position_cost) and self.position_cost >= 0):
            out.append(f"position_cost must be >= 0, got {self.position_cost!r}")
        if not 0 < self.smoothing <= 1:
            out.append(f"smoothing must be in (0, 1], got {self.smoothing!r}")
        if not 0 <= self.prior <= 1:
            out.append(f"prior must be in [0, 1], got {self.prior!r}")
        if not 1 <= self.probe_every <= self.max_probe_every:
            out.append(f"need 1 <= probe_every <= max_probe_every, got {self.probe_every!r}, {self.max_probe_every!r}")
        return out

    def cost(self, d: int) -> float:
        return self.step_costs[d] if self.step_costs is not None else 1.0 + self.position_cost * d


def expected_frames(a: float, d: int) -> float:
    """Frames a verify row publishes with d drafts, each accepted with chance a after the ones
    before it: 1 + a + ... + a^d."""
    return float(d + 1) if a >= 1.0 else (1.0 - a ** (d + 1)) / (1.0 - a)


def best_drafts(policy: DraftPolicy, a: float, k: int) -> int:
    """argmax over d in 0..k of expected_frames / cost; ties go to the fewer drafts."""
    rates = [expected_frames(a, d) / policy.cost(d) for d in range(k + 1)]
    return max(range(k + 1), key=lambda d: (rates[d], -d))


class DraftController:
    """One engine's draft counts, on the host: `verify` drafts for this step's decode rows (what
    the previous step proposed), `propose` for the drafter to write for the next step."""

    def __init__(self, policy: DraftPolicy, k: int) -> None:
        problems = policy.problems(k)
        if problems:
            raise ModelBindingError(f"draft policy for speculate={k}: " + "; ".join(problems))
        self.policy, self.k = policy, k
        self.acceptance = policy.prior
        self._idle, self._wait = 0, policy.probe_every
        self.propose = self._choose()
        # Before the first step no row has drafts, and no row decodes either: the width a caller's
        # first decode rows are checked against is what the first (prefill) step proposes.
        self.verify = self.propose

    def observe(self, drafts: int, accepted) -> None:
        """accepted: int [rows], drafts accepted per verify row of a step that verified `drafts`."""
        if not drafts or len(accepted) == 0:
            return
        taken = int(accepted.sum())
        rejected = int((accepted < drafts).sum())
        if taken + rejected:
            s = self.policy.smoothing
            self.acceptance = (1 - s) * self.acceptance + s * taken / (taken + rejected)

    def advance(self) -> None:
        """After a step that ran its drafter: its proposals are the next step's verify rows."""
        self.verify = self.propose
        self.propose = self._choose()

    def apply(self, step, ledger) -> None:
        """The counts into the SpeculativeStep and the decode width the ledger checks plans against."""
        step.verify, step.propose = self.verify, self.propose
        ledger.decode_width = ledger.inputs.decode_width = 1 + self.verify

    def _choose(self) -> int:
        p = self.policy
        if not p.adaptive:
            return self.k
        d = best_drafts(p, self.acceptance, self.k)
        if d:
            self._idle, self._wait = 0, p.probe_every
            return d
        if self._idle < self._wait:
            self._idle += 1
            return 0
        self._idle, self._wait = 0, min(2 * self._wait, p.max_probe_every)
        return 1  # a probe: one draft re-measures a (the geometric model needs no more)
