"""Three designs doing the same per-step work for B requests: lockstep engine, transitions, dicts."""

from __future__ import annotations

from typing import Sequence

import attrs
import torch
from transitions import Machine

from ..engine import LockstepEngine, NewRequest, Span, StepOutput, StepPlan
from ..lifecycle import mtp_lifecycle
from ..model_api import TalkerModel
from ..sampling import SamplingParams
from .rowsample import RowSampler

# A published frame as every driver reports it: (request id, frame index, codes).
FrameKey = tuple[str, int, tuple[int, ...]]


@attrs.frozen
class BenchRequest:
    request_id: str
    inputs: object  # model-specific (NullInputs, TTSInputs, ...)
    seed: int
    max_frames: int
    cb0: SamplingParams = SamplingParams()
    mtp: SamplingParams = SamplingParams()

    def to_new(self) -> NewRequest:
        return NewRequest(self.request_id, self.inputs, self.max_frames, self.seed, self.cb0, self.mtp)


def make_requests(n: int, inputs: object, *, max_frames: int = 10**6, prefix: str = "r") -> list[BenchRequest]:
    """n requests with distinct seeds and the default sampling (T=0.9, top-k 50, top-p 1)."""
    return [BenchRequest(f"{prefix}{i}", inputs, seed=1000 + 7919 * i, max_frames=max_frames) for i in range(n)]


# -- (1) the lockstep engine ------------------------------------------------------------


class EngineDriver:
    """`LockstepEngine(model, max_slots=B)` stepping one prebuilt plan of B decode rows."""

    name = "engine"

    def __init__(
        self, model: TalkerModel, requests: Sequence[BenchRequest], *, device="cpu", max_slots: int | None = None
    ) -> None:
        self.engine = LockstepEngine(model, max_slots=max_slots or len(requests), device=device)
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


# -- shared per-request bookkeeping of the two naive designs -----------------------------


class _PerRequestDriver:
    """The step both naive designs run: model calls batched, everything else per request.

    Subclasses hold per-request state their own way and implement the lifecycle hooks.
    Sampling is per row (RowSampler), bit-identical to the engine, so frames must match.
    """

    name = "?"

    def __init__(self, model: TalkerModel, requests: Sequence[BenchRequest]) -> None:
        self.model = model
        self.spec = model.spec
        self.requests = list(requests)
        model.bind_slots(len(requests), torch.device("cpu"), {})
        self.cb0_sampler = RowSampler(self.spec.backbone_vocab_size)
        self.mtp_sampler = RowSampler(self.spec.codebook_size)
        banned = torch.ones(self.spec.backbone_vocab_size, dtype=torch.bool)
        banned[: self.spec.codebook_size] = False
        if self.spec.eos_token_id is not None:
            banned[self.spec.eos_token_id] = False
        self.cb0_banned = banned
        self.rows = [r.request_id for r in self.requests]

    def admit(self) -> list[FrameKey]:
        for slot, req in enumerate(self.requests):
            self.add(req, slot, self.model.prepare(req.inputs).prompt_embeds)
        return self.step()

    def step(self) -> list[FrameKey]:
        rows = [rid for rid in self.rows if self.schedulable(rid)]
        if not rows:
            return []
        # Compose inputs: the remaining prompt for prefill rows, frame embed + text step for decode.
        inputs, positions, token_slots, last, text_rows = [], [], [], [], []
        for rid in rows:
            slot, computed, prompt_len = self.slot(rid), self.computed(rid), self.prompt_len(rid)
            if computed < prompt_len:
                inputs.append(self.prompt(rid)[computed:])
                positions.extend(range(computed, prompt_len))
                token_slots.extend([slot] * (prompt_len - computed))
            else:
                text_rows.append((len(inputs), slot, max(self.num_frames(rid) - 1, 0)))
                inputs.append(self.frame_embed(rid)[None])
                positions.append(computed)
                token_slots.append(slot)
            last.append(len(positions) - 1)
        if text_rows:
            at, slots, index = zip(*text_rows)
            text = self.model.text_step({}, torch.tensor(slots), torch.tensor(index))
            for j, i in enumerate(at):
                inputs[i] = inputs[i] + text[j]
        hidden = self.model.forward(torch.cat(inputs), torch.tensor(positions), torch.tensor(token_slots))
        last_hidden = hidden[torch.tensor(last)]
        logits = self.model.cb0_logits(last_hidden)
        cb0 = torch.stack([
            self.cb0_sampler(logits[i], self.cb0_params(rid), self.seed(rid), self.num_frames(rid), 0, self.cb0_banned)
            for i, rid in enumerate(rows)
        ])
        cb0_list = cb0.tolist()  # the host needs each CB0 for its EOS check
        for rid, token, pos in zip(rows, cb0_list, last):
            self.set_computed(rid, positions[pos] + 1)
            if token == self.spec.eos_token_id:
                self.on_eos(rid)
            else:
                self.on_sample(rid, token)

        def sample(mtp_logits: torch.Tensor, codebook: int) -> torch.Tensor:
            return torch.stack([
                self.mtp_sampler(mtp_logits[i], self.mtp_params(rid), self.seed(rid), self.num_frames(rid), codebook)
                for i, rid in enumerate(rows)
            ])

        codes = self.model.mtp(last_hidden, cb0.clamp(0, self.spec.codebook_size - 1), sample)
        embeds = self.model.frame_embed(codes)
        codes_list = codes.tolist()
        published = []
        for i, rid in enumerate(rows):
            if self.sampled(rid):
                index = self.num_frames(rid)
                self.on_mtp(rid)
                self.on_publish(rid, embeds[i])
                published.append((rid, index, tuple(codes_list[i])))
        return published

    @staticmethod
    def frames(out: list[FrameKey]) -> list[FrameKey]:
        return out

    def done(self, rid: str) -> bool:
        return self.num_frames(rid) >= self.max_frames(rid) or self.computed(rid) >= self.spec.max_context


