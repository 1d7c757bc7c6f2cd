"""AudioSummary: first-audio latency from request arrival and real-time factors of an AudioStream's requests."""

from __future__ import annotations

import attrs

from .._util.stats import percentile
from .audio_stream import AudioStream
from .metrics import ServingMetrics


@attrs.frozen
class AudioSummary:
    """first_audio_ms: from submit to the first decoded samples. decoder_rtf: decoder compute time over
    audio seconds produced (below 1: the decoder keeps up with playback). stream_rtf: per request,
    arrival to last samples over its audio duration (p50)."""

    num_requests: int
    audio_seconds: float
    first_audio_ms_p50: float | None
    first_audio_ms_p95: float | None
    decoder_rtf: float | None
    stream_rtf_p50: float | None
    decode_calls: int
    windows: int
    errors: int

    def lines(self) -> list[str]:
        def ms(v):
            return "-" if v is None else f"{v:.1f} ms"

        def x(v):
            return "-" if v is None else f"{v:.3f}"

        return [
            f"audio: {self.num_requests} requests, {self.audio_seconds:.2f} s of audio, "
            f"{self.windows} windows in {self.decode_calls} decoder calls, {self.errors} failed",
            f"first audio from arrival: p50 {ms(self.first_audio_ms_p50)}, p95 {ms(self.first_audio_ms_p95)}",
            f"real-time factor: decoder {x(self.decoder_rtf)}, arrival-to-last-sample p50 {x(self.stream_rtf_p50)}",
        ]


def summarize(stream: AudioStream, metrics: ServingMetrics) -> AudioSummary:
    """The stream's requests that metrics still holds (submit times share the stream's clock)."""
    rate = stream.timing.sample_rate
    first, rtf = [], []
    total = 0
    for rid, stats in stream.stats.items():
        total += stats.num_samples
        rm = metrics.requests.get(rid)
        if rm is None or stats.first_audio_time is None:
            continue
        first.append(1e3 * (stats.first_audio_time - rm.submit_time))
        rtf.append((stats.last_audio_time - rm.submit_time) / (stats.num_samples / rate))
    seconds = total / rate
    return AudioSummary(
        num_requests=len(stream.stats), audio_seconds=seconds,
        first_audio_ms_p50=percentile(first, 50) if first else None,
        first_audio_ms_p95=percentile(first, 95) if first else None,
        decoder_rtf=stream.decode_seconds / seconds if seconds else None,
        stream_rtf_p50=percentile(rtf, 50) if rtf else None,
        decode_calls=stream.decode_calls, windows=stream.windows,
        errors=sum(1 for s in stream.stats.values() if s.error),
    )
