"""The embedded server's ASGI app: the speech routes, /health, /metrics and API keys over an EmbeddedBackend."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Sequence

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from .auth import BearerAuth
from .embedded import EmbeddedBackend
from .limits import Limits
from .metrics import SpeechMetrics
from .routes import STATE_KEY, speech_router
from .server import package_version
from .service import SpeechService

log = logging.getLogger("mtp_fsm.api")


def build_embedded_app(backend: EmbeddedBackend, *, limits: Limits = Limits(), api_keys: Sequence[str] = (),
                       model_names: Sequence[str] = (), registry: CollectorRegistry | None = None) -> FastAPI:
    """The app owns the backend: its shutdown closes it (requests in flight are aborted). A registry of
    its own per app, so several apps in one process (tests, the bench) keep separate series."""
    registry = CollectorRegistry() if registry is None else registry
    metrics = SpeechMetrics(registry)
    service = SpeechService(backend, limits, metrics, (*model_names, backend.talker_name))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        backend.close()

    app = FastAPI(title="mtp_fsm speech API", version=package_version(), lifespan=lifespan, docs_url=None,
                  redoc_url=None)
    setattr(app.state, STATE_KEY, service)
    app.include_router(speech_router(health=True, metrics_registry=registry))
    if api_keys:
        app.add_middleware(BearerAuth, keys=list(api_keys), on_refused=lambda e: metrics.failure(e.status, e.reason))
    return app


def load_embedded_backend(model: str, *, seed: int = 0, max_slots: int = 16, token_budget: int = 512,
                          prefill_chunk: int = 256, kernels: str = "auto", audio: bool = True,
                          talker_kwargs: dict[str, Any] | None = None,
                          decoder_kwargs: dict[str, Any] | None = None) -> EmbeddedBackend:
    """The talker `model` names (a short name or a factory import string) in a LockstepEngine, with its
    codec decoder when it declares one (else codes only: response_format codes)."""
    from ..engine import LockstepEngine
    from ..engine.scheduler import SchedulingPolicy
    from ..serving.codec import CodecUnavailableError, load_decoder
    from ..serving.model_loader import load_talker

    talker = load_talker(model, seed=seed, kwargs=talker_kwargs)
    decoder = None
    if audio:
        try:
            decoder = load_decoder(model, seed=seed, kwargs=decoder_kwargs)
        except CodecUnavailableError as exc:
            log.warning("%s: serving codes only (response_format codes)", exc)
    engine = LockstepEngine(talker.model, max_slots, kernels=kernels,
                            policy=SchedulingPolicy(token_budget, prefill_chunk))
    return EmbeddedBackend(talker, engine, decoder)
