"""Building a LockstepEngine: its constructor's checks, the model's binding to one live engine, and
the wiring of its parts (slot table, ledger, scheduler, feeds, device pipeline, decode graphs)."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Iterable

import torch

from ..errors import ConfigurationError, ModelBindingError
from ..kernels import select_backend
from ..lifecycle import LifecycleCompileError, Oracle, Phase, compile_lifecycle, lifecycle_for
from ..lifecycle.spec import LifecycleSpec
from ..model_api import ModelSpec, TalkerModel, feed_columns
from ..slots import SlotTable
from .debug_checks import DebugChecks
from .decode_graphs import DecodeGraphs, resolve_mode
from .draft_policy import DraftController, DraftPolicy
from .feed import ConditioningFeed
from .ledger import Ledger
from .pipeline import DevicePipeline, deferred_columns, frame_embed_of_words, model_call
from .scheduler import Scheduler
from .scheduling_policy import SchedulingPolicy
from .speculation import SpeculationStats, SpeculativeStep, check_speculation, draft_columns

if TYPE_CHECKING:
    from .engine import LockstepEngine


# model -> the live engine bound to it: a model's slot state (KV cache) belongs to one engine.
_BOUND: "weakref.WeakKeyDictionary[TalkerModel, weakref.ref]" = weakref.WeakKeyDictionary()


def bind(model: TalkerModel, engine: "LockstepEngine") -> None:
    owner = _BOUND.get(model)
    if owner is not None and owner() is not None and owner() is not engine:
        raise ModelBindingError(
            f"model {model.spec.name!r} ({type(model).__name__} at {id(model):#x}) is already bound to another live "
            "engine, which owns its per-slot state (KV cache); build one model per engine, or close() the other"
        )
    _BOUND[model] = weakref.ref(engine)


def unbind(model: TalkerModel, engine: "LockstepEngine") -> None:
    """Release the model's binding if `engine` holds it (another engine may then use the model)."""
    if _BOUND.get(model) is not None and _BOUND[model]() is engine:
        del _BOUND[model]


def assemble(
    engine: "LockstepEngine",
    model: TalkerModel,
    max_slots: int,
    *,
    device: torch.device | str,
    kernels: str,
    lifecycle: LifecycleSpec | None,
    policy: SchedulingPolicy | None,
    speculate: int,
    draft_policy: DraftPolicy | None,
    decode_graphs: str,
    graph_buckets: Iterable[int],
    debug: bool,
) -> None:
    """Check `LockstepEngine(...)`'s arguments (ConfigurationError, ModelBindingError or
    LifecycleCompileError naming the bad one) and give `engine` its parts (see its __init__)."""
    if type(max_slots) is not int or max_slots < 1:
        raise ConfigurationError(f"LockstepEngine: max_slots must be an int >= 1, got {max_slots!r}")
    if not isinstance(model, TalkerModel):
        raise ConfigurationError(f"LockstepEngine: model must be a mtp_fsm.model_api.TalkerModel, got "
                                 f"{type(model).__name__}")
    if policy is not None and not isinstance(policy, SchedulingPolicy):
        raise ConfigurationError(f"LockstepEngine: policy must be a SchedulingPolicy, got {type(policy).__name__}")
    policy = policy or SchedulingPolicy()
    check_speculation(model, speculate, lifecycle, policy)
    bind(model, engine)
    engine.model = model
    engine.spec = spec = model.spec
    try:
        engine.device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigurationError(f"LockstepEngine: device {device!r}: {exc}") from exc
    engine.speculate = speculate
    engine.lifecycle = lifecycle = lifecycle or lifecycle_for("speculative" if speculate else spec.lifecycle)
    engine.compiled = compile_lifecycle(lifecycle)
    # A verify loop's MTP phase is the drafter (check_speculation), not an MTP hook.
    if not lifecycle.verify_loop and bool(lifecycle.stages_of(Phase.MTP)) != spec.has_mtp:
        has = "has an MTP hook" if spec.has_mtp else "has no MTP hook"
        raise LifecycleCompileError(
            f"model {spec.name!r} {has} but lifecycle {lifecycle.name!r} declares "
            f"{len(lifecycle.stages_of(Phase.MTP))} MTP-phase stages"
        )
    for name, params in (("cb0", spec.cb0_sampling), ("mtp", spec.mtp_sampling)):
        if params is not None and params.problems():
            raise ModelBindingError(f"model {spec.name!r}: its fixed {name} sampling: " + "; ".join(params.problems()))
    engine._lc = lc = engine.compiled.to(engine.device)
    engine.kernels = select_backend(kernels, engine.device)
    engine.table = table = SlotTable.allocate(max_slots, spec, engine.device, {
        **model.slot_columns(), **feed_columns(spec), **deferred_columns(spec, lifecycle),
        **draft_columns(lifecycle, speculate)})
    # Host events fire through the spec's machine on the records, i.e. on the request table.
    engine.oracle = Oracle(lifecycle, model_attribute="label")
    engine.ledger = Ledger(model, table, engine.oracle, engine.compiled, decode_width=1 + speculate)
    engine.scheduler = Scheduler(engine.ledger, policy)
    engine.feeds = ConditioningFeed(engine.ledger, engine.kernels, lc)
    model.bind_slots(max_slots, engine.device, table.extra)
    engine._forward = model_call(model, "forward")
    engine._cb0_logits = model_call(model, "cb0_logits")
    engine._mtp = model_call(model, "mtp") if spec.has_mtp else None
    engine._frame_embed = frame_embed_of_words(model_call(model, "frame_embed"), spec)
    engine._text_step = model_call(model, "text_step")
    engine._reset_slots = model_call(model, "reset_slots")
    engine._allowed = cb0_allowed(spec, engine.device)
    speculative = None
    if lifecycle.verify_loop:
        speculative = SpeculativeStep(
            spec, engine.kernels, table, lc,
            (engine._forward, engine._cb0_logits, model_call(model, "draft"), engine._frame_embed, engine._text_step),
            engine._allowed, speculate)
    engine._pipeline = DevicePipeline(
        spec, lifecycle, engine.kernels, table, lc,
        (engine._forward, engine._cb0_logits, engine._mtp, engine._frame_embed, engine._text_step), engine._allowed,
        engine.device, speculative,
    )
    mode = resolve_mode(decode_graphs, engine.device, engine.kernels, 1 + speculate)
    engine.graphs = None if mode == "off" else DecodeGraphs(
        mode, graph_buckets, table.max_slots, engine.device, engine._pipeline.run, strict=decode_graphs == "cuda",
        variant=(lambda: speculative.propose) if speculative is not None else None)
    engine.step_count = 0
    engine._debug = DebugChecks(engine) if debug else None
    # Speculative engines: drafts proposed / accepted, frames per verify row.
    engine.speculation = SpeculationStats(speculate) if speculative is not None else None
    engine._drafts = DraftController(draft_policy or DraftPolicy(), speculate) if speculate else None
    if engine._drafts is not None:
        engine._drafts.apply(speculative, engine.ledger)


def cb0_allowed(spec: ModelSpec, device: torch.device) -> torch.Tensor:
    """CB0 may be any codec id or the codec EOS; other specials of the backbone head are not frames."""
    allowed = torch.zeros(spec.backbone_vocab_size, dtype=torch.bool)
    allowed[: spec.codebook_size] = True
    if spec.eos_token_id is not None:
        allowed[spec.eos_token_id] = True
    return allowed.to(device)
