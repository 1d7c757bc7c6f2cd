"""The compiler: spec + stage chains -> the tables every executor runs, with static proofs."""

from __future__ import annotations

import attrs
import torch

from ..errors import LifecycleCompileError
# The tables' layout (re-exported: the executors and tests read it from here too).
from .device_tables import (  # noqa: F401
    CLASS_IN_STEP, CLASS_LIVE, CLASS_TERMINAL, CLASS_VACANT, ILLEGAL, OUTCOME_FIRED, OUTCOME_PUBLISHES,
    OUTCOME_REASON_SHIFT, RULE_DEST, RULE_MUST, RULE_MUST_NOT, RULE_PUBLISHES, RULE_REASON, WORDS, DeviceLifecycle,
    stage_outcomes,
)
from .predicates import PREDICATE_PHASE, Phase, covers
from .spec import LifecycleSpec, Stage, State, Transition, Trigger


@attrs.frozen
class CompiledLifecycle:
    """What the spec compiles to. `rules[RULE_DEST, trigger, state]` is the destination
    (or -1), `rules[RULE_MUST / RULE_MUST_NOT, ...]` the guard as predicate-word masks,
    `rules[RULE_REASON, ...]` the finish reason the edge records, `rules[RULE_PUBLISHES, ...]`
    whether it emits a frame."""

    spec: LifecycleSpec
    rules: torch.Tensor
    state_class: torch.Tensor

    @property
    def name(self) -> str:
        return self.spec.name

    def dest(self, trigger: Trigger, state: State) -> int:
        return int(self.rules[RULE_DEST, trigger, state])

    def legal(self, trigger: Trigger, state: State) -> bool:
        return self.dest(trigger, state) != ILLEGAL

    def edges(self) -> list[tuple[Trigger, State, State]]:
        """Every declared (trigger, source, dest), in code order."""
        dest = self.rules[RULE_DEST]
        return [(t, s, State(int(dest[t, s]))) for t in Trigger for s in State if int(dest[t, s]) != ILLEGAL]

    def states_in(self, class_bit: int) -> frozenset[State]:
        return frozenset(s for s in State if int(self.state_class[s]) & class_bit)

    def chain(self, phase: Phase) -> tuple[Stage, ...]:
        return self.spec.stages_of(phase)

    def to(self, device: torch.device | str) -> DeviceLifecycle:
        chains, host = {}, {}
        for phase in Phase:
            stages = self.spec.stages_of(phase)
            longest = max((len(s.triggers) for s in stages), default=0)
            table = torch.full((len(stages), 1 + longest), ILLEGAL, dtype=torch.int32)
            for i, stage in enumerate(stages):
                table[i, 0] = int(stage.total)
                table[i, 1 : 1 + len(stage.triggers)] = torch.tensor([int(t) for t in stage.triggers])
            chains[phase] = table.to(device)
            host[phase] = tuple((s.total, tuple(int(t) for t in s.triggers)) for s in stages)
        return DeviceLifecycle(self.rules.to(device), self.state_class.to(device), chains, host)


def compile_lifecycle(spec: LifecycleSpec) -> CompiledLifecycle:
    """Compile a spec, refusing (LifecycleCompileError) anything an executor could not run
    deterministically: two edges for one (trigger, source), an in-step edge without a
    guard, an unknown predicate or one read outside its phase, a stage that could fire two
    triggers on one row, a total stage that could leave a row unmoved, a row that could end
    a step in an in-step state."""
    machine = spec.build_machine()  # transitions validates states and edges first
    edges = _edge_map(spec)
    _check_guards(spec, edges)
    rules = torch.full((5, len(Trigger), len(State)), 0, dtype=torch.int32)
    rules[RULE_DEST] = ILLEGAL
    for (trigger, source), t in edges.items():
        if trigger.label not in machine.events or source.label not in machine.events[trigger.label].transitions:
            raise LifecycleCompileError(f"{spec.name}: edge {trigger.label} from {source.label} missing in the machine")
        must, must_not = t.guard.masks() if t.guard is not None else (0, 0)
        rules[:, trigger, source] = torch.tensor([int(t.dest), must, must_not, int(t.reason), int(t.publishes)])
    _check_stages(spec, edges)
    return CompiledLifecycle(spec, rules, _class_words(spec))


def _edge_map(spec: LifecycleSpec) -> dict[tuple[Trigger, State], Transition]:
    edges: dict[tuple[Trigger, State], Transition] = {}
    for t in spec.transitions:
        for source in t.sources:
            if (t.trigger, source) in edges:
                raise LifecycleCompileError(
                    f"{spec.name}: trigger {t.trigger.label!r} from {source.label!r} is declared twice; "
                    "one edge per (trigger, source) keeps the table a function"
                )
            edges[(t.trigger, source)] = t
    return edges


def _where(spec: LifecycleSpec, t: Transition, source: State) -> str:
    return f"{spec.name}: {t.trigger.label} from {source.label} -> {t.dest.label}"


def _check_guards(spec: LifecycleSpec, edges: dict) -> None:
    staged: dict[Trigger, str] = {}
    for stage in spec.stages:
        for trig in stage.triggers:
            if trig in staged:
                raise LifecycleCompileError(
                    f"{spec.name}: trigger {trig.label!r} is fired by stages {staged[trig]!r} and {stage.name!r}; "
                    "an in-step trigger belongs to one stage (its guard reads that stage's predicates)"
                )
            staged[trig] = stage.name
    for (trigger, source), t in edges.items():
        where = _where(spec, t, source)
        if trigger in spec.host_triggers:
            if t.guard is not None:
                raise LifecycleCompileError(f"{where}: a host trigger is decided by the host and takes no guard")
            if trigger in staged:
                raise LifecycleCompileError(f"{where}: a host trigger cannot be fired by a device stage")
            continue
        if t.guard is None:
            raise LifecycleCompileError(
                f"{where}: an in-step transition needs a guard (use ALWAYS when it is unconditional)"
            )
        try:
            t.guard.resolved()
        except ValueError as exc:
            raise LifecycleCompileError(f"{where}: {exc}") from None
        if trigger not in staged:
            raise LifecycleCompileError(f"{where}: an in-step trigger that no stage fires")


