"""The built-in scheduler's knobs (SchedulingPolicy), validated when a policy is built."""

from __future__ import annotations

import attrs

from ..errors import ConfigurationError


def _positive(_, attribute, value) -> None:
    if type(value) is not int or value < 1:
        raise ConfigurationError(f"SchedulingPolicy: {attribute.name} must be an int >= 1, got {value!r}")


def _none_or_non_negative(_, attribute, value) -> None:
    if value is not None and (type(value) is not int or value < 0):
        raise ConfigurationError(f"SchedulingPolicy: {attribute.name} must be None or an int >= 0, got {value!r}")


@attrs.frozen
class SchedulingPolicy:
    """Knobs of the built-in policy. With preempt_after_steps=N, a queue head blocked for
    lack of a slot for more than N consecutive steps preempts the most recently admitted
    running request (recompute-style: it re-prefills its prompt plus published frames)."""

    token_budget: int = attrs.field(default=512, validator=_positive)
    prefill_chunk: int = attrs.field(default=256, validator=_positive)
    preempt_after_steps: int | None = attrs.field(default=None, validator=_none_or_non_negative)
