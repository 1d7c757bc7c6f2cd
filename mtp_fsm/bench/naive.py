"""The two naive designs the bench compares with the engine: per-request bookkeeping over a
static `transitions` machine (transitions) or over request-keyed dicts (dict_loop); model
calls and sampling are batched exactly as the engine's, so only lifecycle work differs."""

from __future__ import annotations

from typing import Sequence

import torch

from ..lifecycle import (
    ILLEGAL, FinishReason, Oracle, Phase, Predicate, RequestFSM, State, Trigger, compile_lifecycle, length_reached,
    lifecycle_for, prompt_done,
)
from ..lifecycle.compiled import RULE_DEST, RULE_MUST, RULE_MUST_NOT, RULE_PUBLISHES, RULE_REASON
from ..model_api import MtpResult, TalkerModel
from .batched import ParamColumns, StepSampler, cb0_allowed
from .requests import BenchRequest, FrameKey


# -- shared per-request bookkeeping of the two naive designs -----------------------------


class _PerRequestDriver:
    """The step both naive designs run: model calls batched, everything else per request.

    The lifecycle is the model's spec: per row and phase the step computes the predicates
    in plain Python and hands them to `run_phase`, which each design evaluates its own way
    over the spec's stage chains (no trigger or state is named here). Sampling is the
    engine's batched sampler over all rows (`StepSampler`), its per-row inputs gathered
    from the per-request bookkeeping each step, so frames must match the engine's.
    """

    sampler_class = StepSampler  # the bench's breakdown swaps in a timed subclass

    name = "?"

    def __init__(self, model: TalkerModel, requests: Sequence[BenchRequest]) -> None:
        self.model = model
        self.spec = model.spec
        self.lifecycle = lifecycle_for(self.spec.lifecycle)
        self.classes = self.lifecycle.classes
        self.requests = list(requests)
        # The model's own slot columns (text keys, ...), as the engine's slot table holds them.
        n = len(requests)
        # Device-resident state a GPU port would keep (the per-step inputs are gathered from
        # the per-request bookkeeping each step, host data the step then sends to the device).
        self.device = torch.device("cpu")
        self.columns = {name: torch.full((n + 1, *c.shape), c.fill, dtype=c.dtype, device=self.device)
                        for name, c in model.slot_columns().items()}
        model.bind_slots(n, self.device, self.columns)
        self.allowed = cb0_allowed(self.spec, self.device)
        self.rows = [r.request_id for r in self.requests]

    def admit(self) -> list[FrameKey]:
        for slot, req in enumerate(self.requests):
            prepared = self.model.prepare(req.inputs)
            for name, value in prepared.columns.items():  # a shorter leading dim keeps the fill
                self.columns[name][slot][tuple(map(slice, value.shape))] = value
            self.add(req, slot, prepared.prompt_embeds)
        return self.step()

    def step(self) -> list[FrameKey]:
        rows = [rid for rid in self.rows if self.state_of(rid) in self.classes.live]
        if not rows:
            return []
        reqs = [self.bench_request(rid) for rid in rows]
        # Compose inputs: the remaining prompt for prefill rows, frame embed + text step for decode.
        inputs, positions, token_slots, last, text_rows, scheduled = [], [], [], [], [], []
        for rid in rows:
            slot, computed, prompt_len = self.slot(rid), self.computed(rid), self.prompt_len(rid)
            if computed < prompt_len:
                inputs.append(self.prompt(rid)[computed:])
                positions.extend(range(computed, prompt_len))
                token_slots.extend([slot] * (prompt_len - computed))
                scheduled.append(prompt_len - computed)
            else:
                text_rows.append((len(inputs), slot, max(self.num_frames(rid) - 1, 0)))
                inputs.append(self.frame_embed(rid)[None])
                positions.append(computed)
                token_slots.append(slot)
                scheduled.append(1)
            last.append(len(positions) - 1)
        if text_rows:
            at, slots, index = zip(*text_rows)
            text = self.model.text_step(self.columns, torch.tensor(slots), torch.tensor(index))
            for j, i in enumerate(at):
                inputs[i] = inputs[i] + text[j]
        hidden = self.model.forward(torch.cat(inputs), torch.tensor(positions), torch.tensor(token_slots))
        last_hidden = hidden[torch.tensor(last)]
        logits = self.model.cb0_logits(last_hidden)
        # The sampler's per-row inputs, gathered from the per-request bookkeeping.
        sampler = self.sampler_class(
            torch.tensor([req.seed for req in reqs], dtype=torch.int64),
            torch.tensor([self.num_frames(rid) for rid in rows], dtype=torch.int64),
            ParamColumns.of([req.cb0 for req in reqs]), ParamColumns.of([req.mtp for req in reqs]),
            num_codebooks=self.spec.num_codebooks, allowed=self.allowed,
        )
        cb0, cb0_fault = sampler.cb0(logits)
        # The host needs each row's CB0 (EOS) and sampling health: one copy of each.
        cb0_list, cb0_bad = cb0.tolist(), (cb0_fault != 0).tolist()
        eos = self.spec.eos_token_id
        for rid, token, bad, n in zip(rows, cb0_list, cb0_bad, scheduled):
            computed = self.computed(rid)
            self.set_computed(rid, computed + n)
            facts = {Predicate.PROMPT_DONE: prompt_done(computed, n, self.prompt_len(rid)),
                     Predicate.CB0_FAULT: bad, Predicate.EOS_SAMPLED: token == eos}
            self.run_phase(rid, Phase.SAMPLE, lambda _: facts)

        if self.spec.has_mtp:
            mtp_bad = torch.zeros(len(rows), dtype=torch.bool, device=self.device)

            def sample(mtp_logits: torch.Tensor, codebook: int, params=None) -> torch.Tensor:
                tokens, fault = sampler.mtp(mtp_logits, codebook, params)
                mtp_bad.logical_or_(fault != 0)
                return tokens

            codes = self.model.mtp(last_hidden, cb0.clamp(0, self.spec.codebook_size - 1), sample)
            stops = [False] * len(rows)
            if isinstance(codes, MtpResult):  # variant mtp_stop: the MTP hook also decides the stop
                codes, stops = codes.codes, codes.stop.tolist()
            for rid, bad, stop in zip(rows, mtp_bad.tolist(), stops):
                self.run_phase(rid, Phase.MTP, lambda _: {Predicate.MTP_FAULT: bad, Predicate.MTP_STOP: stop})
        else:
            codes = cb0[:, None]  # single codebook: CB0 is the whole frame, no MTP stages
        embeds = self.model.frame_embed(codes)
        codes_list = codes.tolist()
        published, max_context = [], self.spec.max_context
        for i, (rid, req) in enumerate(zip(rows, reqs)):
            index, limit, computed = self.num_frames(rid), req.max_frames, self.computed(rid)

            def length_facts(frames: int) -> dict:  # a stage after a publishing edge sees the frame counted
                return {Predicate.LENGTH_REACHED: length_reached(index + frames, limit, computed, max_context)}

            if self.run_phase(rid, Phase.PUBLISH, length_facts):
                self.on_frame(rid, embeds[i])
                published.append((rid, index, tuple(codes_list[i])))
            if self.state_of(rid) in self.classes.in_step:
                raise RuntimeError(f"request {rid!r} ends the step in state {State(self.state_of(rid)).label!r}")
        return published

    @staticmethod
    def frames(out: list[FrameKey]) -> list[FrameKey]:
        return out


