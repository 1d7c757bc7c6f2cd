"""SpeechMetrics: the speech API's Prometheus series (time to first audio from arrival, RTF, frames, load, failures)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# First audio on a CPU ranges from tens of ms (idle, tiny model) to seconds (a queue): log-spaced buckets.
_TTFA_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0)
_RTF_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0, 8.0, 16.0)


class SpeechMetrics:
    """Registered in `registry` (the embedded server's own, or prometheus_client's default registry in a
    vLLM API process, whose /metrics then shows them beside vLLM's). Gauges sum over processes in
    prometheus_client's multiprocess mode (vLLM sets it up with --api-server-count > 1).

    - time to first audio: from the request's arrival at the API (before validation and queueing) to
      its first audio bytes (or, for response_format codes, its first frame) being ready to send;
    - real-time factor: arrival to last audio over the audio's duration (below 1: faster than playback);
    - frames and audio seconds produced (rates of these are frames/s and audio s/s);
    - requests queued (accepted, no frame yet) and active (streaming);
    - finished requests by reason (eos, length, abort, error) as clients saw them, and as the engine
      ended them (engine_ends: also requests whose client left), and refusals / failures by reason
      (invalid_field, unknown_field, unauthorized, input_too_long, too_many_streams, model_fault, ...).
    """

    def __init__(self, registry: CollectorRegistry | None = None, prefix: str = "mtp_fsm_speech") -> None:
        kw = {"registry": registry} if registry is not None else {}
        self.ttfa = Histogram(f"{prefix}_time_to_first_audio_seconds",
                              "Time from a request's arrival to its first audio (or first frame for codes)",
                              buckets=_TTFA_BUCKETS, **kw)
        self.rtf = Histogram(f"{prefix}_real_time_factor",
                             "Arrival to last audio sample over the audio's duration, per request",
                             buckets=_RTF_BUCKETS, **kw)
        self.frames = Counter(f"{prefix}_frames", "Frames (codec steps) delivered to clients", **kw)
        self.audio_seconds = Counter(f"{prefix}_audio_seconds", "Seconds of audio delivered to clients", **kw)
        self.queued = Gauge(f"{prefix}_requests_queued", "Requests accepted whose first frame has not arrived",
                            multiprocess_mode="livesum", **kw)
        self.active = Gauge(f"{prefix}_requests_active", "Requests producing frames or audio now",
                            multiprocess_mode="livesum", **kw)
        self.finished = Counter(f"{prefix}_requests_finished", "Requests ended, by finish reason",
                                ["reason"], **kw)
        self.failures = Counter(f"{prefix}_failures", "Requests refused or failed, by reason", ["status", "reason"],
                                **kw)
        self.aborts = Counter(f"{prefix}_aborts", "Requests aborted, by why (client_disconnect, server_shutdown)",
                              ["reason"], **kw)
        # What the engine says, also for requests whose client has left (a disconnect shows up here as
        # abort once the engine has really stopped the request).
        self.engine_ends = Counter(f"{prefix}_engine_ends", "Requests ended in the engine, by finish reason",
                                   ["reason"], **kw)

    def failure(self, status: int, reason: str) -> None:
        self.failures.labels(status=str(status), reason=reason).inc()