# -- (2) one transitions.Machine per request --------------------------------------------


class MachineRequest:
    """The model object of a per-request `transitions.Machine` (the library's obvious use)."""

    def __init__(self, req: BenchRequest, slot: int, prompt: torch.Tensor) -> None:
        self.req, self.slot, self.prompt = req, slot, prompt
        self.prompt_len, self.num_computed, self.num_frames = int(prompt.shape[0]), 0, 0
        self.last_cb0, self.frame_embed, self.finish_reason = -1, None, None


class TransitionsDriver(_PerRequestDriver):
    """`Machine(model=req, ...)` per request, built from `mtp_lifecycle()`; triggers fired per
    request per step (sample, eos or mtp, publish, finish_length)."""

    name = "transitions"

    def __init__(self, model: TalkerModel, requests: Sequence[BenchRequest]) -> None:
        super().__init__(model, requests)
        spec = mtp_lifecycle()
        self._states = [s.label for s in spec.states]
        self._transitions = [
            {"trigger": t.trigger.label, "source": [s.label for s in t.sources], "dest": t.dest.label}
            for t in spec.transitions
        ]
        self.reqs: dict[str, MachineRequest] = {}

    def add(self, req: BenchRequest, slot: int, prompt: torch.Tensor) -> None:
        obj = MachineRequest(req, slot, prompt)
        Machine(model=obj, states=self._states, transitions=self._transitions, initial="free")
        obj.admit()
        self.reqs[req.request_id] = obj

    def schedulable(self, rid):
        return self.reqs[rid].state in ("waiting", "prefilling", "decoding")

    def slot(self, rid):
        return self.reqs[rid].slot

    def computed(self, rid):
        return self.reqs[rid].num_computed

    def set_computed(self, rid, n):
        self.reqs[rid].num_computed = n

    def prompt_len(self, rid):
        return self.reqs[rid].prompt_len

    def prompt(self, rid):
        return self.reqs[rid].prompt

    def num_frames(self, rid):
        return self.reqs[rid].num_frames

    def max_frames(self, rid):
        return self.reqs[rid].req.max_frames

    def frame_embed(self, rid):
        return self.reqs[rid].frame_embed

    def seed(self, rid):
        return self.reqs[rid].req.seed

    def cb0_params(self, rid):
        return self.reqs[rid].req.cb0

    def mtp_params(self, rid):
        return self.reqs[rid].req.mtp

    def on_eos(self, rid):
        obj = self.reqs[rid]
        obj.sample()
        obj.eos()
        obj.finish_reason = "eos"

    def on_sample(self, rid, token):
        obj = self.reqs[rid]
        obj.sample()
        obj.last_cb0 = token

    def sampled(self, rid):
        return self.reqs[rid].state == "sampled"

    def on_mtp(self, rid):
        self.reqs[rid].mtp()

    def on_publish(self, rid, embed):
        obj = self.reqs[rid]
        obj.frame_embed = embed
        obj.num_frames += 1
        obj.publish()
        if self.done(rid):
            obj.finish_length()
            obj.finish_reason = "length"


