"""Torch reference kernels: the CPU path and the contract the Triton kernels are tested against.

Every lifecycle move is made by `run_phase`, which evaluates a whole phase's compiled stage
chains with one gather: the phase's outcome (destination, reason, published, stuck; folded by
the compiler for every state, ownership and predicate word, `lifecycle.phase_fold`) at each
row's index. The Triton kernels walk the same chains trigger by trigger instead, so the two are
independent implementations of one semantics (tested bit-exact). No stage body names a
trigger or a state; the data movement of a stage keys on what the rules say
(state classes, the `publishes` effect), guard masks are applied over every row (no
per-request Python loop) and no device value is read on the host.
"""

from __future__ import annotations

import functools

import torch

from ..lifecycle import CLASS_LIVE, DeviceLifecycle, Phase, Predicate
from ..sampling import FAULT_CODEBOOK_SHIFT, SamplingParams, frame_key, gumbel_noise_codebooks, sample_tokens
from ..sampling.params import sampler_facts
from ..slots import (
    ERR_IDENTITY, ERR_SPAN, PROGRESS_COMPUTED, PROGRESS_FRAMES, PROGRESS_MAX_FRAMES, PROGRESS_PROMPT_LEN, WORD_ERROR,
    WORD_STATE, SlotTable,
)
from .contract import StepBatch, TextStep
# The step-boundary stages (host events, admissions, resume replay) live beside the decode ones.
from .events import apply_admits, apply_host_events, replay_frames  # noqa: F401
from .row_ops import (  # noqa: F401
    PhaseResult, at, const, draw_cb0_rows, flag, in_class, owned_rows, owns, progress_at, put, record, run_phase,
    words_at,
)
# Speculative decoding's verify positions as rows (their own module: the stage functions' names).
from .verify import sample_positions, verify_frames  # noqa: F401

# Draw a frame's MTP noise in one pass (fewer, larger ops) up to this many elements.
BATCHED_NOISE_ELEMENTS = 1 << 17  # measured: larger blocks fall out of cache and lose


def compose_inputs(table: SlotTable, lc: DeviceLifecycle, batch: StepBatch, text_step: TextStep):
    """Stage 2: prefill tokens take their prompt rows; decode rows take frame embed + text step.

    Returns (inputs_embeds [T, H], positions [T], token_slots [T]; -1 = inert token).
    """
    return compose_rows(table, lc, batch, decode_text(table, batch, text_step))


def decode_text(table: SlotTable, batch: StepBatch, text_step: TextStep) -> torch.Tensor:
    """The model's text-step input of each row's decode token (the model's own code, so it
    stays outside the fused stage functions)."""
    slot = batch.idx_mapping
    return text_step(table.extra, slot, (at(table.num_frames, slot) - 1).clamp(min=0))


def compose_rows(table: SlotTable, lc: DeviceLifecycle, batch: StepBatch, text: torch.Tensor):
    """compose_inputs given each row's text-step input [B, H]: a pure tensor function."""
    slot, device = batch.idx_mapping, batch.idx_mapping.device
    progress, words = progress_at(table, slot), words_at(table, slot)
    owned = owns(progress, batch)
    stale = batch.scheduled ^ owned  # scheduled onto a slot another request owns (owned implies scheduled)
    live = owned & in_class(lc, words[WORD_STATE], CLASS_LIVE)
    computed, prompt_len = progress[PROGRESS_COMPUTED], progress[PROGRESS_PROMPT_LEN]
    prefill = computed < prompt_len
    # Phase comes from num_computed < prompt_len, never from the span length.
    bad_span = live & torch.where(prefill, computed + batch.num_scheduled > prompt_len,
                                  batch.num_scheduled != const(batch.decode_width, torch.int64, device))
    zero = const(0, torch.int32, device)
    bits = (torch.where(bad_span, const(ERR_SPAN, torch.int32, device), zero)
            | torch.where(stale, const(ERR_IDENTITY, torch.int32, device), zero))
    put(table.lifecycle_words[WORD_ERROR], slot, words[WORD_ERROR] | bits)
    decode_input = at(table.frame_embed, slot) + text.to(table.frame_embed.dtype)
    usable = live ^ bad_span  # live and not bad_span (bad_span implies live)
    context = const(table.max_context, torch.int64, device)
    if batch.tokens_are_rows:  # token i is row i's only token (host-known): no per-token gather
        positions, token_rows = computed, None
        usable_tokens, token_slot = usable, slot
    else:
        token_rows = batch.token_rows
        positions = computed[token_rows] + batch.token_offsets
        usable_tokens, token_slot = usable[token_rows], slot[token_rows]
    if batch.has_prefill:
        prompt_input = table.prompt_embeds[token_slot, positions.clamp(max=table.max_context - 1)]
        in_prompt = prefill if token_rows is None else prefill[token_rows]
        decode_tokens = decode_input if token_rows is None else decode_input[token_rows]
        inputs = torch.where(in_prompt[:, None], prompt_input, decode_tokens)
    else:  # every row decodes (host-known): no prompt row to gather
        inputs = decode_input if token_rows is None else decode_input[token_rows]
    # A draft past the context is inert (its position holds no KV; verification stops before it).
    token_slots = torch.where(usable_tokens & (positions < context), token_slot, const(-1, torch.int64, device))
    return inputs, positions, token_slots


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
    """Each row's CB0 token and fault word: frame num_frames of its request, its penalty
    history the slot's CB0 counts (`row_ops.draw_cb0_rows`)."""
    slot = batch.idx_mapping
    counts = at(table.cb0_counts, slot) if batch.cb0_penalty else None
    return draw_cb0_rows(table, batch, logits, slot, at(table.num_frames, slot), counts,
                         eos_token_id=eos_token_id, allowed=allowed)


