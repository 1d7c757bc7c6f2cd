"""Torch reference kernels: the CPU path and the contract the Triton kernels are tested against.

Every lifecycle move is made by `run_phase`, which evaluates the compiled stage chains: each
stage's predicates as one word per row, then the stage's chain outcome (destination, fired,
reason, publishes; folded by the compiler for every state and word) gathered at (state,
word). The Triton kernels walk the same chains trigger by trigger instead, so the two are
independent implementations of one semantics (tested bit-exact). No stage body names a
trigger or a state; the data movement of a stage keys on what the rules say
(state classes, the `publishes` effect), guard masks are applied over every row (no
per-request Python loop) and no device value is read on the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..lifecycle import CLASS_IN_STEP, CLASS_LIVE, CLASS_VACANT, DeviceLifecycle, Phase, Predicate
from ..lifecycle.compiled import OUTCOME_FIRED, OUTCOME_PUBLISHES, OUTCOME_REASON_SHIFT, RULE_DEST, WORDS
from ..sampling import FAULT_CODEBOOK_SHIFT, SamplingParams, frame_key, gumbel_noise_codebooks, sample_tokens
from ..sampling.penalties import apply_repetition_penalty, suppress_eos
from ..sampling.params import sampler_facts
from ..slots import ERR_IDENTITY, ERR_ILLEGAL, ERR_SPAN, SlotTable
from .contract import ReplayFrames, StagedAdmits, StagedEvents, StepBatch, TextStep

# Draw a frame's MTP noise in one pass (fewer, larger ops) up to this many elements.
BATCHED_NOISE_ELEMENTS = 1 << 17  # measured: larger blocks fall out of cache and lose


class PhaseResult(NamedTuple):
    state: torch.Tensor  # new state per row
    reason: torch.Tensor  # int32 finish reason recorded by a fired edge (0 = none)
    published: torch.Tensor  # bool: a fired edge emits a frame
    stuck: torch.Tensor  # bool: a total stage moved nothing, or the row rests in an in-step state


def predicate_word(facts: dict[Predicate, torch.Tensor]) -> torch.Tensor:
    """Pack one phase's predicate masks into an int32 word per row (bit = Predicate value)."""
    word = None
    for p, mask in facts.items():
        bits = mask.to(torch.int32) << int(p)
        word = bits if word is None else word | bits
    return word


def in_class(lc: DeviceLifecycle, state: torch.Tensor, class_bit: int) -> torch.Tensor:
    return (lc.state_class[state.long()] & class_bit) != 0


def run_phase(lc: DeviceLifecycle, phase: Phase, state: torch.Tensor, owned: torch.Tensor, facts_for) -> PhaseResult:
    """Every stage of `phase` over every row. facts_for(published_so_far) returns the stage's
    predicate masks (a stage after a publishing one sees the frame counted); a dict is facts
    that no stage changes (one word for the whole phase). Each stage is one gather of its
    chain's outcome at (state, predicate word)."""
    reason = torch.zeros_like(state, dtype=torch.int32)
    published = torch.zeros_like(owned)
    stuck = torch.zeros_like(owned)
    fixed = predicate_word(facts_for) if isinstance(facts_for, dict) else None
    for (total, _), outcomes in zip(lc.host_chains[phase], lc.outcomes[phase]):
        word = fixed if fixed is not None else predicate_word(facts_for(published))
        outcome = outcomes[state.long() * WORDS + word]
        fired = owned & ((outcome & OUTCOME_FIRED) != 0)
        why = outcome >> OUTCOME_REASON_SHIFT
        reason = torch.where(fired & (why != 0), why, reason)
        published = published | (fired & ((outcome & OUTCOME_PUBLISHES) != 0))
        if total:
            stuck = stuck | (owned & ~fired)
        state = torch.where(fired, (outcome & 0xFF).to(state.dtype), state)
    return PhaseResult(state, reason, published, stuck)


def _owned(table: SlotTable, batch: StepBatch) -> torch.Tensor:
    """Rows whose slot still belongs to the request the host scheduled (identity guard)."""
    return ~batch.is_padding & (table.serial[batch.idx_mapping] == batch.expected_serial)