def _check_stages(spec: LifecycleSpec, edges: dict) -> None:
    """Follow the states a scheduled row can be in through the pipeline's stages."""
    classes = spec.classes
    for name in ("live", "terminal", "in_step", "vacant"):
        for other in ("live", "terminal", "in_step", "vacant"):
            if name < other and getattr(classes, name) & getattr(classes, other):
                raise LifecycleCompileError(f"{spec.name}: state classes {name} and {other} overlap")
    possible = set(classes.live | classes.terminal)  # what a step may schedule
    if sorted(spec.phase_order) != sorted(Phase):
        raise LifecycleCompileError(f"{spec.name}: phase order {[p.label for p in spec.phase_order]} must name "
                                    "every phase once")
    order = sorted(spec.stages, key=lambda s: spec.phase_order.index(s.phase))
    if [s.name for s in order] != [s.name for s in spec.stages]:
        raise LifecycleCompileError(f"{spec.name}: stages must be declared in pipeline phase order")
    if spec.verify_loop:
        # The SAMPLE and PUBLISH stages repeat per verify position: walk them until the
        # states a row can be in stop growing, then the stages after the loop once.
        looped = [s for s in spec.stages if s.phase in (Phase.SAMPLE, Phase.PUBLISH)]
        if spec.phase_order[:2] != (Phase.SAMPLE, Phase.PUBLISH):
            raise LifecycleCompileError(f"{spec.name}: a verify loop runs phases sample, publish, then mtp")
        possible = _walk(spec, edges, looped, possible)
        while not (after := _walk(spec, edges, looped, possible)) <= possible:
            possible |= after  # a row settles at any position: every count of passes is possible
        possible = _walk(spec, edges, [s for s in spec.stages if s.phase is Phase.MTP], possible)
    else:
        possible = _walk(spec, edges, spec.stages, possible)
    stuck = possible & classes.in_step
    if stuck:
        raise LifecycleCompileError(
            f"{spec.name}: a row can end a step in in-step state(s) {sorted(s.label for s in stuck)}"
        )


def _walk(spec: LifecycleSpec, edges: dict, stages, possible: set) -> set:
    """The states a row can be in after `stages`, from `possible`; refuses two firing
    triggers in one stage and a total stage that could leave a row unmoved."""
    for stage in stages:
        if len(set(stage.triggers)) != len(stage.triggers):
            raise LifecycleCompileError(f"{spec.name}: stage {stage.name!r} names a trigger twice")
        moved, reached = set(), set()
        for state in sorted(possible):
            entries = [edges[(trig, state)] for trig in stage.triggers if (trig, state) in edges]
            for t in entries:
                _check_phase(spec, stage, t, state)
            for i, a in enumerate(entries):
                for b in entries[i + 1 :]:
                    if not a.guard.excludes(b.guard):
                        raise LifecycleCompileError(
                            f"{spec.name}: stage {stage.name!r} can fire both {a.trigger.label} "
                            f"[{a.guard.describe()}] and {b.trigger.label} [{b.guard.describe()}] on a row in "
                            f"state {state.label}: their guards are not exclusive"
                        )
            gap = covers(t.guard for t in entries)
            if gap is None:
                moved.add(state)
            elif stage.total:
                facts = ", ".join(f"{p.label}={v}" for p, v in gap.items()) or "any row"
                raise LifecycleCompileError(
                    f"{spec.name}: total stage {stage.name!r} leaves a row in state {state.label} unmoved when {facts}"
                )
            reached |= {t.dest for t in entries}
        possible = (possible - moved) | reached
    return possible


def _check_phase(spec: LifecycleSpec, stage: Stage, t: Transition, state: State) -> None:
    when, unless = t.guard.resolved()
    for p in (*when, *unless):
        if PREDICATE_PHASE[p] is not stage.phase:
            raise LifecycleCompileError(
                f"{_where(spec, t, state)}: guard reads {p.label}, known in phase {PREDICATE_PHASE[p].label}, "
                f"but stage {stage.name!r} runs in phase {stage.phase.label}"
            )
    if t.publishes and stage.phase is not Phase.PUBLISH:
        raise LifecycleCompileError(f"{_where(spec, t, state)}: only a publish-phase stage can emit a frame")


def _class_words(spec: LifecycleSpec) -> torch.Tensor:
    words = torch.zeros(len(State), dtype=torch.int32)
    c = spec.classes
    for bit, states in ((CLASS_LIVE, c.live), (CLASS_TERMINAL, c.terminal), (CLASS_IN_STEP, c.in_step), (CLASS_VACANT, c.vacant)):
        for s in states:
            words[s] |= bit
    return words


__all__ = [
    "CLASS_IN_STEP", "CLASS_LIVE", "CLASS_TERMINAL", "CLASS_VACANT", "ILLEGAL", "RULE_DEST", "RULE_MUST",
    "RULE_MUST_NOT", "RULE_PUBLISHES", "RULE_REASON", "CompiledLifecycle", "DeviceLifecycle",
    "LifecycleCompileError", "OUTCOME_FIRED", "OUTCOME_PUBLISHES", "OUTCOME_REASON_SHIFT", "WORDS", "compile_lifecycle",
    "stage_outcomes",
]
