"""BearerAuth: API keys as vLLM checks them (Authorization: Bearer <key> on /v1 routes, 401 otherwise)."""

from __future__ import annotations

import hashlib
import secrets
from typing import Callable, Sequence

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import ApiError

# Only the API is guarded: /health and /metrics stay open to probes and scrapers, as under vLLM.
GUARDED_PREFIX = "/v1"


def key_matches(header: str | None, key_hashes: Sequence[bytes]) -> bool:
    """Whether an Authorization header carries one of the keys (compared as SHA-256 digests, in
    constant time, every key checked: the timing says nothing about which key or how much matched)."""
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(token.strip().encode("utf-8")).digest()
    match = False
    for key in key_hashes:
        match |= secrets.compare_digest(digest, key)
    return match


class BearerAuth:
    """Pure ASGI middleware (streams pass through untouched). on_refused(ApiError) counts refusals."""

    def __init__(self, app: ASGIApp, keys: Sequence[str], on_refused: Callable[[ApiError], None] | None = None) -> None:
        if not keys or any(not k for k in keys):
            raise ValueError("BearerAuth needs non-empty API keys")
        self.app, self.on_refused = app, on_refused
        self._hashes = [hashlib.sha256(k.encode("utf-8")).digest() for k in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS" and scope["path"].startswith(GUARDED_PREFIX):
            if not key_matches(Headers(scope=scope).get("authorization"), self._hashes):
                error = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                 reason="unauthorized")
                if self.on_refused is not None:
                    self.on_refused(error)
                response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
