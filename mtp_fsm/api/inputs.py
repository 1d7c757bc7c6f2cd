"""A SpeechRequest as the talker's NewRequest: voice, language and instructions onto its inputs' fields."""

from __future__ import annotations

import attrs

from ..engine.plan import NewRequest
from ..serving.model_loader import LoadedTalker
from .errors import ApiError, bad_field
from .schema import SpeechRequest

# API field -> the names a talker's inputs class may give it (Qwen3-TTS: speaker, language, instruct).
# Matched by name so mtp_fsm needs no import of `models`; a talker whose inputs have none of them
# refuses the field by name instead of ignoring it.
FIELD_ALIASES = {"voice": ("speaker", "voice"), "language": ("language",), "instructions": ("instruct", "instructions")}


def inputs_field(inputs_type: type, param: str) -> str | None:
    """The field of `inputs_type` (an attrs class) that takes API field `param`, or None."""
    if not attrs.has(inputs_type):
        return None
    names = {f.name for f in attrs.fields(inputs_type) if f.init}
    return next((name for name in FIELD_ALIASES[param] if name in names), None)


def build_request(talker: LoadedTalker, speech: SpeechRequest, request_id: str, *, max_frames: int,
                  seed: int) -> NewRequest:
    """ApiError 400 naming the field when the talker cannot take what was asked (its inputs have no
    such field, or reject the value). Values a talker checks only against its model (an unknown speaker
    name) are refused at admission, also by name (`refusal`)."""
    try:
        inputs = talker.text_inputs(speech.input)
    except (ValueError, TypeError) as exc:
        raise bad_field("input", f"talker {talker.name!r} cannot take it: {exc}") from None
    changes: dict[str, str] = {}  # inputs field -> value
    asked: list[str] = []  # the API fields behind them
    for param in FIELD_ALIASES:
        value = getattr(speech, param)
        if value is None:
            continue
        target = inputs_field(type(inputs), param)
        if target is None:
            raise bad_field(param, f"talker {talker.name!r} takes no {param} (its inputs, "
                            f"{type(inputs).__name__}, have none of the fields {list(FIELD_ALIASES[param])})",
                            reason="unsupported_field")
        changes[target] = value
        asked.append(param)
    if changes:
        try:
            inputs = attrs.evolve(inputs, **changes)
        except (ValueError, TypeError) as exc:
            raise bad_field(_param_named_in(str(exc), default=asked[0]), str(exc)) from None
    return NewRequest(request_id, inputs, max_frames=max_frames, seed=seed)


def refusal(request_id: str, detail: str) -> ApiError:
    """400 for a request the engine or the model refused at admission (bad inputs: the client's fault),
    naming the API field the model's message is about."""
    param = _param_named_in(detail, default="input")
    return ApiError(400, f"{param}: refused at admission: {detail}", param=param,
                    reason="refused_at_admission", request_id=request_id)


def _param_named_in(message: str, *, default: str) -> str:
    lowered = message.lower()
    for param, names in (("voice", ("speaker",)), ("language", ("language",)), ("instructions", ("instruct",)),
                         ("max_new_tokens", ("max_frames", "context"))):
        if any(name in lowered for name in names):
            return param
    return default