def record_cb0(table: SlotTable, lc: DeviceLifecycle, batch: StepBatch, tokens: torch.Tensor, fault: torch.Tensor,
               eos_token_id: int | None) -> None:
    """The sample-phase stages over sampled CB0 tokens and their fault words: counters,
    intake and EOS edges, the fault column (a pure tensor function)."""
    slot, device = batch.idx_mapping, batch.idx_mapping.device
    progress, words = progress_at(table, slot), words_at(table, slot)
    state = words[WORD_STATE]
    owned = owns(progress, batch)
    live = owned & in_class(lc, state, CLASS_LIVE)
    computed = progress[PROGRESS_COMPUTED] + torch.where(live, batch.num_scheduled, const(0, torch.int64, device))
    bad = fault != const(0, fault.dtype, device)
    facts = {Predicate.PROMPT_DONE: computed >= progress[PROGRESS_PROMPT_LEN], Predicate.CB0_FAULT: bad}
    if eos_token_id is not None:  # a predicate left out of the facts reads false
        facts[Predicate.EOS_SAMPLED] = tokens == const(eos_token_id, tokens.dtype, device)
    result = run_phase(lc, Phase.SAMPLE, state, owned, facts)
    put(table.progress[PROGRESS_COMPUTED], slot, computed)
    record(table, slot, result, words, fault)  # codebook 0: the word is the kind


def mtp_sampler(table: SlotTable, batch: StepBatch):
    """The CodebookSampler handed to the model's MTP hook, plus a callable giving its per-row
    fault words once the hook has run (int32 [B]: kind | codebook << 4 of the row's lowest
    bad codebook, the first draw of it when a codebook is drawn twice; 0 = none)."""
    slot = batch.idx_mapping
    temperature, top_k, top_p = at(table.mtp_temperature, slot), at(table.mtp_top_k, slot), at(table.mtp_top_p, slot)
    seed, frame_index = at(table.seed, slot), at(table.num_frames, slot)
    key = frame_key(seed, frame_index)  # shared by the frame's Q-1 codebooks
    drawn: dict[int, tuple | None] = {}  # vocab -> noise of codebooks 1..Q-1, one tensor each
    kinds: list[tuple[int, int, torch.Tensor]] = []  # (codebook, draw number, fault kind [B])
    count = table.num_codebooks - 1

    def noise_for(codebook: int, vocab: int) -> torch.Tensor | None:
        block = drawn.get(vocab, False)
        if block is False:
            # Decided by the table's size, never the step's row count, so a step's work
            # (and its op count) does not depend on how many rows it has.
            fits = count * (table.max_slots + 1) * vocab <= BATCHED_NOISE_ELEMENTS
            block = drawn[vocab] = gumbel_noise_codebooks(key, 1, count, vocab).unbind(0) if fits else None
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
        kinds.append((int(codebook), len(kinds), kind))
        return tokens

    def fault_words() -> torch.Tensor:
        # Once per frame, not per draw: the draws stacked in codebook order (the draw number
        # keeps the first of equal codebooks first; tensors are never compared), the first
        # bad one per row picked.
        if not kinds:
            return torch.zeros(slot.shape, dtype=torch.int32, device=slot.device)
        codebooks, _, ordered = zip(*sorted(kinds))
        stacked = torch.stack(ordered)
        zero = const(0, stacked.dtype, slot.device)
        first = (stacked != zero).to(torch.uint8).argmax(dim=0)
        kind = stacked.gather(0, first[None])[0]
        shifted = _codebook_words(codebooks, slot.device).index_select(0, first)
        return torch.where(kind != zero, kind | shifted, zero)

    return sample, fault_words