# -- (2) the lifecycle's transitions machine, one light model object per request ---------


class MachineRequest:
    """A request's bookkeeping next to its `RequestFSM` (the static machine's model)."""

    __slots__ = ("req", "slot", "prompt", "prompt_len", "num_computed", "num_frames", "frame_embed", "fsm",
                 "finish_reason")

    def __init__(self, req: BenchRequest, slot: int, prompt: torch.Tensor, fsm: RequestFSM) -> None:
        self.req, self.slot, self.prompt, self.fsm = req, slot, prompt, fsm
        self.prompt_len, self.num_computed, self.num_frames = int(prompt.shape[0]), 0, 0
        self.frame_embed, self.finish_reason = None, FinishReason.NONE


class TransitionsDriver(_PerRequestDriver):
    """One static `transitions` machine (the Oracle over the model's lifecycle) and a
    `RequestFSM` per request; each phase's stages fire through `Oracle.run_phase`, which
    lets `transitions` evaluate the guards on the row's predicates."""

    name = "transitions"

    def __init__(self, model: TalkerModel, requests: Sequence[BenchRequest]) -> None:
        super().__init__(model, requests)
        self.oracle = Oracle(self.lifecycle)
        # (trigger, source) -> the declared edge: its reason and whether it publishes.
        self._edges = {(t.trigger, s): t for t in self.lifecycle.transitions for s in t.sources}
        self.reqs: dict[str, MachineRequest] = {}

    def add(self, req: BenchRequest, slot: int, prompt: torch.Tensor) -> None:
        obj = MachineRequest(req, slot, prompt, self.oracle.new(req.request_id))
        self.oracle.fire(obj.fsm, Trigger.ADMIT)  # a host trigger, fired where the host decides it
        self.reqs[req.request_id] = obj

    def run_phase(self, rid: str, phase: Phase, facts) -> int:
        """Run the phase's stages; record the fired edges' reasons; -> frames published."""
        obj = self.reqs[rid]
        edges, source = [], [obj.fsm.code]

        def catch_up(fired: list) -> None:
            # A stage that fired appended its trigger; its edge leaves the state before it.
            if len(fired) > len(edges):
                edges.append(self._edges[fired[-1], source[0]])
            source[0] = obj.fsm.code

        def facts_for(stage, fired):
            catch_up(fired)
            return facts(sum(e.publishes for e in edges))

        catch_up(self.oracle.run_phase(obj.fsm, phase, facts_for))
        for edge in edges:
            if edge.reason:
                obj.finish_reason = edge.reason
        return sum(e.publishes for e in edges)

    def state_of(self, rid):
        return self.reqs[rid].fsm.code

    def finish_reasons(self) -> dict[str, FinishReason]:
        return {rid: obj.finish_reason for rid, obj in self.reqs.items() if obj.finish_reason}

    def on_frame(self, rid, embed):
        obj = self.reqs[rid]
        obj.frame_embed = embed
        obj.num_frames += 1

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

    def frame_embed(self, rid):
        return self.reqs[rid].frame_embed

    def bench_request(self, rid):
        return self.reqs[rid].req


