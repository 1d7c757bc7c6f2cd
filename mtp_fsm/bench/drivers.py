"""The designs the bench compares, each doing the same per-step work for B requests.

floor: the model calls and the engine's batched sampler with no lifecycle at all (what a
step would cost if bookkeeping were free); engine: the lockstep engine; transitions: one
static `transitions` machine and a light model object per request; dict_loop: per-request
Python over request-keyed dicts. Every design samples with `sample_tokens` as the engine
does (`batched.StepSampler`), so they publish bit-identical frames and differ only in
lifecycle bookkeeping.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..engine import LockstepEngine, Span, StepOutput, StepPlan
from ..model_api import MtpResult, TalkerModel
from .batched import ParamColumns, StepSampler, cb0_allowed
from .naive import DictLoopDriver, TransitionsDriver, _PerRequestDriver  # noqa: F401  (re-exported)
from .requests import BenchRequest, FrameKey, make_requests  # noqa: F401  (re-exported)


# -- (0) the floor: the same model calls and sampling, no lifecycle at all -----------------


class FloorDriver:
    """What a step costs with free bookkeeping: the model's hooks and the engine's batched
    sampler over B rows that never change (every request decodes forever).

    Its per-row inputs live in device tensors built once (slots, seeds, sampling columns)
    and advanced in place (positions, frame indices); no states, no guards, no validation,
    no per-request objects: a step is text_step + forward + cb0_logits + CB0 sampling + the
    MTP hook with the sampler + frame_embed, and one copy of [frame index, codes] to the host.
    It runs only that steady pattern (no EOS, length or fault handling), which is all the
    NullTalker bench needs.
    """

    name = "floor"

    def __init__(self, model: TalkerModel, requests: Sequence[BenchRequest], *, device="cpu") -> None:
        device = torch.device(device)
        self.model, self.spec, self.device = model, model.spec, device
        self.requests = list(requests)
        self.ids = [r.request_id for r in self.requests]
        n = len(self.requests)
        self.columns = {name: torch.full((n + 1, *c.shape), c.fill, dtype=c.dtype, device=device)
                        for name, c in model.slot_columns().items()}
        model.bind_slots(n, device, self.columns)
        self.slots = torch.arange(n, device=device)
        self.seed = torch.tensor([r.seed for r in self.requests], dtype=torch.int64, device=device)
        self.frame_index = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.cb0_params = ParamColumns.of([r.cb0 for r in self.requests], device)
        self.mtp_params = ParamColumns.of([r.mtp for r in self.requests], device)
        self.allowed = cb0_allowed(self.spec, device)
        self.frame_embeds: torch.Tensor | None = None

    def admit(self) -> torch.Tensor:
        """Prefill every request's whole prompt in one step (first frames)."""
        prompts = []
        for slot, req in enumerate(self.requests):
            prepared = self.model.prepare(req.inputs)
            for name, value in prepared.columns.items():
                self.columns[name][slot][tuple(map(slice, value.shape))] = value.to(self.device)
            prompts.append(prepared.prompt_embeds.to(self.device))
        lengths = torch.tensor([int(p.shape[0]) for p in prompts], dtype=torch.int64, device=self.device)
        token_slots = torch.repeat_interleave(self.slots, lengths)
        ends = torch.cumsum(lengths, 0)
        positions = torch.arange(int(ends[-1]), device=self.device) - (ends - lengths)[token_slots]
        hidden = self.model.forward(torch.cat(prompts), positions, token_slots)
        self.positions.copy_(lengths)
        return self._frame(hidden[ends - 1])

    def step(self) -> torch.Tensor:
        text = self.model.text_step(self.columns, self.slots, (self.frame_index - 1).clamp(min=0))
        inputs = self.frame_embeds + text.to(self.frame_embeds.dtype)
        hidden = self.model.forward(inputs, self.positions, self.slots)
        self.positions += 1
        return self._frame(hidden)

    def _frame(self, last_hidden: torch.Tensor) -> torch.Tensor:
        sampler = StepSampler(self.seed, self.frame_index, self.cb0_params, self.mtp_params,
                              num_codebooks=self.spec.num_codebooks, allowed=self.allowed)
        cb0, _ = sampler.cb0(self.model.cb0_logits(last_hidden))
        if self.spec.has_mtp:
            codes = self.model.mtp(last_hidden, cb0.clamp(0, self.spec.codebook_size - 1),
                                   lambda logits, codebook, params=None: sampler.mtp(logits, codebook, params)[0])
            if isinstance(codes, MtpResult):
                codes = codes.codes
        else:
            codes = cb0[:, None]
        self.frame_embeds = self.model.frame_embed(codes)
        out = torch.cat([self.frame_index[:, None], codes.long()], dim=1).to("cpu", copy=True)  # the one copy
        self.frame_index += 1
        return out

    def frames(self, out: torch.Tensor) -> list[FrameKey]:
        return [(rid, row[0], tuple(row[1:])) for rid, row in zip(self.ids, out.tolist())]


