"""SpeechRequest: the body of POST /v1/audio/speech (OpenAI's fields plus vllm-omni's), validated field by field."""

from __future__ import annotations

import json
from typing import Any

import attrs

from .errors import ApiError, bad_field

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# What a response can carry: a WAV file, raw 16-bit little-endian mono PCM, or the talker's frames
# themselves (`codes`: one JSON array of codes per frame; for talkers without a decoder, and for
# checking frames against the offline engine).
RESPONSE_FORMATS = ("wav", "pcm", "codes")
# Formats OpenAI offers that need an audio encoder this package does not ship: refused by name.
ENCODED_FORMATS = ("mp3", "opus", "aac", "flac")
STREAM_FORMATS = ("audio", "sse")


def _optional_text(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise bad_field(attribute.name, f"must be a string, got {_json_type(value)}")
    if not value.strip():
        raise bad_field(attribute.name, "must not be empty (leave it out instead)")


def _input(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str):
        raise bad_field("input", f"must be a string, got {_json_type(value)}")
    if not value.strip():
        raise bad_field("input", "is empty: there is nothing to speak")


def _response_format(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str):
        raise bad_field("response_format", f"must be a string, got {_json_type(value)}")
    if value in ENCODED_FORMATS:
        raise bad_field("response_format", f"{value!r} needs an audio encoder this server does not have; use one "
                        f"of {list(RESPONSE_FORMATS)}", reason="unsupported_format")
    if value not in RESPONSE_FORMATS:
        raise bad_field("response_format", f"{value!r} is not one of {list(RESPONSE_FORMATS)}")


def _stream_format(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in STREAM_FORMATS:
        raise bad_field("stream_format", f"{value!r} is not one of {list(STREAM_FORMATS)}")


def _strict_bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise bad_field(attribute.name, f"must be true or false, got {_json_type(value)}")


def _speed(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    # No time-stretching here: a talker speaks at its own pace, so only the neutral speed is honest.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_field("speed", f"must be a number, got {_json_type(value)}")
    if value != 1.0:
        raise bad_field("speed", f"{value} is not supported: only 1.0 (the talker's own pace; no time-stretching)",
                        reason="unsupported_speed")


def _seed(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_field("seed", f"must be an integer, got {_json_type(value)}")
    if not INT64_MIN <= value <= INT64_MAX:
        raise bad_field("seed", f"{value} does not fit a 64-bit signed integer")


def _max_new_tokens(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_field("max_new_tokens", f"must be an integer, got {_json_type(value)}")
    if value < 1:
        raise bad_field("max_new_tokens", f"must be >= 1, got {value}")


@attrs.frozen
class SpeechRequest:
    """One speech request. voice, language and instructions map onto the talker's inputs (a speaker
    name, a language name, a style instruction); seed None draws one per request; max_new_tokens
    None takes the server's default (frames, one per codec step)."""

    input: str = attrs.field(validator=_input)
    model: str | None = attrs.field(default=None, validator=_optional_text)
    voice: str | None = attrs.field(default=None, validator=_optional_text)
    language: str | None = attrs.field(default=None, validator=_optional_text)
    instructions: str | None = attrs.field(default=None, validator=_optional_text)
    response_format: str = attrs.field(default="wav", validator=_response_format)
    stream: bool = attrs.field(default=False, validator=_strict_bool)
    stream_format: str = attrs.field(default="audio", validator=_stream_format)
    speed: float = attrs.field(default=1.0, validator=_speed)
    seed: int | None = attrs.field(default=None, validator=_seed)
    max_new_tokens: int | None = attrs.field(default=None, validator=_max_new_tokens)

    def __attrs_post_init__(self) -> None:
        # Cross-field rules, after every field is valid on its own.
        if self.stream_format == "sse" and not self.stream:
            raise bad_field("stream_format", "'sse' streams events: it needs stream=true")
        if self.stream and self.stream_format == "audio" and self.response_format == "wav":
            raise bad_field("response_format", "'wav' cannot stream (its header holds the length): use 'pcm' "
                            "(16-bit little-endian mono) with stream=true, or stream=false for a WAV file")

    @property
    def wants_audio(self) -> bool:
        return self.response_format != "codes"


FIELDS = tuple(a.name for a in attrs.fields(SpeechRequest))
REQUIRED = ("input",)


def parse_speech_request(body: bytes | str) -> SpeechRequest:
    """The request body (JSON) -> SpeechRequest, or ApiError 400 naming the field at fault.
    Unknown fields are refused by name (a misspelt `voice` must not be dropped silently); JSON null
    is the same as leaving an optional field out."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"body: not valid JSON: {exc}", param="body", reason="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"body: must be a JSON object, got {_json_type(data)}", param="body",
                       reason="invalid_json")
    unknown = sorted(k for k in data if k not in FIELDS)
    if unknown:
        raise bad_field(unknown[0], f"unknown field (this API takes {list(FIELDS)})", reason="unknown_field")
    for name in REQUIRED:
        if data.get(name) is None:
            raise bad_field(name, "is required", reason="missing_field")
    return SpeechRequest(**{k: v for k, v in data.items() if v is not None})


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)