# -- (3) per-request Python loop over slot/request-keyed dicts ---------------------------


class DictLoopDriver(_PerRequestDriver):
    """The shape of the code mtp_fsm replaces: ~10 dicts keyed by request id or slot, with
    RuntimeError guards; its moves are the compiled rules as a plain dict, evaluated per
    row on an int predicate word along the spec's stage chains."""

    name = "dict_loop"

    def __init__(self, model: TalkerModel, requests: Sequence[BenchRequest]) -> None:
        super().__init__(model, requests)
        rules = compile_lifecycle(self.lifecycle).rules
        # {(trigger, state): (dest, must, must_not, reason, publishes)} for declared edges only.
        declared = (rules[RULE_DEST] != ILLEGAL).nonzero().tolist()
        self.rules = {(t, s): tuple(rules[:, t, s].tolist()) for t, s in declared}
        self.chains = {p: tuple((st.total, tuple(map(int, st.triggers))) for st in self.lifecycle.stages_of(p))
                       for p in Phase}
        self.req_slot: dict[str, int] = {}
        self.slot_req: dict[int, str] = {}
        self.request: dict[str, BenchRequest] = {}
        self.prompts: dict[str, torch.Tensor] = {}
        self.num_computed_: dict[str, int] = {}
        self.num_frames_: dict[str, int] = {}
        self.frame_embeds: dict[int, torch.Tensor] = {}  # slot -> embedding of its last frame
        self.state: dict[str, int] = {}
        self.finished: dict[str, int] = {}  # request -> finish reason

    def add(self, req, slot, prompt):
        rid = req.request_id
        if slot in self.slot_req:
            raise RuntimeError(f"slot {slot} still owned by {self.slot_req[slot]!r}")
        rule = self.rules.get((Trigger.ADMIT, min(self.classes.vacant)))  # the host decides admission
        if rule is None:
            raise RuntimeError(f"lifecycle {self.lifecycle.name!r} cannot admit {rid!r}")
        self.req_slot[rid], self.slot_req[slot], self.request[rid] = slot, rid, req
        self.prompts[rid], self.num_computed_[rid], self.num_frames_[rid] = prompt, 0, 0
        self.state[rid] = rule[RULE_DEST]

    def run_phase(self, rid: str, phase: Phase, facts) -> int:
        """The phase's chains over this row: per stage, the first trigger whose rule from
        the row's state exists and whose guard masks match the word fires."""
        published = 0
        for total, triggers in self.chains[phase]:
            word = sum(p.bit for p, value in facts(published).items() if value)
            state = self.state[rid]
            for trigger in triggers:
                rule = self.rules.get((trigger, state))
                if rule is not None and (word & rule[RULE_MUST]) == rule[RULE_MUST] and not word & rule[RULE_MUST_NOT]:
                    self.state[rid] = rule[RULE_DEST]
                    if rule[RULE_REASON]:
                        self.finished[rid] = rule[RULE_REASON]
                    published += rule[RULE_PUBLISHES]
                    break
            else:
                if total:
                    raise RuntimeError(f"request {rid!r}: a total stage moved nothing from state {state}")
        return published

    def state_of(self, rid):
        return self.state[rid]  # a State code; the class sets hold IntEnums, equal to their codes

    def finish_reasons(self) -> dict[str, FinishReason]:
        return {rid: FinishReason(r) for rid, r in self.finished.items()}

    def on_frame(self, rid, embed):
        self.frame_embeds[self.req_slot[rid]] = embed
        self.num_frames_[rid] += 1

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

    def frame_embed(self, rid):
        slot = self.req_slot[rid]
        if slot not in self.frame_embeds:
            raise RuntimeError(f"decode row {rid!r} has no frame in slot {slot}")
        return self.frame_embeds[slot]

    def bench_request(self, rid):
        return self.request[rid]
