"""The model's entry points as the engine calls them: exceptions wrapped as ModelFault, frame rows decoded."""

from __future__ import annotations

import torch

from ..model_api import TalkerModel


class ModelFault(Exception):
    """A model call raised inside a step (wraps the model's own exception)."""


def frame_embed_of_words(frame_embed, spec):
    """frame_embed over the engine's frame rows: a model with a payload gets the payload
    decoded from the row's words (its codes are the engine's bookkeeping)."""
    if spec.payload is None:
        return frame_embed
    first, payload = spec.num_codebooks, spec.payload

    def embed(words: torch.Tensor) -> torch.Tensor:
        return frame_embed(payload.decode(words[:, first:]))

    return embed


def model_call(model: TalkerModel, name: str):
    """A model entry point whose exceptions become ModelFault, so step() can end that step's
    requests while a kernel bug still surfaces as itself. The method is looked up at each
    call (profilers and tests may wrap the model's methods after the engine is built)."""

    def call(*args, **kwargs):
        try:
            return getattr(model, name)(*args, **kwargs)
        except Exception as exc:
            raise ModelFault(exc) from exc

    call.__name__ = name
    return call
