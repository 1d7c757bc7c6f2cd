"""The requests the engine holds: the request table, the records viewing it, slot ownership, serials
and the queue, with the lifecycle's state classes they are read by; looked up, queued and dropped by id."""

from __future__ import annotations

import numpy as np

from ..errors import DuplicateRequestError, UnknownRequestError
from ..lifecycle import CLASS_LIVE, CLASS_TERMINAL, CLASS_VACANT, CompiledLifecycle, State, Trigger
from ..lifecycle.device_tables import RULE_DEST
from ..model_api import TalkerModel
from ..slots import SlotAllocator, SlotTable
from .admission import Admission
from .plan import NewRequest
from .records import RequestRecord, RequestTable


class RequestRegistry:
    """Who is in the engine, and in which row: the Ledger's request side (the Ledger adds
    staging a step and writing its output back). Host events change it through `host_events`."""

    def __init__(self, model: TalkerModel, table: SlotTable, compiled: CompiledLifecycle, *, deferred: bool) -> None:
        self.model, self.table, self.compiled = model, table, compiled
        self.live_states = compiled.states_in(CLASS_LIVE)
        self.terminal_states = compiled.states_in(CLASS_TERMINAL)
        # Per state code: live / terminal (a lookup, not np.isin, which costs tens of µs a call).
        self._is_live = _class_lookup(self.live_states)
        self._is_terminal = _class_lookup(self.terminal_states)
        self._dest = compiled.rules[RULE_DEST].numpy()  # [trigger, state] -> state
        # Where an admitted row starts: admission from the (one) vacant state.
        (vacant,) = compiled.states_in(CLASS_VACANT)
        self.vacant_state = int(vacant)
        self._admitted_state = State(self._dest[Trigger.ADMIT, vacant])
        self.spec = model.spec
        self.allocator = SlotAllocator(table.max_slots)
        self.records: dict[str, RequestRecord] = {}
        self.next_serial = 1  # serials are never reused: a stale row cannot pass the identity guard
        self.admission = Admission(model, deferred=deferred)
        self.queued: dict[str, RequestRecord] = {}  # enqueued, not yet admitted (state free, no slot)
        # The one owner of every request's state and counters on the host (records view it).
        self.rows = RequestTable(table.max_slots + 1)
        # Bumped whenever a request gains or loses a record or a slot: rows held as loaded by
        # the step inputs are the steady batch (checked on arrays) only within one generation.
        self.generation = 0

    def record(self, request_id: str, what: str) -> RequestRecord:
        """The record of a known request; UnknownRequestError saying what was attempted."""
        record = self.records.get(request_id) or self.queued.get(request_id)
        if record is None:
            raise UnknownRequestError(request_id, what)
        return record

    def all_records(self):
        """(request id, record) for every request the engine holds, queued ones last."""
        return [*self.records.items(), *self.queued.items()]

    # -- requests queued by the engine's built-in policy ----------------------------------

    def enqueue(self, req: NewRequest) -> RequestRecord:
        """Validate a request now and hold its record (state free, no slot) until a plan admits it."""
        rid = req.request_id
        if rid in self.records or rid in self.queued:
            known = self.records.get(rid) or self.queued[rid]
            raise DuplicateRequestError(rid, "a request with this id is already in the engine", known.state.label)
        record = RequestRecord(req, self.rows, self.admission.admissible(req))
        self.queued[rid] = record
        return record

    def drop_queued(self, request_id: str) -> RequestRecord | None:
        record = self.queued.pop(request_id, None)
        if record is not None:
            self.admission.forget(record.request)
        return record

    def ready_to_resume(self, record: RequestRecord) -> bool:
        """A resume replays the published frames with their text steps: with a conditioning
        feed, every row they read must have arrived."""
        return not self.spec.has_feed or record.num_frames == 0 or record.has_feed_row(record.num_frames - 1)

    def resume_prompt_len(self, record: RequestRecord) -> int:
        return record.base_prompt_len + record.num_frames


def _class_lookup(states) -> np.ndarray:
    """bool per state code (every code a slot-state byte can hold): member of `states`."""
    lookup = np.zeros(256, dtype=bool)
    lookup[[int(s) for s in states]] = True
    return lookup
