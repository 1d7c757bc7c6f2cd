"""The online speech API: OpenAI-style POST /v1/audio/speech over the embedded loop or vLLM's server."""

from .errors import ApiError
from .limits import Limits
from .schema import SpeechRequest, parse_speech_request

__all__ = ["ApiError", "Limits", "SpeechRequest", "parse_speech_request"]
