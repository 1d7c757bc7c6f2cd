"""The soak's talkers: the scripted and null models, and a fault-injecting subclass of either."""

from __future__ import annotations

import torch

from ..model_api import TalkerModel

MODELS = ("scripted", "null")


class InjectedFault(RuntimeError):
    """Raised by a faulty model's forward on the steps the soak chose."""


class _FaultMixin:
    """Makes a talker's forward raise once after arm() (the next forward the engine calls)."""

    armed = False
    faults = 0

    def arm(self) -> None:
        self.armed = True

    def forward(self, inputs_embeds, positions, token_slots):
        if self.armed:
            self.armed = False
            self.faults += 1
            raise InjectedFault(f"injected fault #{self.faults}")
        return super().forward(inputs_embeds, positions, token_slots)


def faulty(cls: type[TalkerModel]) -> type[TalkerModel]:
    """A subclass of the talker class `cls` whose forward raises when armed."""
    return type(f"Faulty{cls.__name__}", (_FaultMixin, cls), {})


def scripted_model() -> TalkerModel:
    """The scripted 4-codebook float64 talker: the reference factory of `scripted` soaks."""
    from ..testing.alone import scripted_mtp

    return scripted_mtp()


def null_model() -> TalkerModel:
    """The NullTalker with the lifecycle benchmark's sizes (Q=16, small vocabularies)."""
    from ..bench.null_model import NullTalker, lifecycle_config

    return NullTalker(lifecycle_config(max_context=64))


def faulty_model(name: str) -> TalkerModel:
    if name == "scripted":
        from ..testing import ScriptedTalker

        return faulty(ScriptedTalker)(dtype=torch.float64)  # = scripted_model(), with fault injection
    from ..bench.null_model import NullTalker, lifecycle_config

    return faulty(NullTalker)(lifecycle_config(max_context=64))


def reference_factory(name: str):
    """The fault-free model factory the soak's references run on."""
    return {"scripted": scripted_model, "null": null_model}[name]