# -- (3) per-request Python loop over slot/request-keyed dicts ---------------------------


class DictLoopDriver(_PerRequestDriver):
    """The shape of the code mtp_fsm replaces: ~10 dicts keyed by request id or slot, with
    RuntimeError guards instead of states."""

    name = "dict_loop"

    def __init__(self, model: TalkerModel, requests: Sequence[BenchRequest]) -> None:
        super().__init__(model, requests)
        self.req_slot: dict[str, int] = {}
        self.slot_req: dict[int, str] = {}
        self.request: dict[str, BenchRequest] = {}
        self.prompts: dict[str, torch.Tensor] = {}
        self.num_computed_: dict[str, int] = {}
        self.num_frames_: dict[str, int] = {}
        self.last_cb0: dict[str, int] = {}
        self.frame_embeds: dict[str, torch.Tensor] = {}
        self.frame_ready: dict[int, str] = {}  # slot -> request whose frame is complete this step
        self.finished: dict[str, str] = {}  # request -> reason
        self.sampled_rows: set[str] = set()  # requests whose CB0 was kept this step

    def add(self, req, slot, prompt):
        rid = req.request_id
        if slot in self.slot_req:
            raise RuntimeError(f"slot {slot} still owned by {self.slot_req[slot]!r}")
        self.req_slot[rid], self.slot_req[slot], self.request[rid] = slot, rid, req
        self.prompts[rid], self.num_computed_[rid], self.num_frames_[rid] = prompt, 0, 0

    def schedulable(self, rid):
        return rid in self.req_slot and rid not in self.finished

    def slot(self, rid):
        return self.req_slot[rid]

    def computed(self, rid):
        return self.num_computed_[rid]

    def set_computed(self, rid, n):
        self.num_computed_[rid] = n

    def prompt_len(self, rid):
        return int(self.prompts[rid].shape[0])

    def prompt(self, rid):
        return self.prompts[rid]

    def num_frames(self, rid):
        return self.num_frames_[rid]

    def max_frames(self, rid):
        return self.request[rid].max_frames

    def frame_embed(self, rid):
        return self.frame_embeds[rid]

    def seed(self, rid):
        return self.request[rid].seed

    def cb0_params(self, rid):
        return self.request[rid].cb0

    def mtp_params(self, rid):
        return self.request[rid].mtp

    def on_eos(self, rid):
        self.finished[rid] = "eos"

    def on_sample(self, rid, token):
        self.last_cb0[rid] = token
        self.sampled_rows.add(rid)

    def sampled(self, rid):
        return rid in self.sampled_rows

    def on_mtp(self, rid):
        self.sampled_rows.discard(rid)
        self.frame_ready[self.req_slot[rid]] = rid

    def on_publish(self, rid, embed):
        slot = self.req_slot[rid]
        if self.frame_ready.pop(slot, None) != rid:
            raise RuntimeError(f"frame of slot {slot} missing for {rid!r}")
        self.frame_embeds[rid] = embed
        self.num_frames_[rid] += 1
        if self.done(rid):
            self.finished[rid] = "length"


DRIVERS = {"engine": EngineDriver, "transitions": TransitionsDriver, "dict_loop": DictLoopDriver}


def make_drivers(model_factory, requests: Sequence[BenchRequest], names: Sequence[str] = tuple(DRIVERS)) -> dict:
    """One driver per design, each with its own model instance from `model_factory()`."""
    return {name: DRIVERS[name](model_factory(), requests) for name in names}


def check_same_frames(outputs: dict[str, list[FrameKey]]) -> dict[str, int]:
    """Raise unless every design published the same frames (ids, indices, codes); -> counts."""
    counts = {name: len(frames) for name, frames in outputs.items()}
    reference_name, reference = next(iter(outputs.items()))
    want = sorted(reference)
    for name, frames in outputs.items():
        if sorted(frames) != want:
            raise AssertionError(f"{name} published different frames than {reference_name}: counts {counts}")
    return counts