def _flag(table: SlotTable, slots: torch.Tensor, mask: torch.Tensor, bit: int) -> None:
    table.error[slots] = table.error[slots] | torch.where(mask, bit, 0).to(torch.int32)


def _record(table: SlotTable, slot: torch.Tensor, result: PhaseResult) -> None:
    table.state[slot] = result.state
    table.finish_reason[slot] = torch.where(result.reason != 0, result.reason, table.finish_reason[slot])
    _flag(table, slot, result.stuck, ERR_ILLEGAL)


def apply_host_events(table: SlotTable, lc: DeviceLifecycle, events: StagedEvents) -> None:
    """Stage 1a: abort / preempt / release chains, one pass per chain position."""
    slots = events.slots
    state = table.state[slots]
    dest_table = lc.rules[RULE_DEST]
    for k in range(events.triggers.shape[1]):
        trig = events.triggers[:, k]
        has = trig >= 0
        dest = dest_table[trig.clamp(min=0), state.long()]
        illegal = has & (dest < 0)
        state = torch.where(has & ~illegal, dest, state)
        _flag(table, slots, illegal, ERR_ILLEGAL)
    table.state[slots] = state
    table.finish_reason[slots] = torch.where(events.reasons != 0, events.reasons, table.finish_reason[slots])
    table.serial[slots] = torch.where(in_class(lc, state, CLASS_VACANT), 0, table.serial[slots])


def apply_admits(table: SlotTable, lc: DeviceLifecycle, admits: StagedAdmits) -> None:
    """Stage 1b: every column of each admitted row re-initialised, then its values written."""
    slots = admits.slots
    dest = lc.rules[RULE_DEST, admits.trigger, table.state[slots].long()]
    illegal = dest < 0
    new_state = torch.where(illegal, table.state[slots], dest)
    defaults = table.column_defaults()
    for name, column in table.columns().items():
        if name in ("state", "error"):
            continue
        column[slots] = defaults[name]  # a host scalar: no per-column device copy
        value = admits.values.get(name)
        if value is None:
            continue
        if value.shape[1:] == column.shape[1:]:
            column[slots] = value.to(column.dtype)
        else:  # a shorter leading dimension (variable-length sequences)
            length = value.shape[1]
            positions = torch.arange(length, device=column.device)
            column[slots[:, None], positions[None, :]] = value.to(column.dtype)
    table.error[slots] = torch.where(illegal, ERR_ILLEGAL, 0).to(torch.int32)
    table.state[slots] = new_state


def replay_frames(table: SlotTable, replay: ReplayFrames, frame_embed, text_step: TextStep) -> None:
    """Resume: rebuild the inputs that carried already-published frames into the prompt rows."""
    embeds = frame_embed(replay.codes) + text_step(table.extra, replay.slots, replay.frame_index)
    table.prompt_embeds[replay.slots, replay.positions] = embeds.to(table.prompt_embeds.dtype)


def compose_inputs(table: SlotTable, lc: DeviceLifecycle, batch: StepBatch, text_step: TextStep):
    """Stage 2: prefill tokens take their prompt rows; decode rows take frame embed + text step.

    Returns (inputs_embeds [T, H], positions [T], token_slots [T]; -1 = inert token).
    """
    return compose_rows(table, lc, batch, decode_text(table, batch, text_step))


def decode_text(table: SlotTable, batch: StepBatch, text_step: TextStep) -> torch.Tensor:
    """The model's text-step input of each row's decode token (the model's own code, so it
    stays outside the fused stage functions)."""
    slot = batch.idx_mapping
    return text_step(table.extra, slot, (table.num_frames[slot] - 1).clamp(min=0))


