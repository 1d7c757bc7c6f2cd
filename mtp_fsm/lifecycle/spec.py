"""The lifecycle declaration types: states, triggers, guarded transitions, stages, state classes."""

from __future__ import annotations

import enum

import attrs
from transitions import Machine

from .predicates import Guard, Phase


class State(enum.IntEnum):
    """Every state a request (or the slot row holding it) can be in; codes are stable."""

    FREE = 0  # slot row owned by no request
    WAITING = 1  # admitted, row initialised, no prompt token computed
    PREFILLING = 2  # part of the prompt computed (chunked prefill)
    DECODING = 3  # prompt complete; next input = cached frame embedding + text step
    SAMPLED = 4  # within a step: CB0 sampled and kept
    FRAME_READY = 5  # within a step: all Q codebooks of the frame are known
    FINISHED = 6  # terminal: eos or length
    ABORTED = 7  # terminal: client cancel or error
    PREEMPTED = 8  # slot released, resumable
    STARVED = 9  # holds its slot, not schedulable: the conditioning row its next step reads has not arrived
    PENDING = 10  # deferred schedule: CB0 sampled, hidden cached; the frame's MTP runs first thing next step
    RAMP_UP = 11  # delay pattern: decoding, and the next frame still has codebooks forced to BOC
    WIND_DOWN = 12  # delay pattern: codebook 0 emitted EOC; the next frames lock one more codebook to EOC each
    VERIFYING = 13  # speculative, within a step: every draft so far matched; the next verify position is sampled
    DRAFTING = 14  # speculative, within a step: verification settled (a draft missed, or none was left); drafts next

    @property
    def label(self) -> str:
        return self.name.lower()


class Trigger(enum.IntEnum):
    """Every trigger of the lifecycle; codes index the compiled tables."""

    ADMIT = 0
    PREFILL = 1  # a non-final prefill chunk was computed
    SAMPLE = 2  # final prefill chunk or decode row: CB0 sampled and kept
    EOS = 3  # the sampled CB0 is the codec EOS: no frame
    MTP = 4  # the MTP stage filled codebooks 1..Q-1
    PUBLISH = 5  # the frame was written to the step output
    FINISH_LENGTH = 6  # frame budget or context exhausted after a publish
    OVERRUN = 7  # a terminal row scheduled once more (async scheduling): publishes nothing
    PREEMPT = 8
    RESUME = 9
    ABORT = 10  # host: client cancel, or a model exception ending the step's requests
    RELEASE = 11
    FAIL = 12  # intake: a faulty CB0 sample (NaN / +inf logit, nothing unmasked) ends the request with reason error
    MTP_FAIL = 13  # MTP stage: a faulty MTP sample ends the request with reason error
    MTP_STOP = 14  # MTP stage: the MTP result says stop; no frame, reason eos
    STARVE = 15  # host: a decoding request's next conditioning row is missing
    FEED = 16  # host: the missing conditioning row arrived (or the feed finished)
    RAMP = 17  # delay pattern: a ramp-up frame was published (the next one still ramps)
    WIND = 18  # delay pattern: a frame whose codebook 0 is EOC was published (wind-down)
    WOUND_DOWN = 19  # delay pattern: the wind-down's last frame was published: reason eos
    LAST_FRAME = 20  # stop head: the published frame's CB0 was the stop (EOS) class: it was the last, reason eos
    ACCEPT = 21  # speculative: the target's token equals the draft: published, the next position is verified
    BONUS = 22  # speculative: the target's token where the draft missed (or after the last draft): published, settles
    REJECT = 23  # speculative: a verify position past the settling one: its draft is rejected, nothing computed is kept
    DRAFT = 24  # speculative: the drafter proposed the next step's tokens from the accepted ones

    @property
    def label(self) -> str:
        return self.name.lower()


class FinishReason(enum.IntEnum):
    NONE = 0
    EOS = 1
    LENGTH = 2
    ABORT = 4
    ERROR = 5

    @property
    def label(self) -> str:
        return self.name.lower()


@attrs.frozen
class Transition:
    """An edge (or one edge per source). `guard` is None for host triggers, which the host
    decides; every in-step edge carries a guard (`ALWAYS` when unconditional). `reason` is
    the finish reason the edge records; `publishes` marks the edge that emits a frame."""

    trigger: Trigger
    sources: tuple[State, ...]
    dest: State
    guard: Guard | None = None
    reason: FinishReason = FinishReason.NONE
    publishes: bool = False


