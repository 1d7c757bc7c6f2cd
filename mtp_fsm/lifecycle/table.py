"""The dense transition table [trigger, state] -> destination, compiled from the machine."""

from __future__ import annotations

import attrs
import torch

from .spec import LifecycleSpec, State, Trigger

ILLEGAL = -1


@attrs.frozen
class TransitionTable:
    """`table[trigger, state]` is the destination state code, or -1 where illegal.

    Compiled by walking the `transitions` machine's events, so the kernels can never
    disagree with the declaration the diagrams and the oracle are built from.
    """

    spec_name: str
    table: torch.Tensor  # int32 [len(Trigger), len(State)]

    def dest(self, trigger: Trigger, state: State) -> int:
        return int(self.table[trigger, state])

    def legal(self, trigger: Trigger, state: State) -> bool:
        return self.dest(trigger, state) != ILLEGAL

    def edges(self) -> list[tuple[Trigger, State, State]]:
        """Every declared (trigger, source, dest), in code order."""
        return [
            (trig, src, State(int(self.table[trig, src])))
            for trig in Trigger
            for src in State
            if int(self.table[trig, src]) != ILLEGAL
        ]

    def to(self, device: torch.device | str) -> torch.Tensor:
        return self.table.to(device)


def compile_table(spec: LifecycleSpec) -> TransitionTable:
    machine = spec.build_machine()
    table = torch.full((len(Trigger), len(State)), ILLEGAL, dtype=torch.int32)
    for trigger_name, event in machine.events.items():
        trigger = Trigger[trigger_name.upper()]
        for source_name, transitions in event.transitions.items():
            if len(transitions) != 1 or transitions[0].conditions:
                # Guards live in the kernels (phase, EOS, budget); the table must stay a function.
                raise ValueError(f"{spec.name}: trigger {trigger_name!r} from {source_name!r} is not a plain edge")
            table[trigger, State[source_name.upper()]] = State[transitions[0].dest.upper()]
    return TransitionTable(spec.name, table)