def compose_rows(table: SlotTable, lc: DeviceLifecycle, batch: StepBatch, text: torch.Tensor):
    """compose_inputs given each row's text-step input [B, H]: a pure tensor function."""
    slot = batch.idx_mapping
    owned = _owned(table, batch)
    live = owned & in_class(lc, table.state[slot], CLASS_LIVE)
    computed = table.num_computed[slot]
    prefill = computed < table.prompt_len[slot]
    # Phase comes from num_computed < prompt_len, never from the span length.
    bad_span = live & torch.where(prefill, computed + batch.num_scheduled > table.prompt_len[slot],
                                  batch.num_scheduled != batch.decode_width)
    _flag(table, slot, bad_span, ERR_SPAN)
    _flag(table, slot, ~batch.is_padding & ~owned, ERR_IDENTITY)
    decode_input = table.frame_embed[slot] + text.to(table.frame_embed.dtype)
    rows = batch.token_rows
    positions = computed[rows] + batch.token_offsets
    if batch.has_prefill:
        prompt_input = table.prompt_embeds[slot[rows], positions.clamp(max=table.max_context - 1)]
        inputs = torch.where(prefill[rows, None], prompt_input, decode_input[rows])
    else:  # every row decodes (host-known): no prompt row to gather
        inputs = decode_input[rows]
    usable = live & ~bad_span
    # A draft past the context is inert (its position holds no KV; verification stops before it).
    token_slots = torch.where(usable[rows] & (positions < table.max_context), slot[rows], -1)
    return inputs, positions, token_slots


def _record_fault(table: SlotTable, slot: torch.Tensor, owned: torch.Tensor, result: PhaseResult,
                  fault: torch.Tensor) -> None:
    """The `fault` column: a row's first fault word, kept only where the phase ended the
    row (a recorded reason) on a bad sample, and only while the column is still 0."""
    old = table.fault[slot]
    write = owned & (result.reason != 0) & (fault != 0) & (old == 0)
    table.fault[slot] = torch.where(write, fault.to(old.dtype), old)


def sample_cb0(
    table: SlotTable,
    lc: DeviceLifecycle,
    batch: StepBatch,
    logits: torch.Tensor,
    *,
    eos_token_id: int | None,
    allowed: torch.Tensor | None,
) -> torch.Tensor:
    """Stage 4: counters, CB0 sampling and the sample-phase stages (intake, EOS), fused."""
    tokens, fault = draw_cb0(table, batch, logits, eos_token_id=eos_token_id, allowed=allowed)
    record_cb0(table, lc, batch, tokens, fault, eos_token_id)
    return tokens


