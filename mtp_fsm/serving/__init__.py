"""Embedded serving default: run loop, sinks (callback, in-memory, JSONL, vocoder chunking), metrics."""

from ..engine.scheduler import SchedulerStallError, SchedulingPolicy
from .chunking import AudioChunk, ChunkingSink, FrameOrderError
from .metrics import STATE_COLUMNS, RequestMetrics, ServingMetrics, ServingSummary, StepMetrics
from .runner import ServingLoop, ServingStallError
from .sinks import CallbackSink, InMemorySink, JsonlSink, Sink

__all__ = [
    "AudioChunk", "CallbackSink", "ChunkingSink", "FrameOrderError", "InMemorySink", "JsonlSink",
    "RequestMetrics", "STATE_COLUMNS", "SchedulerStallError", "SchedulingPolicy", "ServingLoop",
    "ServingMetrics", "ServingStallError", "ServingSummary", "Sink", "StepMetrics",
]
