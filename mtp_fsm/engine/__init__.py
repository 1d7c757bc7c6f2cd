"""The lockstep engine, its plan/output types and the host ledger."""

from .engine import LockstepEngine
from .plan import FinishedRequest, Frame, FrameBatch, NewRequest, RowOutput, Span, StepOutput, StepPlan

__all__ = ["LockstepEngine", "FinishedRequest", "Frame", "FrameBatch", "NewRequest", "RowOutput", "Span", "StepOutput", "StepPlan"]
