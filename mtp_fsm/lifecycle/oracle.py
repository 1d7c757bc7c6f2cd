"""The per-request oracle: drives the real `transitions` machine one trigger at a time."""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from transitions import Machine, MachineError

from ..errors import LifecycleError
from .predicates import PREDICATE_PHASE, Phase, Predicate
from .spec import LifecycleSpec, Stage, State, Trigger

_PREDICATE_SLOTS = tuple(p.label for p in Predicate)


class RequestFSM:
    """A light model object for the static machine: a state, the request id, and this
    stage's predicate values (read by `transitions` as the edges' conditions)."""

    __slots__ = ("state", "request_id", *_PREDICATE_SLOTS)

    def __init__(self, request_id: str, state: State = State.FREE) -> None:
        self.request_id = request_id
        self.state = state.label

    @property
    def code(self) -> State:
        return State[self.state.upper()]

    def observe(self, facts: dict[Predicate, bool]) -> None:
        """Set the predicates of one stage; the others become unreadable (a guard that
        reads a predicate its stage does not know fails loudly, never silently False)."""
        for name in _PREDICATE_SLOTS:
            if hasattr(self, name):
                delattr(self, name)
        for p, value in facts.items():
            setattr(self, p.label, bool(value))


class Oracle:
    """Slow and obviously right: every trigger goes through `Machine.events[name].trigger`.

    Static-machine pattern (one Machine, model=None, no add_model) so holding thousands of
    requests costs one small object each. Counts every fired (trigger, source) pair so a
    test suite can prove it exercised the whole spec.
    """

    def __init__(self, spec: LifecycleSpec, model_attribute: str = "state") -> None:
        """model_attribute: where a model object keeps its state label (RequestFSM: `state`;
        the engine's request records: `label`, a view of the host request table)."""
        self.spec = spec
        self._attribute = model_attribute
        self.machine: Machine = spec.build_machine(model_attribute=model_attribute)
        self._read = spec.predicates_read()  # the facts a stage needs: those some guard reads
        self.fired: Counter[tuple[Trigger, State]] = Counter()

    def new(self, request_id: str) -> RequestFSM:
        return RequestFSM(request_id)

    def fire(self, fsm: RequestFSM, trigger: Trigger) -> State:
        """Fire a host trigger (no guard); raises LifecycleError naming the request if illegal."""
        source = fsm.code
        if not self.may(fsm, trigger):
            raise LifecycleError(fsm.request_id, source, trigger)
        try:
            done = self.machine.events[trigger.label].trigger(fsm)
        except MachineError:
            raise LifecycleError(fsm.request_id, source, trigger) from None
        if not done:
            raise LifecycleError(fsm.request_id, source, trigger, "its guard does not hold")
        self.fired[(trigger, source)] += 1
        return fsm.code

    def fire_all(self, fsm: RequestFSM, triggers: Iterable[Trigger]) -> State:
        for trigger in triggers:
            self.fire(fsm, trigger)
        return fsm.code

    def may(self, fsm: RequestFSM, trigger: Trigger) -> bool:
        # A state outside this variant (e.g. `sampled` without MTP) is as illegal as a missing edge.
        event = self.machine.events.get(trigger.label)
        return event is not None and getattr(fsm, self._attribute) in event.transitions

    def run_stage(self, fsm: RequestFSM, stage: Stage, facts: dict[Predicate, bool]) -> Trigger | None:
        """Try the stage's triggers in order through `transitions` (which evaluates each
        edge's conditions on `facts`); return the one that fired, or None.

        A total stage that moves nothing is a spec bug the compiler should have refused;
        it raises here too, naming the request.
        """
        missing = [p.label for p in Predicate
                   if PREDICATE_PHASE[p] is stage.phase and p in self._read and p not in facts]
        if missing:
            raise ValueError(f"stage {stage.name!r} of request {fsm.request_id!r} needs predicates {missing}")
        fsm.observe(facts)
        source = fsm.code
        try:
            for trigger in stage.triggers:
                if self.may(fsm, trigger) and self.machine.events[trigger.label].trigger(fsm):
                    self.fired[(trigger, source)] += 1
                    return trigger
        finally:
            fsm.observe({})
        if stage.total:
            raise LifecycleError(fsm.request_id, source, stage.name, f"total stage moved nothing with {facts}")
        return None

    def run_phase(self, fsm: RequestFSM, phase: Phase, facts_for) -> list[Trigger]:
        """Every stage of `phase` in order; facts_for(stage, fired_so_far) gives each stage's
        predicates (they may depend on what fired before, e.g. a frame count after publish)."""
        edges = self.run_phase_edges(fsm, phase, lambda stage, fired: facts_for(stage, [t for t, _ in fired]))
        return [trigger for trigger, _ in edges]

    def run_phase_edges(self, fsm: RequestFSM, phase: Phase, facts_for) -> list[tuple[Trigger, State]]:
        """As run_phase, with edges as (trigger, source state), also in facts_for's `fired`."""
        fired: list[tuple[Trigger, State]] = []
        for stage in self.spec.stages_of(phase):
            source = fsm.code
            trigger = self.run_stage(fsm, stage, facts_for(stage, list(fired)))
            if trigger is not None:
                fired.append((trigger, source))
        return fired
