"""What clients ask of the built-in policy between steps: the aborts and preemptions it applies at
its next plan, and the preempted requests waiting, in order, to resume."""

from __future__ import annotations

from ..lifecycle import Trigger
from .ledger import Ledger


class ClientRequests:
    """The Scheduler's client side (it plans from these and commits each plan back to them).
    Every fact about a request is read from its one host record in the ledger."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._aborts: dict[str, None] = {}  # ordered sets
        self._preempts: dict[str, None] = {}
        self._preempted: list[str] = []  # resumed in this order

    def abort(self, request_id: str) -> str:
        """'dropped' (was queued: gone now), 'scheduled' (the next plan aborts it) or
        'ignored' (already ended, already aborting, or unknown)."""
        if self.ledger.drop_queued(request_id) is not None:
            return "dropped"
        record = self.ledger.records.get(request_id)
        if record is None or request_id in self._aborts or record.state in self.ledger.terminal_states:
            return "ignored"
        self._aborts[request_id] = None
        return "scheduled"

    def preempt(self, request_id: str) -> bool:
        """Preempt a request holding a slot in the next plan (e.g. memory pressure seen by the
        caller): a running one, or one the lifecycle lets rest preempted (a starved one)."""
        record = self.ledger.records.get(request_id)
        if record is None or record.slot is None or request_id in self._aborts:
            return False
        if not self.ledger.oracle.may(record, Trigger.PREEMPT):
            return False
        self._preempts[request_id] = None
        return True

    @property
    def num_preempted(self) -> int:
        return len(self._preempted)
