"""The lifecycle: spec with guards and stage chains (single source of truth), compiler, oracle, diagrams."""

from .compiled import (
    CLASS_IN_STEP, CLASS_LIVE, CLASS_TERMINAL, CLASS_VACANT, ILLEGAL, CompiledLifecycle, DeviceLifecycle,
    LifecycleCompileError, compile_lifecycle,
)
from .oracle import Oracle, RequestFSM
from .predicates import ALWAYS, PREDICATE_PHASE, Guard, Phase, Predicate, length_reached, predicates_of, prompt_done
from .spec import FinishReason, LifecycleSpec, Stage, State, StateClasses, Transition, Trigger
from .variants import HOST_TRIGGERS, VARIANTS, lifecycle_for, mtp_lifecycle, single_codebook_lifecycle

__all__ = [
    "ALWAYS", "CLASS_IN_STEP", "CLASS_LIVE", "CLASS_TERMINAL", "CLASS_VACANT", "HOST_TRIGGERS", "ILLEGAL",
    "PREDICATE_PHASE", "VARIANTS", "CompiledLifecycle", "DeviceLifecycle", "FinishReason", "Guard",
    "LifecycleCompileError", "LifecycleSpec", "Oracle", "Phase", "Predicate", "RequestFSM", "Stage", "State",
    "StateClasses", "Transition", "Trigger", "compile_lifecycle", "lifecycle_for", "mtp_lifecycle",
    "length_reached", "predicates_of", "prompt_done", "single_codebook_lifecycle",
]
