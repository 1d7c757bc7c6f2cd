"""Every error the engine raises, each naming the request, its state and what was wrong."""

from __future__ import annotations


class MtpFsmError(Exception):
    """Base class of all mtp_fsm errors."""


class LifecycleError(MtpFsmError):
    """A trigger that the lifecycle spec does not allow from the request's current state."""

    def __init__(self, request_id: str, state, trigger, detail: str = "") -> None:
        self.request_id, self.state, self.trigger = request_id, state, trigger
        state_name = getattr(state, "label", state)
        trigger_name = getattr(trigger, "label", trigger)
        msg = f"request {request_id!r} in state {state_name!r}: trigger {trigger_name!r} is not allowed"
        super().__init__(msg + (f" ({detail})" if detail else ""))


class AdmissionError(MtpFsmError):
    """A request rejected before it touched the slot table; nothing else is affected."""

    def __init__(self, request_id: str, reason: str, state: str = "not admitted") -> None:
        self.request_id, self.reason = request_id, reason
        super().__init__(f"request {request_id!r} ({state}): {reason}")


class DuplicateRequestError(AdmissionError):
    pass


class SlotTableFullError(AdmissionError):
    """No free slot: the serving layer should queue the request rather than fail it."""


class UnknownRequestError(MtpFsmError):
    def __init__(self, request_id: str, what: str) -> None:
        self.request_id = request_id
        super().__init__(f"request {request_id!r} is not known to the engine: cannot {what}")


class PlanError(MtpFsmError):
    """A StepPlan that cannot be executed (bad span, unknown request, ...); state unchanged."""

    def __init__(self, request_id: str | None, state: str | None, reason: str) -> None:
        self.request_id, self.state = request_id, state
        who = f"request {request_id!r} in state {state!r}: " if request_id is not None else ""
        super().__init__(who + reason)


class ConfigurationError(MtpFsmError, ValueError):
    """An engine or policy built with a value it cannot run with (names the argument and the value)."""


class LifecycleCompileError(MtpFsmError, ValueError):
    """A lifecycle spec the compiler refuses: the message names the variant, the edge or stage, and why."""


class PlanTypeError(PlanError, TypeError):
    """A StepPlan built from values of the wrong type (e.g. a bare string for a list of ids)."""

    def __init__(self, reason: str) -> None:
        super().__init__(None, None, reason)


class ModelBindingError(MtpFsmError):
    """A model object is already bound to another live engine (its per-slot state, e.g. the
    KV cache, would be shared and silently corrupted)."""


class EngineInvariantError(MtpFsmError):
    """The device reported a broken invariant (sticky error column): a bug, never input."""


class SchedulerStallError(MtpFsmError):
    """Requests are waiting but nothing can be planned (no slot can ever free up)."""


class KernelBackendError(MtpFsmError):
    """The requested kernel backend is not available on this machine."""
