"""A deliberately simple per-request reference: one request, one step at a time, plain torch + the spec."""

from __future__ import annotations

import torch

from ..lifecycle import FinishReason, Oracle, Phase, Predicate, RequestFSM, State, Transition, Trigger
from ..lifecycle import length_reached, prompt_done
from ..lifecycle.predicates import delay_facts, eos_frame
from ..lifecycle.spec import LifecycleSpec
from ..model_api import (
    FEED_COUNT, FEED_DONE, FEED_ROWS, DelayPattern, FrameDraws, MtpResult, PreparedPrompt, TalkerModel, feed_columns,
)
from ..sampling import FAULT_EMPTY, FAULT_NAN, FAULT_OK, FAULT_POSINF, SamplingParams, describe_fault, fault_word
from ..sampling.faults import FAULT_PAYLOAD
from ..sampling.gaussian import gaussian_noise
from ..sampling.noise import frame_key, gumbel_noise, row_key
from ..sampling.penalties import PENALTY_AFTER_FILTERS
from ..sampling.topp import FX_LIMIT, FX_ONE, FX_STEP, fixed_tables
from .alone import AloneRun, RequestDef

NEG_INF = float("-inf")
# The fault predicate an error edge requires says which model output ended the request.
_ERROR_KINDS = {Predicate.CB0_FAULT: "cb0", Predicate.MTP_FAULT: "mtp"}


# -- the sampler: one row, written from the documented contract (sampler.py, topp.py) --------


def _topp_weight(gap: torch.Tensor) -> torch.Tensor:
    """Fixed-point exp(-gap) for float32 gaps (max - score) >= 0, NaN / huge -> 0 weight."""
    hi, lo = fixed_tables(gap.device)
    q = gap * float(FX_STEP)  # a power of two: exact in float32
    q = torch.where(torch.isnan(q), float(FX_LIMIT), q.clamp(max=float(FX_LIMIT))).to(torch.int64)
    return (hi[q >> 6] * lo[q & 63]) >> 24


