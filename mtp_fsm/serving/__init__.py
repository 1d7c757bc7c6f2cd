"""Embedded serving default: request queue, scheduler policy, run loop, sinks, metrics."""

from .chunking import AudioChunk, ChunkingSink, FrameOrderError
from .metrics import STATE_COLUMNS, RequestMetrics, ServingMetrics, ServingSummary, StepMetrics
from .queue import RequestQueue
from .runner import ServingLoop, ServingStallError
from .scheduler import Scheduler, SchedulerError
from .sinks import CallbackSink, InMemorySink, JsonlSink, Sink

__all__ = [
    "AudioChunk", "CallbackSink", "ChunkingSink", "FrameOrderError", "InMemorySink", "JsonlSink",
    "RequestMetrics", "RequestQueue", "STATE_COLUMNS", "Scheduler", "SchedulerError", "ServingLoop",
    "ServingMetrics", "ServingStallError", "ServingSummary", "Sink", "StepMetrics",
]
