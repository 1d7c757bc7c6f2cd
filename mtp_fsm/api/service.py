"""SpeechService: what the routes need from a server (its backend, limits, gate, metrics), and the backend contract."""

from __future__ import annotations

import logging
from typing import Protocol

from ..engine.plan import NewRequest
from .errors import ApiError
from .jobs import SpeechJob
from .limits import Limits, StreamGate
from .metrics import SpeechMetrics
from .schema import SpeechRequest

log = logging.getLogger("mtp_fsm.api")


class SpeechBackend(Protocol):
    """Runs accepted requests: the embedded loop (EmbeddedBackend) or vLLM's engine (VllmBackend)."""

    talker_name: str
    sample_rate: int | None  # None: the talker has no decoder here (response_format codes only)

    def build(self, speech: SpeechRequest, request_id: str, *, seed: int, max_frames: int) -> NewRequest:
        """The engine request (ApiError 400 naming the field the talker cannot take)."""

    async def start(self, job: SpeechJob) -> None:
        """Hand the job to the engine; `job.accepted` resolves to None or the ApiError refusing it."""

    def abort(self, request_id: str) -> None:
        """End the request in the engine (client gone); its end still arrives as an event."""

    def health(self) -> str | None:
        """None when serving, else why not (GET /health answers 503 with it)."""


class SpeechService:
    """One server's speech endpoint. model_names: the names `model` may take (the served talker's);
    an absent `model` means the served one."""

    def __init__(self, backend: SpeechBackend, limits: Limits, metrics: SpeechMetrics,
                 model_names: tuple[str, ...]) -> None:
        self.backend, self.limits, self.metrics = backend, limits, metrics
        self.model_names = tuple(dict.fromkeys(model_names))
        self.gate = StreamGate(limits.max_concurrent)
        router = getattr(backend, "router", None)  # both backends route jobs through a JobRouter
        if router is not None:
            router.on_end = lambda reason: metrics.engine_ends.labels(reason=reason.label).inc()

    def check(self, speech: SpeechRequest) -> None:
        """404 for another model, 413 past a limit, 400 for audio from a talker without a decoder."""
        if speech.model is not None and speech.model not in self.model_names:
            raise ApiError(404, f"model: {speech.model!r} is not served here; this server serves "
                           f"{list(self.model_names)}", param="model", reason="model_not_found")
        self.limits.check(speech)
        if speech.wants_audio and self.backend.sample_rate is None:
            raise ApiError(400, f"response_format: talker {self.backend.talker_name!r} has no audio decoder on this "
                           "server; ask for response_format 'codes'", param="response_format",
                           reason="no_decoder")

    def refused(self, error: ApiError) -> None:
        self.metrics.failure(error.status, error.reason)
        log.info("speech request %s refused: %d %s", error.request_id or "-", error.status, error.message)