@attrs.frozen
class Stage:
    """One link of the device pipeline: the triggers it may fire, tried in order; at most
    one fires per row (the compiler proves their guards exclusive). A `total` stage must
    move every row it sees (the compiler proves its guards cover every case)."""

    name: str
    phase: Phase
    triggers: tuple[Trigger, ...]
    total: bool = False


@attrs.frozen
class StateClasses:
    """Named sets of states the host and the kernels reason with (never a list of names
    restated in code): `live` rows compute tokens, `terminal` rows only overrun, `in_step`
    states exist only inside a step, `vacant` rows have no owner."""

    live: frozenset[State]
    terminal: frozenset[State]
    in_step: frozenset[State]
    vacant: frozenset[State]

    def resting(self, states) -> frozenset[State]:
        return frozenset(states) - self.in_step


@attrs.frozen
class LifecycleSpec:
    """One lifecycle variant: guarded transitions, the stage chains, the state classes,
    and the `transitions` machine built from them (the single source of truth)."""

    name: str
    title: str
    transitions: tuple[Transition, ...]
    stages: tuple[Stage, ...]
    classes: StateClasses
    host_triggers: frozenset[Trigger]
    # The order a step runs the phases in. (MTP, PUBLISH, SAMPLE) is the deferred schedule:
    # a frame's MTP runs at the start of the step after its CB0 was sampled, from the hidden
    # state cached then, and the frame is published before the step's own forward.
    phase_order: tuple[Phase, ...] = (Phase.SAMPLE, Phase.MTP, Phase.PUBLISH)
    # Speculative decoding: the SAMPLE and PUBLISH phases run once per verify position of a
    # row (its last accepted token, then each draft), then the MTP phase (the drafter) once.
    verify_loop: bool = False

    @property
    def deferred(self) -> bool:
        return self.phase_order[0] is Phase.MTP

    @property
    def states(self) -> tuple[State, ...]:
        used = {s for t in self.transitions for s in (*t.sources, t.dest)}
        return tuple(s for s in State if s in used)

    @property
    def triggers(self) -> tuple[Trigger, ...]:
        used = {t.trigger for t in self.transitions}
        return tuple(t for t in Trigger if t in used)

    @property
    def publishes_stop_frame(self) -> bool:
        """Whether a request's eos ending is decided at publication, after its last frame was
        published in the same step (stop head, delay pattern), rather than before any frame."""
        publish = {t for s in self.stages_of(Phase.PUBLISH) for t in s.triggers}
        return any(t.reason is FinishReason.EOS and t.trigger in publish for t in self.transitions)

    def stages_of(self, phase: Phase) -> tuple[Stage, ...]:
        return tuple(s for s in self.stages if s.phase is phase)

    def predicates_read(self) -> frozenset:
        """Every predicate some edge's guard reads."""
        return frozenset(p for t in self.transitions if t.guard is not None for side in t.guard.resolved() for p in side)

    def build_machine(self, machine_cls: type[Machine] = Machine, model=None, **kwargs) -> Machine:
        """A static machine (model=None) over these transitions, guards as conditions.

        Diagrams pass a GraphMachine class and a throwaway model (graphs hang off models).
        """
        edges = []
        for t in self.transitions:
            edge = {"trigger": t.trigger.label, "source": [s.label for s in t.sources], "dest": t.dest.label}
            if t.guard is not None and t.guard.when:
                edge["conditions"] = list(t.guard.when)
            if t.guard is not None and t.guard.unless:
                edge["unless"] = list(t.guard.unless)
            edges.append(edge)
        return machine_cls(
            model=model,
            states=[s.label for s in self.states],
            transitions=edges,
            initial=State.FREE.label,
            auto_transitions=False,
            ignore_invalid_triggers=False,
            **kwargs,
        )

    def with_edge(self, trigger: Trigger, source: State, **changes) -> "LifecycleSpec":
        """This spec with the edge (trigger, source) changed (e.g. guard=...), split out of
        its Transition; for variants and for tests that mutate a spec."""
        edges: list[Transition] = []
        for t in self.transitions:
            if t.trigger is trigger and source in t.sources:
                rest = tuple(s for s in t.sources if s is not source)
                edges += [attrs.evolve(t, sources=rest)] if rest else []
                edges.append(attrs.evolve(t, sources=(source,), **changes))
            else:
                edges.append(t)
        return attrs.evolve(self, name=f"{self.name}+{trigger.label}@{source.label}", transitions=tuple(edges))

    def transition(self, trigger: Trigger, source: State) -> Transition | None:
        """The declared edge for (trigger, source), or None."""
        for t in self.transitions:
            if t.trigger is trigger and source in t.sources:
                return t
        return None
