"""Embedded serving default: run loop, sinks (callback, in-memory, JSONL, vocoder chunking, audio out), metrics."""

from ..engine.scheduler import SchedulerStallError, SchedulingPolicy
from .audio_stream import AudioStream, AudioStreamError, PcmChunk
from .chunking import AudioChunk, ChunkingSink, FrameOrderError
from .codec import CodecDecoder, CodecUnavailableError, load_decoder
from .metrics import STATE_COLUMNS, RequestMetrics, ServingMetrics, ServingSummary, StepMetrics
from .runner import ServingLoop, ServingStallError
from .sinks import CallbackSink, InMemorySink, JsonlSink, Sink

__all__ = [
    "AudioChunk", "AudioStream", "AudioStreamError", "CallbackSink", "ChunkingSink", "CodecDecoder",
    "CodecUnavailableError", "FrameOrderError", "InMemorySink", "JsonlSink", "PcmChunk", "RequestMetrics",
    "STATE_COLUMNS", "SchedulerStallError", "SchedulingPolicy", "ServingLoop", "ServingMetrics",
    "ServingStallError", "ServingSummary", "Sink", "StepMetrics", "load_decoder",
]
