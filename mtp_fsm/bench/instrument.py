"""Temporarily wraps an engine's stages (kernels, model hooks, ledger, output) with label callbacks."""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Callable, Iterator

# Kernel stage functions the engine calls through `engine.kernels`.
KERNEL_STAGES = (
    "apply_host_events", "apply_admits", "replay_frames", "compose_inputs", "sample_cb0",
    "mtp_sampler", "mtp_scatter", "publish_frames",
)
# Model hooks (TalkerModel methods) the engine calls.
MODEL_HOOKS = ("reset_slots", "text_step", "forward", "cb0_logits", "mtp", "frame_embed")
HOST_STAGE = "host:stage"  # Ledger.stage: validation + staging of the plan
HOST_OUTPUT = "host:output"  # LockstepEngine._build_output (incl. Ledger.observe)
GLUE = "engine"  # device-side work outside any kernel or model hook (indexing, the copy)


def _wrap(fn: Callable, label: str, enter: Callable[[str], None], leave: Callable[[str], None]) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        enter(label)
        try:
            out = fn(*args, **kwargs)
        finally:
            leave(label)
        if label == "kernel:mtp_sampler":  # the sampler closure runs inside the model's MTP hook
            sample, bad = out
            return _wrap(sample, "kernel:mtp_sample", enter, leave), bad
        return out

    return wrapper


@contextlib.contextmanager
def instrument_engine(engine, enter: Callable[[str], None], leave: Callable[[str], None]) -> Iterator[None]:
    """Within the block every stage of `engine.step` calls enter(label) / leave(label).

    Labels: "kernel:<stage>", "model:<hook>", HOST_STAGE, HOST_OUTPUT. Works through
    instance attributes only (the engine's code is not touched) and restores them after.
    """
    kernels = engine.kernels
    namespace = types.SimpleNamespace(**{n: getattr(kernels, n) for n in dir(kernels) if not n.startswith("__")})
    for name in KERNEL_STAGES:
        if hasattr(kernels, name):
            setattr(namespace, name, _wrap(getattr(kernels, name), f"kernel:{name}", enter, leave))
    model, ledger = engine.model, engine.ledger
    patched_model = []
    for name in MODEL_HOOKS:
        if name in vars(model):
            continue  # already an instance attribute: leave it alone
        setattr(model, name, _wrap(getattr(model, name), f"model:{name}", enter, leave))
        patched_model.append(name)
    # Every part of the engine holding the kernels (the engine, its device pipeline) gets the
    # wrapped namespace; each is restored after.
    holders = [obj for obj in (engine, getattr(engine, "_pipeline", None))
               if obj is not None and getattr(obj, "kernels", None) is kernels]
    for obj in holders:
        obj.kernels = namespace
    # Host stages by their current names; one the engine no longer has is left out (its work
    # is then charged to the enclosing label, still inside the step).
    hosts = [(obj, name, label) for obj, name, label in ((ledger, "stage", HOST_STAGE), (engine, "_build_output", HOST_OUTPUT))
             if callable(getattr(obj, name, None)) and name not in vars(obj)]
    for obj, name, label in hosts:
        setattr(obj, name, _wrap(getattr(obj, name), label, enter, leave))
    try:
        yield
    finally:
        for obj in holders:
            obj.kernels = kernels
        for name in patched_model:
            delattr(model, name)
        for obj, name, _ in hosts:
            delattr(obj, name)
