"""The per-request oracle: drives the real `transitions` machine one trigger at a time."""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from transitions import Machine, MachineError

from ..errors import LifecycleError
from .spec import LifecycleSpec, State, Trigger


class RequestFSM:
    """A light model object for the static machine: only a state and the request id."""

    __slots__ = ("state", "request_id")

    def __init__(self, request_id: str, state: State = State.FREE) -> None:
        self.request_id = request_id
        self.state = state.label

    @property
    def code(self) -> State:
        return State[self.state.upper()]


class Oracle:
    """Slow and obviously right: every trigger goes through `Machine.events[name].trigger`.

    Static-machine pattern (one Machine, model=None, no add_model) so holding thousands of
    requests costs one small object each. Counts every fired (trigger, source) pair so a
    test suite can prove it exercised the whole spec.
    """

    def __init__(self, spec: LifecycleSpec) -> None:
        self.spec = spec
        self.machine: Machine = spec.build_machine()
        self.fired: Counter[tuple[Trigger, State]] = Counter()

    def new(self, request_id: str) -> RequestFSM:
        return RequestFSM(request_id)

    def fire(self, fsm: RequestFSM, trigger: Trigger) -> State:
        source = fsm.code
        event = self.machine.events.get(trigger.label)
        # A state outside this variant (e.g. `sampled` without MTP) is as illegal as a
        # missing edge; transitions would raise a bare ValueError for it.
        if event is None or fsm.state not in event.transitions:
            raise LifecycleError(fsm.request_id, source, trigger)
        try:
            event.trigger(fsm)
        except MachineError:
            raise LifecycleError(fsm.request_id, source, trigger) from None
        self.fired[(trigger, source)] += 1
        return fsm.code

    def fire_all(self, fsm: RequestFSM, triggers: Iterable[Trigger]) -> State:
        for trigger in triggers:
            self.fire(fsm, trigger)
        return fsm.code

    def may(self, fsm: RequestFSM, trigger: Trigger) -> bool:
        event = self.machine.events.get(trigger.label)
        return event is not None and fsm.state in event.transitions