@functools.lru_cache(maxsize=64)
def _codebook_words(codebooks: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int32 [n]: codebook << FAULT_CODEBOOK_SHIFT per draw, made once per draw order (no
    per-step host-to-device copy)."""
    return torch.tensor([c << FAULT_CODEBOOK_SHIFT for c in codebooks], dtype=torch.int32, device=device)


def mtp_scatter(
    table: SlotTable, lc: DeviceLifecycle, batch: StepBatch, mtp_faults: torch.Tensor, mtp_stop: torch.Tensor | None = None,
    last: bool = False,
) -> None:
    """Stage 5: the MTP-phase stages (frame complete, an error on a bad MTP sample, or the
    stop an MtpResult decided). mtp_faults: the fault words of `mtp_sampler` (int32 [B],
    0 = ok); mtp_stop: bool [B] from an MtpResult, None when the hook returned codes only;
    last: the step's final stage (speculative: the drafter), which flags rows left in-step."""
    slot, device = batch.idx_mapping, batch.idx_mapping.device
    owned = owned_rows(table, batch)
    facts = {Predicate.MTP_FAULT: mtp_faults != const(0, mtp_faults.dtype, device)}
    if mtp_stop is not None:  # a predicate left out of the facts reads false
        facts[Predicate.MTP_STOP] = mtp_stop.to(torch.bool)
    words = words_at(table, slot)
    result = run_phase(lc, Phase.MTP, words[WORD_STATE], owned, facts, last=last)
    record(table, slot, result, words, mtp_faults)


def delay_facts(frame_index: torch.Tensor, codes: torch.Tensor, previous: torch.Tensor, eoc: int | None) -> dict:
    """RAMP_DONE, EOC_FRAME and WIND_DONE of the frames rows publish after `previous` (each
    row's last published frame; none without a delay pattern)."""
    if eoc is None:
        return {}
    is_eoc, q = codes == eoc, codes.shape[1]
    winding = (previous[:, 0] == eoc) & (frame_index > 0) if q > 1 else torch.ones_like(is_eoc[:, 0])
    return {Predicate.RAMP_DONE: frame_index >= q - 2, Predicate.EOC_FRAME: is_eoc[:, 0],
            Predicate.WIND_DONE: is_eoc[:, 0] & winding & is_eoc[:, : q - 1].all(dim=1)}


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
    slot, device = batch.idx_mapping, batch.idx_mapping.device
    progress = progress_at(table, slot)
    owned = owns(progress, batch)
    frame_index = progress[PROGRESS_FRAMES]
    computed, max_frames = progress[PROGRESS_COMPUTED], progress[PROGRESS_MAX_FRAMES]
    last_codes = at(table.frame_codes, slot)
    frame_facts = delay_facts(frame_index, codes, last_codes, eoc)
    if eos is not None:
        frame_facts[Predicate.EOS_FRAME] = codes[:, 0] == const(eos, codes.dtype, device)
    if accepted is not None:
        frame_facts[Predicate.DRAFT_ACCEPTED] = accepted

    full = computed >= const(table.max_context, torch.int64, device)
    left = max_frames - frame_index  # frames this request may still publish
    facts = {Predicate.LENGTH_REACHED: (left <= const(0, torch.int64, device)) | full, **frame_facts}
    # A stage after a publishing one sees the frame counted.
    after = {Predicate.LENGTH_REACHED: (left <= const(1, torch.int64, device)) | full}
    # last: whatever the stages did, no row may rest in a state that exists only inside a step.
    words = words_at(table, slot)
    result = run_phase(lc, Phase.PUBLISH, words[WORD_STATE], owned, facts, after, last=last)
    count = result.published  # int32 0 / 1
    num_frames = frame_index + count
    ready = count != const(0, torch.int32, device)
    ready_rows = ready[:, None]
    put(table.frame_codes, slot, torch.where(ready_rows, codes, last_codes))
    log_at = frame_index.clamp(max=table.max_context - 1)
    table.frame_log[slot, log_at] = torch.where(ready_rows, codes, table.frame_log[slot, log_at])
    put(table.frame_embed, slot, torch.where(ready_rows, frame_embeds.to(table.frame_embed.dtype),
                                             at(table.frame_embed, slot)))
    # The repetition penalty's memory: one more occurrence of each published CB0 id.
    cb0 = codes[:, 0].clamp(0, table.cb0_counts.shape[1] - 1)
    table.cb0_counts.index_put_((slot, cb0), count, accumulate=True)  # both int32
    put(table.progress[PROGRESS_FRAMES], slot, num_frames)
    reason, error = record(table, slot, result, words)
    # One int64 row per request (stack promotes the columns): the layout of contract.OUT_*.
    columns = torch.stack([count, frame_index, error, result.state, reason, num_frames, computed], dim=1)
    return torch.cat([columns, torch.where(ready_rows, codes, const(0, codes.dtype, device))], dim=1)
