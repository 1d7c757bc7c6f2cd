"""The lifecycle: spec (single source of truth), compiled table, oracle, diagrams."""

from .oracle import Oracle, RequestFSM
from .spec import (
    HOST_TRIGGERS,
    LIVE_STATES,
    RESTING_STATES,
    TERMINAL_STATES,
    VARIANTS,
    FinishReason,
    LifecycleSpec,
    State,
    Transition,
    Trigger,
    lifecycle_for,
    mtp_lifecycle,
    single_codebook_lifecycle,
)
from .table import ILLEGAL, TransitionTable, compile_table

__all__ = [
    "HOST_TRIGGERS", "LIVE_STATES", "RESTING_STATES", "TERMINAL_STATES", "VARIANTS", "FinishReason",
    "LifecycleSpec", "State", "Transition", "Trigger", "lifecycle_for", "mtp_lifecycle",
    "single_codebook_lifecycle", "Oracle", "RequestFSM", "ILLEGAL", "TransitionTable", "compile_table",
]
