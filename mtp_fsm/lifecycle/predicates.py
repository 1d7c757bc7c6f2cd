"""The guard vocabulary: named row predicates, the pipeline phase each is known in, and guards."""

from __future__ import annotations

import enum
import itertools
from typing import Iterable

import attrs


class Phase(enum.IntEnum):
    """Points of the device pipeline where stages run (in this order within a step)."""

    SAMPLE = 0  # after the backbone and CB0 sampling
    MTP = 1  # after the MTP hook filled codebooks 1..Q-1 (speculative: after the drafter proposed)
    PUBLISH = 2  # at frame publication

    @property
    def label(self) -> str:
        return self.name.lower()


class Predicate(enum.IntEnum):
    """A fact about one scheduled row, computed by every executor as a mask.

    The value is the predicate's bit in the per-row predicate word the kernels build.
    """

    PROMPT_DONE = 0  # this step's tokens complete the prompt: num_computed + scheduled >= prompt_len
    CB0_FAULT = 1  # the row's CB0 sample faulted: a NaN or +inf logit, or no id left unmasked (sampling.faults)
    EOS_SAMPLED = 2  # the sampled CB0 is the codec EOS
    MTP_FAULT = 3  # one of the row's MTP samples faulted (as CB0_FAULT)
    LENGTH_REACHED = 4  # frames published >= max_frames, or the context has no position left
    MTP_STOP = 5  # the MTP stage decided the stop (an MtpResult's stop flag, MOSS's continue head)
    # Delay pattern (ModelSpec.delay_pattern; false for every other model), about the frame
    # this step publishes:
    RAMP_DONE = 6  # its index is >= Q - 2: the frame after it has every codebook live
    EOC_FRAME = 7  # its codebook 0 is EOC (the wind-down started at or before it)
    # The wind-down's last frame (upstream Higgs / boson-multimodal): codebooks 0..Q-2 are EOC
    # (codebook Q-1 keeps its last real code) and the frame before it had EOC on codebook 0.
    WIND_DONE = 8
    # Stop head (VoxCPM2): the frame this step publishes carries CB0 == the model's EOS id.
    EOS_FRAME = 9
    # Speculative: the token the target sampled at this verify position equals the draft
    # for it (false at the row's last position, which has no draft left to check).
    DRAFT_ACCEPTED = 10

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def bit(self) -> int:
        return 1 << int(self)


# Where each predicate is known: a stage may only read predicates of its own phase.
PREDICATE_PHASE: dict[Predicate, Phase] = {
    Predicate.PROMPT_DONE: Phase.SAMPLE,
    Predicate.CB0_FAULT: Phase.SAMPLE,
    Predicate.EOS_SAMPLED: Phase.SAMPLE,
    Predicate.MTP_FAULT: Phase.MTP,
    Predicate.LENGTH_REACHED: Phase.PUBLISH,
    Predicate.MTP_STOP: Phase.MTP,
    Predicate.RAMP_DONE: Phase.PUBLISH,
    Predicate.EOC_FRAME: Phase.PUBLISH,
    Predicate.WIND_DONE: Phase.PUBLISH,
    Predicate.EOS_FRAME: Phase.PUBLISH,
    Predicate.DRAFT_ACCEPTED: Phase.PUBLISH,
}


def predicates_of(phase: Phase) -> tuple[Predicate, ...]:
    return tuple(p for p in Predicate if PREDICATE_PHASE[p] is phase)


def predicate_named(name: str) -> Predicate:
    try:
        return Predicate[name.upper()]
    except KeyError:
        known = ", ".join(p.label for p in Predicate)
        raise ValueError(f"unknown predicate {name!r}; the vocabulary is: {known}") from None


@attrs.frozen
class Guard:
    """A conjunction: every predicate in `when` holds and none in `unless` does.

    Rendered on diagram edges as `[a & !b]`; handed to `transitions` as conditions= and
    unless=, so the oracle evaluates the very guard the kernels evaluate as bit masks.
    """

    when: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()

    @property
    def predicates(self) -> tuple[str, ...]:
        return (*self.when, *self.unless)

    def resolved(self) -> tuple[tuple[Predicate, ...], tuple[Predicate, ...]]:
        """(when, unless) as Predicates; raises ValueError naming an unknown one."""
        return tuple(map(predicate_named, self.when)), tuple(map(predicate_named, self.unless))

    def masks(self) -> tuple[int, int]:
        """(bits that must be set, bits that must be clear) of the predicate word."""
        when, unless = self.resolved()
        return sum(p.bit for p in set(when)), sum(p.bit for p in set(unless))

    def holds(self, facts: dict[Predicate, bool]) -> bool:
        when, unless = self.resolved()
        return all(facts[p] for p in when) and not any(facts[p] for p in unless)

    def excludes(self, other: "Guard") -> bool:
        """Whether no row can satisfy both (one requires a predicate the other forbids)."""
        a_when, a_unless = self.resolved()
        b_when, b_unless = other.resolved()
        return bool(set(a_when) & set(b_unless) or set(a_unless) & set(b_when))

    def describe(self) -> str:
        parts = [*self.when, *(f"!{u}" for u in self.unless)]
        return " & ".join(parts) if parts else "always"


ALWAYS = Guard()


def covers(guards: Iterable[Guard]) -> dict[Predicate, bool] | None:
    """None when every assignment of the guards' predicates satisfies one of them, else
    an assignment that satisfies none (a row those guards would leave where it is)."""
    guards = list(guards)
    names = sorted({p for g in guards for p in (*g.resolved()[0], *g.resolved()[1])})
    for values in itertools.product((False, True), repeat=len(names)):
        facts = dict(zip(names, values))
        if not any(g.holds(facts) for g in guards):
            return facts
    return None


# -- host-side definitions (per-request executors: oracle driver, interpreter, naive drivers) --
# The device kernels compute the same predicates as masks; tests hold the two to each other.


def prompt_done(num_computed: int, scheduled: int, prompt_len: int) -> bool:
    """PROMPT_DONE for one row: the step's tokens reach the end of the prompt."""
    return num_computed + scheduled >= prompt_len


def length_reached(num_frames: int, max_frames: int, num_computed: int, max_context: int) -> bool:
    """LENGTH_REACHED for one row: the frame budget is spent, or the next input (at position
    num_computed) would not fit the context."""
    return num_frames >= max_frames or num_computed >= max_context


def eos_frame(codes, eos: int | None) -> bool:
    """EOS_FRAME for one row publishing a frame whose codes (ints) start with `codes[0]`."""
    return eos is not None and len(codes) > 0 and int(codes[0]) == eos


def delay_facts(frame_index: int, codes, num_codebooks: int, eoc: int | None,
                previous=None) -> dict[Predicate, bool]:
    """RAMP_DONE, EOC_FRAME and WIND_DONE for one row publishing frame `frame_index` with
    `codes` (a sequence of Q ints) after the frame `previous` (None before the first); all
    false for a model without a delay pattern (eoc None)."""
    if eoc is None:
        return {Predicate.RAMP_DONE: False, Predicate.EOC_FRAME: False, Predicate.WIND_DONE: False}
    winding = num_codebooks == 1 or (previous is not None and int(previous[0]) == eoc)
    return {Predicate.RAMP_DONE: frame_index >= num_codebooks - 2, Predicate.EOC_FRAME: int(codes[0]) == eoc,
            Predicate.WIND_DONE: int(codes[0]) == eoc and winding
            and all(int(c) == eoc for c in list(codes)[: num_codebooks - 1])}