def kept_ids(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Bool [V]: ids surviving top-k then top-p on one float32 score row."""
    vocab = scores.shape[0]
    ordered = torch.sort(scores, descending=True).values
    kth = ordered[min(top_k, vocab) - 1] if top_k > 0 else ordered[-1]
    p32 = torch.tensor(top_p, dtype=torch.float32)  # the engine stores top_p as float32
    if p32 >= 1.0:
        return scores >= kth
    # The mass lives on the top-k survivors only; -inf weighs nothing.
    ordered = torch.where(ordered >= kth, ordered, NEG_INF)
    weights = torch.where(ordered > NEG_INF, _topp_weight(ordered[0] - ordered), 0)
    total = int(weights.sum())
    p_fx = int(torch.floor(p32 * FX_ONE))
    # Smallest descending prefix whose mass before each kept position is < top_p (exact ints).
    count, before = 0, 0
    for w, s in zip(weights.tolist(), ordered.tolist()):
        if s == NEG_INF or before * FX_ONE >= p_fx * total:
            break
        count, before = count + 1, before + w
    threshold = ordered[max(count, 1) - 1]
    # Ties with the last kept score are kept too (the rule is a score threshold).
    return scores >= torch.maximum(threshold, kth)


def delay_pattern_row(logits: torch.Tensor, pattern: DelayPattern | None, frames: list[tuple[int, ...]],
                      codebook: int) -> torch.Tensor:
    """One row's logits for `codebook` of the next frame under the delay pattern, restated
    from its definition (model_api.DelayPattern): which id the codebook must take, if any,
    given how many frames were published and the last two of them; else BOC and (beyond
    codebook 0) EOC are out. The wind-down is upstream's counter (boson-multimodal): codebook 0
    first EOC at frame e, then frame e + j locks codebooks 0..j-1 to EOC."""
    if pattern is None:
        return logits
    last = frames[-1] if frames else None
    count = sum(c == pattern.eoc for c in last) if last is not None and last[0] == pattern.eoc else 0
    started_before = len(frames) >= 2 and frames[-2][0] == pattern.eoc  # the last frame was not e itself
    locked = count + started_before if count else 0
    must = pattern.eoc if codebook < locked else pattern.boc if codebook > len(frames) else None
    out = logits.clone()
    for token in range(out.shape[0]):
        if must is not None:
            out[token] = out[token] if token == must else NEG_INF
        elif token == pattern.boc or (token == pattern.eoc and codebook > 0):
            out[token] = NEG_INF
    return out


def _payload_codes(model: TalkerModel, hidden, cb0, sample, seed: int, frames: list, faults: dict) -> torch.Tensor:
    """A payload model's MTP stage for one row: its draws (Gaussian noise of this frame, the
    last published payload), the hook, a non-finite payload as the codebook-1 fault; returns
    the frame row [1, W] (the sampled CB0, then the payload's bits)."""
    spec, device = model.spec, hidden.device
    first, payload = spec.num_codebooks, spec.payload
    key = frame_key(torch.tensor([seed], device=device), torch.tensor([len(frames)], device=device))
    last = frames[-1][first:] if frames else (0,) * payload.numel
    previous = payload.decode(torch.tensor([last], dtype=torch.int64, device=device))
    draws = FrameDraws(sample, lambda shape: gaussian_noise(key, shape), previous)
    out = model.mtp(hidden, cb0.clamp(0, spec.codebook_size - 1), draws)
    if not bool(torch.isfinite(out).all()):
        faults.setdefault(first, FAULT_PAYLOAD)
    return torch.cat([cb0[:, None].to(torch.int64), payload.encode(out)], dim=1)


def history_rules(generated: list[int], penalty: float | None, suppress_id: int | None):
    """The CB0 rules of the engine's contract, restated the way HF's logits processors do
    them: RepetitionPenaltyLogitsProcessor (gather the scores of the ids generated so far,
    penalise, scatter back) and MinNewTokensLengthLogitsProcessor (EOS -> -inf while early)."""
    def rules(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        if generated and penalty is not None:
            ids = torch.tensor(generated, dtype=torch.int64, device=x.device)
            p = torch.tensor(penalty, dtype=torch.float32)  # the engine stores it as float32
            score = x.gather(0, ids)
            x.scatter_(0, ids, torch.where(score < 0, score * p, score / p))
        if suppress_id is not None:
            x[suppress_id] = NEG_INF
        return x
    return rules


def sample_row(
    logits: torch.Tensor, params: SamplingParams, seed: int, frame_index: int, codebook: int,
    allowed: torch.Tensor | None = None, rules=None, late=None,
) -> tuple[int, int]:
    """(token, fault kind) for one 1-D logits row under one request's parameters.

    -inf masks an id; NaN, then +inf, then "nothing left unmasked" are the faults (codes of
    sampling.faults). A faulty row still yields a token: NaN / +inf read as 0. `rules`
    (history_rules) adjust the read, masked row before the empty check; `late` ones (a
    penalty ordered after the filters) the scaled, filtered scores, greedy rows included."""
    x = logits.float()
    nan, posinf = bool(torch.isnan(x).any()), bool((x == float("inf")).any())
    x = torch.where(torch.isnan(x) | (x == float("inf")), torch.zeros_like(x), x)
    if allowed is not None:
        x = x.masked_fill(~allowed, NEG_INF)
    if rules is not None:
        x = rules(x)
    empty = not bool((x > NEG_INF).any())
    fault = FAULT_NAN if nan else FAULT_POSINF if posinf else FAULT_EMPTY if empty else FAULT_OK
    temperature = torch.tensor(params.temperature, dtype=torch.float32)
    if temperature <= 0 and late is None:
        return int(torch.argmax(x)), fault  # greedy ignores top-k / top-p and the noise
    scores = x / temperature if temperature > 0 else x
    scores = scores.masked_fill(~kept_ids(scores, params.top_k, params.top_p), NEG_INF)
    if late is not None:
        scores = late(scores)
        if temperature <= 0:
            return int(torch.argmax(scores)), fault  # the filtered, penalised logits, no noise
    key = row_key(torch.tensor([seed], dtype=torch.int64), torch.tensor([frame_index]), codebook)
    noise = gumbel_noise(key, x.shape[0])[0]
    return int(torch.argmax(scores + noise)), fault  # argmax: ties to the lowest id


# -- the lifecycle walk ---------------------------------------------------------------------


class _Walk:
    """One request's FSM plus the edges it fired, driven stage by stage through the oracle."""

    def __init__(self, spec: LifecycleSpec) -> None:
        self.spec = spec
        self.oracle = Oracle(spec)
        self.fsm: RequestFSM = self.oracle.new("interpreted")
        self.oracle.fire(self.fsm, Trigger.ADMIT)
        self.reason, self.error_kind = FinishReason.NONE, None
        self.fault = 0  # the first fault word a phase that recorded a reason saw

    @property
    def detail(self) -> str:
        return describe_fault(self.fault) if self.reason is FinishReason.ERROR else ""

    @property
    def state(self) -> State:
        return self.fsm.code

    def phase(self, phase: Phase, facts_for, fault: int = 0) -> list[Transition]:
        """Oracle.run_phase_edges; facts_for(edges fired so far) gives each stage's predicates;
        `fault`: the phase's sampling fault word, kept if the phase records a reason.
        Returns the fired edges' declarations, looked up by (trigger, source state)."""
        def declared(edges) -> list[Transition]:
            return [self.spec.transition(trigger, source) for trigger, source in edges]

        fired = declared(self.oracle.run_phase_edges(self.fsm, phase, lambda stage, edges: facts_for(declared(edges))))
        for edge in fired:
            if edge.reason is not FinishReason.NONE:  # the last recorded reason is the request's
                when = edge.guard.resolved()[0] if edge.guard is not None else ()
                kinds = [_ERROR_KINDS[p] for p in when if p in _ERROR_KINDS]
                self.reason = edge.reason
                self.error_kind = kinds[0] if edge.reason is FinishReason.ERROR and kinds else None
                self.fault = self.fault or fault
        return fired


def _bind_one_slot(model: TalkerModel, prepared: PreparedPrompt, device: torch.device) -> dict[str, torch.Tensor]:
    """Model columns for slot 0 (+ the scratch row 1), as the slot table would hold them."""
    columns = {}
    given = dict(prepared.columns)
    if prepared.feed is not None:  # a conditioned model: every row the request will get
        given[FEED_ROWS] = prepared.feed
    given[FEED_COUNT] = torch.tensor(0 if prepared.feed is None else int(prepared.feed.shape[0]))
    given[FEED_DONE] = torch.tensor(int(prepared.feed_done))
    for name, cs in {**model.slot_columns(), **feed_columns(model.spec)}.items():
        col = torch.full((2, *cs.shape), cs.fill, dtype=cs.dtype, device=device)
        value = given.get(name)
        if value is not None:
            col[0][tuple(slice(0, n) for n in value.shape)] = value.to(device=device, dtype=cs.dtype)
        columns[name] = col
    model.bind_slots(1, device, columns)
    return columns


def interpret(model: TalkerModel, lifecycle_spec: LifecycleSpec, definition: RequestDef) -> AloneRun:
    """Run one request to its end; frames, finish reason and error kind as `run_alone` reports."""
    with torch.inference_mode():
        return _interpret(model, lifecycle_spec, definition)


def _interpret(model: TalkerModel, life: LifecycleSpec, d: RequestDef) -> AloneRun:
    if life.deferred:
        raise ValueError(f"the interpreter runs current-step lifecycles; {life.name!r} publishes the frames of its "
                         "current-step twin (lifecycle.variants.current_step_twin) one step later")
    spec = model.spec
    walk = _Walk(life)
    prepared = model.prepare(d.inputs)
    prompt = prepared.prompt_embeds.to(spec.dtype)  # the slot table stores prompts in spec.dtype
    device, prompt_len = prompt.device, int(prompt.shape[0])
    columns = _bind_one_slot(model, prepared, device)
    slot = torch.zeros(1, dtype=torch.int64, device=device)
    model.reset_slots(slot)
    allowed = torch.arange(spec.backbone_vocab_size, device=device) < spec.codebook_size
    if spec.eos_token_id is not None:
        allowed[spec.eos_token_id] = True
    has_mtp_stage = bool(life.stages_of(Phase.MTP))
    # A model may own its sampling (ModelSpec.cb0_sampling / mtp_sampling): the request's is then ignored.
    cb0_params, mtp_params = spec.cb0_sampling or d.cb0, spec.mtp_sampling or d.mtp
    penalty = spec.repetition_penalty if cb0_params.repetition_penalty is None else cb0_params.repetition_penalty
    min_frames = spec.min_frames if d.min_frames is None else d.min_frames
    penalty_late = spec.repetition_penalty_order == PENALTY_AFTER_FILTERS

    frames: list[tuple[int, ...]] = []
    # Before any publish the engine's frame cache row is zeros (only a mutated spec gets there).
    last_embed = torch.zeros(1, spec.hidden_size, dtype=spec.dtype, device=device)
    computed = 0
    for _ in range(spec.max_context + 2):
        if computed < prompt_len:  # the whole (rest of the) prompt in one step
            inputs = prompt[computed:]
        else:  # the last published frame + the text step of that frame
            if spec.has_feed and not (max(len(frames) - 1, 0) < int(columns[FEED_COUNT][0]) or prepared.feed_done):
                raise AssertionError(f"interpreted request {d} starves: a reference run needs its whole feed")
            frame_index = torch.tensor([max(len(frames) - 1, 0)], device=device)
            inputs = last_embed + model.text_step(columns, slot, frame_index).to(spec.dtype)
        scheduled = int(inputs.shape[0])
        positions = torch.arange(computed, computed + scheduled, device=device)
        hidden = model.forward(inputs, positions, torch.zeros(scheduled, dtype=torch.int64, device=device))[-1:]
        logits = delay_pattern_row(model.cb0_logits(hidden)[0], spec.delay_pattern, frames, 0)
        early = spec.eos_token_id is not None and len(frames) < min_frames
        generated = [f[0] for f in frames]
        rules = history_rules(generated, None if penalty_late else penalty, spec.eos_token_id if early else None)
        late = history_rules(generated, penalty, None) if penalty_late else None
        cb0, cb0_fault = sample_row(logits, cb0_params, d.seed, len(frames), 0, allowed, rules, late)
        sample_facts = {
            Predicate.PROMPT_DONE: prompt_done(computed, scheduled, prompt_len),
            Predicate.CB0_FAULT: cb0_fault != FAULT_OK,
            Predicate.EOS_SAMPLED: spec.eos_token_id is not None and cb0 == spec.eos_token_id,
        }
        computed += scheduled
        walk.phase(Phase.SAMPLE, lambda fired: sample_facts, fault_word(cb0_fault, 0))

        codes = torch.tensor([[cb0]], dtype=torch.int64, device=device)
        if walk.state in life.classes.in_step and has_mtp_stage:
            mtp_faults: dict[int, int] = {}  # codebook -> fault kind of its bad row

            def sample(logits: torch.Tensor, codebook: int, params: SamplingParams | None = None) -> torch.Tensor:
                tokens = []
                for row in logits:
                    row = delay_pattern_row(row, spec.delay_pattern, frames, codebook)
                    token, kind = sample_row(row, params or mtp_params, d.seed, len(frames), codebook)
                    if kind != FAULT_OK:
                        mtp_faults.setdefault(codebook, kind)
                    tokens.append(token)
                return torch.tensor(tokens, dtype=torch.int64, device=logits.device)

            cb0_in = codes[:, 0].clamp(0, spec.codebook_size - 1)
            if spec.payload is not None:
                result = _payload_codes(model, hidden, codes[:, 0], sample, d.seed, frames, mtp_faults)
            else:
                result = model.mtp(hidden, cb0_in, sample)
            stop = isinstance(result, MtpResult) and bool(result.stop[0])
            codes = result.codes if isinstance(result, MtpResult) else result
            first = min(mtp_faults, default=None)  # the lowest bad codebook names the fault
            word = 0 if first is None else fault_word(mtp_faults[first], first)
            mtp_facts = {Predicate.MTP_FAULT: bool(mtp_faults), Predicate.MTP_STOP: stop}
            walk.phase(Phase.MTP, lambda fired: mtp_facts, word)

        def publish_facts(fired: list[Transition]) -> dict[Predicate, bool]:
            # A frame counts toward the budget once a publishing edge of this phase fired.
            published = len(frames) + any(e.publishes for e in fired)
            eoc = None if spec.delay_pattern is None else spec.delay_pattern.eoc
            return {Predicate.LENGTH_REACHED: length_reached(published, d.max_frames, computed, spec.max_context),
                    Predicate.EOS_FRAME: eos_frame(codes[0].tolist(), spec.eos_token_id),
                    **delay_facts(len(frames), codes[0].tolist(), spec.num_codebooks, eoc,
                                  frames[-1] if frames else None)}

        if any(e.publishes for e in walk.phase(Phase.PUBLISH, publish_facts)):
            frames.append(tuple(int(c) for c in codes[0]))
            shown = codes if spec.payload is None else spec.payload.decode(codes[:, spec.num_codebooks:])
            last_embed = model.frame_embed(shown).to(spec.dtype)
        if walk.state in life.classes.in_step:
            raise AssertionError(f"spec {life.name!r} left the request resting in {walk.state.label}")
        if walk.state in life.classes.terminal:
            return AloneRun(tuple(frames), walk.reason, walk.error_kind, walk.detail)
    raise AssertionError(f"interpreted request {d} never finished")

