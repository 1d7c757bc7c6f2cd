"""Resolves a talker from an import string ("pkg.module:factory") at run time: the plugin
hook that lets the CLI run model adapters without mtp_fsm importing `models` statically."""

from __future__ import annotations

import pkgutil
from typing import Any, Callable

import attrs

from ..model_api import TalkerModel

DEFAULT_MODEL = "qwen3_tts"
# Short names of the talkers in `models/` (each package's tiny seeded demo factory).
MODEL_NAMES = {
    name: f"models.{name}:tiny_demo_talker" for name in ("qwen3_tts", "qwen3_omni", "moss_tts_local", "chatterbox", "higgs_audio_v3", "voxcpm2", "mtp_lm")
}
SCRIPTED_MODEL = "mtp_fsm.serving.model_loader:scripted_talker"


@attrs.frozen
class LoadedTalker:
    """A talker plus how to turn demo text into its model-specific request inputs."""

    model: TalkerModel
    text_inputs: Callable[[str], Any]
    name: str


class ModelLoadError(ValueError):
    """The import string does not name a usable talker factory."""


def resolve(spec: str) -> Any:
    """A short model name (MODEL_NAMES) or 'package.module:attr.path' -> the object it names
    (pkgutil.resolve_name, clearer errors)."""
    spec = MODEL_NAMES.get(spec, spec)
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ModelLoadError(f"model {spec!r}: expected one of {sorted(MODEL_NAMES)} or an import string "
                             "'package.module:factory'")
    try:
        return pkgutil.resolve_name(spec)
    except ImportError as exc:
        raise ModelLoadError(f"model {spec!r}: cannot import {module_name!r}: {exc}") from exc
    except AttributeError as exc:
        raise ModelLoadError(f"model {spec!r}: cannot resolve {attr_path!r}: {exc}") from exc
    except ValueError as exc:  # pkgutil: not dotted identifiers ("invalid format")
        raise ModelLoadError(f"model {spec!r}: cannot resolve it: {exc}") from exc


def load_talker(spec: str = DEFAULT_MODEL, seed: int = 0, *, kwargs: dict[str, Any] | None = None) -> LoadedTalker:
    """Call the factory `spec` names with `seed` (or with `kwargs` instead, e.g. a checkpoint
    loader's `directory`).

    A factory returns a LoadedTalker, or a bare TalkerModel whose module defines
    `text_inputs(text)` (how demo text becomes the model's request inputs).
    """
    factory = resolve(spec)
    if not callable(factory):
        raise ModelLoadError(f"model {spec!r}: {factory!r} is not callable")
    result = factory(seed=seed) if kwargs is None else factory(**kwargs)
    if isinstance(result, LoadedTalker):
        return result
    if not isinstance(result, TalkerModel):
        raise ModelLoadError(f"model {spec!r}: the factory returned {type(result).__name__}, not a TalkerModel")
    text_inputs = getattr(pkgutil.resolve_name(MODEL_NAMES.get(spec, spec).partition(":")[0]), "text_inputs", None)
    if text_inputs is None:
        raise ModelLoadError(f"model {spec!r}: its module defines no text_inputs(text); return a LoadedTalker instead")
    return LoadedTalker(result, text_inputs, result.spec.name)


def scripted_talker(seed: int = 0) -> LoadedTalker:
    """The scripted toy talker: fast, for smoke tests of the serving stack."""
    from ..testing import ScriptedTalker, ScriptInputs

    model = ScriptedTalker(seed=seed, max_context=128)
    # Bytes of the text as prompt ids, capped so prompt + frames fit the toy context.
    return LoadedTalker(model, lambda text: ScriptInputs(prompt=tuple(text.encode()[:48]) or (0,)), "scripted")
