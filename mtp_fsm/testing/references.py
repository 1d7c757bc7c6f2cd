"""Reference runs: each request run alone by the independent interpreter, cached per definition."""

from __future__ import annotations

from typing import Any

from ..lifecycle import LifecycleSpec, lifecycle_for
from ..lifecycle.variants import current_step_twin
from ..model_api import PreparedPrompt, TalkerModel
from .alone import AloneRun, ModelFactory, RequestDef, check_script
from .interpreter import interpret
from .scripted import ScriptInputs


class ReferenceRuns:
    """What each request does alone, per the reference interpreter (not the engine)."""

    def __init__(self, model_factory: ModelFactory, lifecycle: LifecycleSpec | None = None) -> None:
        self.model_factory = model_factory
        self._lifecycle = lifecycle
        self._runs: dict[RequestDef, AloneRun] = {}
        self._prepared: dict[Any, PreparedPrompt] = {}
        self._model: TalkerModel | None = None

    def _shared_model(self) -> TalkerModel:
        self._model = self._model or self.model_factory()
        return self._model

    def get(self, definition: RequestDef) -> AloneRun:
        run = self._runs.get(definition)
        if run is None:
            model = self.model_factory()  # a fresh model: its slot state is the interpreter's alone
            # A deferred schedule publishes its current-step twin's frames (one step later).
            spec = current_step_twin(self._lifecycle or lifecycle_for(model.spec.lifecycle))
            run = self._runs[definition] = interpret(model, spec, definition)
            if self._lifecycle is None and isinstance(definition.inputs, ScriptInputs):
                check_script(definition, run, model.spec)
        return run

    def prepared(self, inputs: Any) -> PreparedPrompt:
        """The model's prepared prompt for these inputs (cached; the model is deterministic)."""
        out = self._prepared.get(inputs)
        if out is None:
            out = self._prepared[inputs] = self._shared_model().prepare(inputs)
        return out

    def prompt_len(self, inputs: Any) -> int:
        return int(self.prepared(inputs).prompt_embeds.shape[0])

    def __len__(self) -> int:
        return len(self._runs)


_CACHES: dict[tuple, ReferenceRuns] = {}


def reference_runs(model_factory: ModelFactory, lifecycle: LifecycleSpec | None = None) -> ReferenceRuns:
    """The shared cache for this (model factory, lifecycle): runs survive hypothesis examples."""
    key = (model_factory, lifecycle)
    if key not in _CACHES:
        _CACHES[key] = ReferenceRuns(model_factory, lifecycle)
    return _CACHES[key]