def draw_cb0(table: SlotTable, batch: StepBatch, logits: torch.Tensor, *, eos_token_id: int | None,
             allowed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's CB0 token and fault word, with its history rules (penalty, min_frames)."""
    slot = batch.idx_mapping
    suppress = batch.cb0_min_frames and eos_token_id is not None

    def rules(x: torch.Tensor) -> torch.Tensor:
        if batch.cb0_penalty:
            x = apply_repetition_penalty(x, table.cb0_counts[slot], table.cb0_penalty[slot])
        if suppress:
            x = suppress_eos(x, eos_token_id, table.num_frames[slot], table.min_frames[slot])
        return x

    return sample_tokens(
        logits, table.cb0_temperature[slot], table.cb0_top_k[slot], table.cb0_top_p[slot],
        table.seed[slot], table.num_frames[slot], 0, allowed=allowed, apply_filters=batch.cb0_filters,
        top_k_max=batch.cb0_top_k_max, any_top_p=batch.cb0_any_top_p, top_k_min=batch.cb0_top_k_min,
        rules=rules if batch.cb0_penalty or suppress else None,
    )


def record_cb0(table: SlotTable, lc: DeviceLifecycle, batch: StepBatch, tokens: torch.Tensor, fault: torch.Tensor,
               eos_token_id: int | None) -> None:
    """The sample-phase stages over sampled CB0 tokens and their fault words: counters,
    intake and EOS edges, the fault column (a pure tensor function)."""
    slot = batch.idx_mapping
    state = table.state[slot]
    owned = _owned(table, batch)
    live = owned & in_class(lc, state, CLASS_LIVE)
    computed = table.num_computed[slot] + torch.where(live, batch.num_scheduled, 0)
    bad = fault != 0
    eos = tokens == eos_token_id if eos_token_id is not None else torch.zeros_like(bad)
    facts = {Predicate.PROMPT_DONE: computed >= table.prompt_len[slot], Predicate.CB0_FAULT: bad,
             Predicate.EOS_SAMPLED: eos}
    result = run_phase(lc, Phase.SAMPLE, state, owned, facts)
    table.num_computed[slot] = computed
    _record(table, slot, result)
    _record_fault(table, slot, owned, result, fault)  # codebook 0: the word is the kind


def mtp_sampler(table: SlotTable, batch: StepBatch):
    """The CodebookSampler handed to the model's MTP hook, plus its per-row fault words
    (int32 [B]: kind | codebook << 4 of the row's lowest bad codebook, 0 = none)."""
    slot = batch.idx_mapping
    faults = torch.zeros(slot.shape, dtype=torch.int32, device=slot.device)
    temperature, top_k, top_p = table.mtp_temperature[slot], table.mtp_top_k[slot], table.mtp_top_p[slot]
    seed, frame_index = table.seed[slot], table.num_frames[slot]
    key = frame_key(seed, frame_index)  # shared by the frame's Q-1 codebooks
    drawn: dict[int, torch.Tensor | None] = {}  # vocab -> noise of codebooks 1..Q-1
    highest = [-1]  # the highest codebook sampled so far

    def noise_for(codebook: int, vocab: int) -> torch.Tensor | None:
        count = table.num_codebooks - 1
        if vocab not in drawn:
            # Decided by the table's size, never the step's row count, so a step's work
            # (and its op count) does not depend on how many rows it has.
            fits = count * (table.max_slots + 1) * vocab <= BATCHED_NOISE_ELEMENTS
            drawn[vocab] = gumbel_noise_codebooks(key, 1, count, vocab) if fits else None
        block = drawn[vocab]
        return block[codebook - 1] if block is not None and 1 <= codebook <= count else None

    def sample(logits: torch.Tensor, codebook: int, params: SamplingParams | None = None) -> torch.Tensor:
        if params is None:  # each row's own MTP parameters
            t, k, p, filters = temperature, top_k, top_p, batch.mtp_filters
            k_max, any_p, k_min = batch.mtp_top_k_max, batch.mtp_any_top_p, batch.mtp_top_k_min
        else:  # a draw whose parameters the model owns (e.g. MOSS's stop head), same for every row
            t, k, p = (torch.full_like(c, v) for c, v in ((temperature, params.temperature), (top_k, params.top_k),
                                                          (top_p, params.top_p)))
            filters = params.filters
            k_max, any_p, k_min = sampler_facts([params])
        tokens, kind = sample_tokens(
            logits, t, k, p, seed, frame_index, codebook, apply_filters=filters, key=key, top_k_max=k_max,
            any_top_p=any_p, top_k_min=k_min, noise=noise_for(codebook, logits.shape[-1]),
        )
        # Keep the lowest bad codebook, whatever order the hook samples them in. Above every
        # codebook sampled so far (host-known), a recorded fault is lower: keep the first.
        if codebook > highest[0]:
            first = (kind != 0) & (faults == 0)
            highest[0] = codebook
        else:
            first = (kind != 0) & ((faults == 0) | ((faults >> FAULT_CODEBOOK_SHIFT) > int(codebook)))
        torch.where(first, kind | (int(codebook) << FAULT_CODEBOOK_SHIFT), faults, out=faults)
        return tokens

    return sample, faults


def mtp_scatter(
    table: SlotTable, lc: DeviceLifecycle, batch: StepBatch, mtp_faults: torch.Tensor, mtp_stop: torch.Tensor | None = None,
    last: bool = False,
) -> None:
    """Stage 5: the MTP-phase stages (frame complete, an error on a bad MTP sample, or the
    stop an MtpResult decided). mtp_faults: the fault words of `mtp_sampler` (int32 [B],
    0 = ok); mtp_stop: bool [B] from an MtpResult, None when the hook returned codes only;
    last: the step's final stage (speculative: the drafter), which flags rows left in-step."""
    slot = batch.idx_mapping
    owned = _owned(table, batch)
    facts = {Predicate.MTP_FAULT: mtp_faults != 0,
             Predicate.MTP_STOP: torch.zeros_like(owned) if mtp_stop is None else mtp_stop.to(torch.bool)}
    result = run_phase(lc, Phase.MTP, table.state[slot], owned, facts)
    if last:
        result = result._replace(stuck=result.stuck | (owned & in_class(lc, result.state, CLASS_IN_STEP)))
    _record(table, slot, result)
    _record_fault(table, slot, owned, result, mtp_faults)


def delay_facts(frame_index: torch.Tensor, codes: torch.Tensor, eoc: int | None) -> dict:
    """RAMP_DONE, EOC_FRAME and ALL_EOC of the frames rows publish (none without a delay pattern)."""
    if eoc is None:
        return {}
    is_eoc = codes == eoc
    return {Predicate.RAMP_DONE: frame_index >= codes.shape[1] - 2, Predicate.EOC_FRAME: is_eoc[:, 0],
            Predicate.ALL_EOC: is_eoc.all(dim=1)}


def publish_frames(
    table: SlotTable, lc: DeviceLifecycle, batch: StepBatch, codes: torch.Tensor, frame_embeds: torch.Tensor,
    eoc: int | None = None, eos: int | None = None, accepted: torch.Tensor | None = None, last: bool = True,
) -> torch.Tensor:
    """Stage 5b: the publish-phase stages; frame cache, counters and the packed output for
    rows whose fired edge publishes. eoc: the delay pattern's EOC id (None: no pattern);
    eos: the EOS id whose frames are the last (a lifecycle reading eos_frame; else None);
    accepted: bool [B], DRAFT_ACCEPTED of a verify position (speculative; None: false);
    last: no stage runs after this one in the step (rows resting in-step are flagged);
    a verify position before the drafter passes False and the drafter's stage checks.

    Returns the packed per-row output [B, OUT_CODES + Q] (int64) for the single copy.
    """
    slot = batch.idx_mapping
    owned = _owned(table, batch)
    frame_index = table.num_frames[slot]
    computed, max_frames = table.num_computed[slot], table.max_frames[slot]
    frame_facts = delay_facts(frame_index, codes, eoc)
    if eos is not None:
        frame_facts[Predicate.EOS_FRAME] = codes[:, 0] == eos
    if accepted is not None:
        frame_facts[Predicate.DRAFT_ACCEPTED] = accepted

    def facts(published: torch.Tensor) -> dict:
        frames = frame_index + published.long()
        return {Predicate.LENGTH_REACHED: (frames >= max_frames) | (computed >= table.max_context), **frame_facts}

    result = run_phase(lc, Phase.PUBLISH, table.state[slot], owned, facts)
    if last:  # whatever the stages did, no row may rest in a state that exists only inside a step
        result = result._replace(stuck=result.stuck | (owned & in_class(lc, result.state, CLASS_IN_STEP)))
    ready = result.published
    num_frames = frame_index + ready.long()
    table.frame_codes[slot] = torch.where(ready[:, None], codes, table.frame_codes[slot])
    log_at = frame_index.clamp(max=table.max_context - 1)
    table.frame_log[slot, log_at] = torch.where(ready[:, None], codes, table.frame_log[slot, log_at])
    table.frame_embed[slot] = torch.where(ready[:, None], frame_embeds.to(table.frame_embed.dtype), table.frame_embed[slot])
    # The repetition penalty's memory: one more occurrence of each published CB0 id.
    cb0 = codes[:, 0].long().clamp(0, table.cb0_counts.shape[1] - 1)
    table.cb0_counts.index_put_((slot, cb0), ready.to(table.cb0_counts.dtype), accumulate=True)
    table.num_frames[slot] = num_frames
    _record(table, slot, result)
    columns = [ready.long(), frame_index, result.state.long(), table.finish_reason[slot].long(),
               table.error[slot].long(), num_frames, table.num_computed[slot].long()]
    return torch.cat([torch.stack(columns, dim=1), torch.where(ready[:, None], codes, 0)], dim=1)
