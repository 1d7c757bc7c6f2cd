"""ApiError: an HTTP error of the speech API in OpenAI's error shape, naming the request field at fault."""

from __future__ import annotations

from typing import Any

# The `type` of OpenAI's error object per status (clients switch on it).
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "request_too_large", 429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class ApiError(Exception):
    """Refuses one HTTP request: status, the field at fault (None for the body as a whole or a server
    fault), a message for the client, and a metrics reason (a short label, e.g. 'too_long')."""

    def __init__(self, status: int, message: str, *, param: str | None = None, reason: str | None = None,
                 request_id: str | None = None) -> None:
        self.status, self.param, self.request_id = status, param, request_id
        self.reason = reason or _TYPES.get(status, "error")
        self.message = message
        super().__init__(message)

    def body(self) -> dict[str, Any]:
        """{"error": {message, type, param, code}} as OpenAI's API answers; the request id when one was given."""
        error = {"message": self.message, "type": _TYPES.get(self.status, "error"), "param": self.param,
                 "code": self.reason}
        if self.request_id is not None:
            error["request_id"] = self.request_id
        return {"error": error}


def bad_field(param: str, message: str, *, reason: str = "invalid_field") -> ApiError:
    """400 for one field: the message starts with the field's name, so a log line alone says what was wrong."""
    return ApiError(400, f"{param}: {message}", param=param, reason=reason)