# -- (1) the lockstep engine ------------------------------------------------------------


class EngineDriver:
    """`LockstepEngine(model, max_slots=B)` stepping one prebuilt plan of B decode rows."""

    name = "engine"
    kernels = "auto"
    countable = True  # the op counter sees its ops (compiled code runs below Python dispatch modes)

    def __init__(
        self, model: TalkerModel, requests: Sequence[BenchRequest], *, device="cpu", max_slots: int | None = None
    ) -> None:
        self.engine = LockstepEngine(model, max_slots=max_slots or len(requests), device=device, kernels=self.kernels)
        self.requests = list(requests)
        self._decode = StepPlan(rows=tuple(Span(r.request_id, 1) for r in self.requests))

    def admit(self) -> StepOutput:
        """Admit every request and prefill its whole prompt in one step (first frames)."""
        lengths = [int(self.engine.model.prepare(r.inputs).prompt_embeds.shape[0]) for r in self.requests]
        plan = StepPlan(
            new_requests=tuple(r.to_new() for r in self.requests),
            rows=tuple(Span(r.request_id, n) for r, n in zip(self.requests, lengths)),
        )
        return self.engine.step(plan)

    def step(self) -> StepOutput:
        return self.engine.step(self._decode)

    @staticmethod
    def frames(out: StepOutput) -> list[FrameKey]:
        codes = out.frames.codes.tolist()
        index = out.frames.frame_index.tolist()
        return [(rid, i, tuple(c)) for rid, i, c in zip(out.frames.request_ids, index, codes)]


class CompiledEngineDriver(EngineDriver):
    """The engine with its lifecycle stages compiled by TorchInductor (kernels="compiled")."""

    name = "engine_compiled"
    kernels = "compiled"
    countable = False


DRIVERS = {"floor": FloorDriver, "engine": EngineDriver, "transitions": TransitionsDriver, "dict_loop": DictLoopDriver}
# Designs `make bench` adds to DRIVERS (slow to build: the compiled engine compiles its stages).
EXTRA_DRIVERS = {"engine_compiled": CompiledEngineDriver}
# The designs that run a lifecycle (the floor runs only the steady decode pattern).
LIFECYCLE_DESIGNS = ("engine", "transitions", "dict_loop")


def make_drivers(model_factory, requests: Sequence[BenchRequest], names: Sequence[str] = LIFECYCLE_DESIGNS) -> dict:
    """One driver per design, each with its own model instance from `model_factory()`."""
    return {name: driver_class(name)(model_factory(), requests) for name in names}


def driver_class(name: str):
    """The driver class of a design name (DRIVERS or EXTRA_DRIVERS)."""
    return DRIVERS.get(name) or EXTRA_DRIVERS[name]


def check_same_frames(outputs: dict[str, list[FrameKey]]) -> dict[str, int]:
    """Raise unless every design published the same frames (ids, indices, codes); -> counts."""
    counts = {name: len(frames) for name, frames in outputs.items()}
    reference_name, reference = next(iter(outputs.items()))
    want = sorted(reference)
    for name, frames in outputs.items():
        if sorted(frames) != want:
            raise AssertionError(f"{name} published different frames than {reference_name}: counts {counts}")
    return counts
