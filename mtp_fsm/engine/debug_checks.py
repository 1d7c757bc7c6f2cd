"""The engine's debug mode (`LockstepEngine(..., debug=True)`): after every step, the host request
table against the device slot table, and every row's state move against the `transitions` machine."""

from __future__ import annotations

import itertools

import numpy as np

from ..errors import EngineInvariantError, LifecycleError
from ..lifecycle import Oracle, RequestFSM, State
from ..lifecycle.predicates import PREDICATE_PHASE
from ..lifecycle.spec import LifecycleSpec

# Host request-table column -> device slot-table column.
_COLUMNS = {"state": "state", "serial": "serial", "prompt_len": "prompt_len", "num_computed": "num_computed",
            "num_frames": "num_frames", "reason": "finish_reason"}


def reachable_in_a_step(spec: LifecycleSpec) -> dict[State, frozenset[State]]:
    """State -> every state a row can be in after one step's device stages, as the spec's own
    `transitions` machine says: each stage chain is run through `Oracle.run_stage` from every
    state under every assignment of the predicates its phase reads, and the moves are closed
    over (stages in any order, any number of times: a speculative step loops its stages). It
    never reads the compiled tables the kernels execute."""
    oracle, read = Oracle(spec), spec.predicates_read()
    moves: dict[State, set[State]] = {s: {s} for s in spec.states}
    for stage in spec.stages:
        needed = [p for p in read if PREDICATE_PHASE[p] is stage.phase]
        for source in spec.states:
            for values in itertools.product((False, True), repeat=len(needed)):
                fsm = RequestFSM("debug", source)
                try:
                    oracle.run_stage(fsm, stage, dict(zip(needed, values)))
                except LifecycleError:  # a total stage that cannot move this state: no move from it
                    continue
                moves[source].add(fsm.code)
    closure = {}
    for source in spec.states:
        seen, todo = {source}, [source]
        while todo:
            for nxt in moves[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        closure[source] = frozenset(seen)
    return closure


class DebugChecks:
    """Raises EngineInvariantError, naming the request, at the first step after which the host
    and the device disagree or a row moved where no sequence of the spec's stages leads."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.reachable = reachable_in_a_step(engine.lifecycle)
        self._before: np.ndarray | None = None

    def staged(self, host) -> None:
        """Each row's state after the step boundary's host events (before the device stages)."""
        self._before = self.engine.ledger.rows.state[host.slots_np].copy()

    def finished(self, host) -> None:
        engine, ledger = self.engine, self.engine.ledger
        for row, record in enumerate(host.row_records):
            if record is None or self._before is None:
                continue
            before, after = State(int(self._before[row])), record.state if record.slot is not None else None
            if after is not None and after not in self.reachable[before]:
                raise EngineInvariantError(
                    f"debug: request {record.request_id!r} moved {before.label!r} -> {after.label!r} in step "
                    f"{engine.step_count - 1}, which no sequence of the lifecycle's stages allows")
        device = {name: getattr(engine.table, column).cpu().numpy() for name, column in _COLUMNS.items()}
        for rid, record in ledger.records.items():
            if record.slot is None:
                continue
            for name, values in device.items():
                host_value = int(getattr(ledger.rows, name)[record.slot])
                if host_value != int(values[record.slot]):
                    raise EngineInvariantError(
                        f"debug: request {rid!r} (slot {record.slot}, state {record.state.label!r}): host {name} "
                        f"{host_value} != device {int(values[record.slot])} after step {engine.step_count - 1}")
