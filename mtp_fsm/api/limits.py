"""Limits: how much one request may ask (413) and how many streams a server runs at once (429)."""

from __future__ import annotations

import threading

import attrs

from .errors import ApiError
from .schema import SpeechRequest


def _positive(instance, attribute: attrs.Attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"limit {attribute.name} must be an integer >= 1, got {value!r}")


@attrs.frozen
class Limits:
    """max_input_chars: characters of `input`; max_new_tokens: frames one request may ask for (and the
    default when it asks for none: a talker without an EOS would otherwise run to its context);
    max_concurrent: requests in flight per server (each API process counts its own)."""

    max_input_chars: int = attrs.field(default=4096, validator=_positive)
    max_new_tokens: int = attrs.field(default=2048, validator=_positive)
    max_concurrent: int = attrs.field(default=64, validator=_positive)

    def check(self, request: SpeechRequest) -> None:
        """413 naming the field when the request asks more than this server gives one request."""
        if len(request.input) > self.max_input_chars:
            raise ApiError(413, f"input: {len(request.input)} characters, this server takes at most "
                           f"{self.max_input_chars} (split the text)", param="input", reason="input_too_long")
        if request.max_new_tokens is not None and request.max_new_tokens > self.max_new_tokens:
            raise ApiError(413, f"max_new_tokens: {request.max_new_tokens} asked, this server allows at most "
                           f"{self.max_new_tokens}", param="max_new_tokens", reason="max_new_tokens_too_large")

    def frames_for(self, request: SpeechRequest) -> int:
        return self.max_new_tokens if request.max_new_tokens is None else request.max_new_tokens

    def to_env(self) -> str:
        """These limits as the value of one environment variable (vLLM's API processes are spawned)."""
        return f"{self.max_input_chars},{self.max_new_tokens},{self.max_concurrent}"

    @classmethod
    def from_env(cls, value: str | None) -> "Limits":
        if not value:
            return cls()
        try:
            chars, frames, concurrent = (int(v) for v in value.split(","))
        except ValueError:
            raise ValueError(f"limits {value!r}: expected 'max_input_chars,max_new_tokens,max_concurrent'") from None
        return cls(chars, frames, concurrent)


class StreamGate:
    """Counts requests in flight; refuses the one past the limit with 429 (never queues it: a client
    told to retry beats one whose first audio waits behind every other stream)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._active = 0
        self._lock = threading.Lock()

    @property
    def active(self) -> int:
        return self._active

    def acquire(self) -> None:
        with self._lock:
            if self._active >= self.limit:
                raise ApiError(429, f"{self._active} requests are in flight on this server, its limit is "
                               f"{self.limit}: retry later", reason="too_many_streams")
            self._active += 1

    def release(self) -> None:
        with self._lock:
            if self._active <= 0:
                raise RuntimeError("StreamGate.release without a matching acquire")
            self._active -= 1
