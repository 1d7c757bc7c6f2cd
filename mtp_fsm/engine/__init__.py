"""The lockstep engine, its plan/output types, the host ledger and the built-in scheduling policy."""

from ..errors import SchedulerStallError
from .draft_policy import DraftPolicy
from .engine import LockstepEngine, ModelFault
from .feed import FeedError
from .outputs import FinishedRequest, Frame, FrameBatch, Generation, RowOutput, StepOutput
from .plan import NewRequest, Span, StepPlan
from .records import RequestRecord
from .scheduling_policy import SchedulingPolicy

__all__ = [
    "DraftPolicy", "FeedError", "FinishedRequest", "Frame", "FrameBatch", "Generation", "LockstepEngine", "ModelFault", "NewRequest",
    "RequestRecord", "RowOutput", "SchedulerStallError", "SchedulingPolicy", "Span", "StepOutput", "StepPlan",
]
