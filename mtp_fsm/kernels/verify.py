"""Verify positions as rows (speculative decoding), torch reference: one draw over every decode row's k + 1 positions, then the verify loop's stages over all positions at once.

A verify row holds its newest token and k drafts. Position j samples frame num_frames + j as
plain decoding would, with the penalty counts and min_frames of the frames published before
it; on the only path where position j counts (every earlier draft accepted) those frames are
the drafts 0..j-1, so every position's facts are known before any is evaluated. The loop's
stages then run for every position and every state in one table lookup per phase, and each
row's path through its positions is a chain of gathers; a row leaves the loop at the first
position that does not publish or leaves it outside the live states (`bonus`, an end).
The Triton kernels (triton_verify.py) walk the positions one by one instead: two
independent implementations of one semantics, tested bit-exact, and both against the
per-position loop they replace (tests/kernels/test_verify_rows.py).
"""

from __future__ import annotations

import torch

from ..lifecycle import CLASS_LIVE, DeviceLifecycle, Phase, Predicate
from ..slots import ERR_ILLEGAL, SlotTable
from .contract import OUT_CODES, StepBatch
from .row_ops import at, const, draw_cb0_rows, in_class, owned_rows, put

# Bits of a position's packed outcome (destination state in the low byte).
_PUBLISHED, _STUCK, _SAMPLE_ENDED, _REASON_SHIFT = 8, 9, 10, 11


def first_widths(batch: StepBatch, verify: torch.Tensor) -> torch.Tensor:
    """Tokens each row's position 0 accounts for: 1 for a verify row (its newest token), the
    whole span for any other row (a prefill row samples once, at its last token)."""
    return torch.where(verify, const(1, torch.int64, verify.device), batch.num_scheduled)


def position_counts(table: SlotTable, slot: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """CB0 counts [B * (k + 1), V] of each position: the row's published ids plus drafts 0..j-1
    (what the row will have published when position j samples, if it gets there)."""
    rows, k = drafts.shape
    positions = k + 1
    counts = at(table.cb0_counts, slot)
    vocab = counts.shape[1]
    out = counts[:, None, :].expand(rows, positions, vocab).reshape(rows * positions, vocab).clone()
    if k and rows:
        device = slot.device
        j = torch.arange(positions, device=device)
        before = (torch.arange(k, device=device)[None, :] < j[:, None]).to(out.dtype)  # [P, k]: draft i before j
        at_row = (torch.arange(rows, device=device)[:, None] * positions + j[None, :])[:, :, None].expand(rows, positions, k)
        ids = drafts.clamp(0, vocab - 1)[:, None, :].expand(rows, positions, k)
        out.index_put_((at_row.reshape(-1), ids.reshape(-1)), before[None].expand(rows, positions, k).reshape(-1),
                       accumulate=True)
    return out


def sample_positions(table: SlotTable, batch: StepBatch, verify: torch.Tensor, logits: torch.Tensor,
                     drafts: torch.Tensor, *, eos_token_id: int | None,
                     allowed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every position's CB0 token and fault word in one `sample_tokens` call: logits
    [B * (k + 1), V] row-major (row b's positions in order), drafts int64 [B, k].
    Returns (tokens int64 [B, k + 1], faults int32 [B, k + 1]); writes nothing."""
    rows, positions = batch.num_rows, drafts.shape[1] + 1
    slot = batch.idx_mapping
    slots = slot[:, None].expand(rows, positions).reshape(-1)
    j = torch.arange(positions, device=slot.device)
    frame_index = (at(table.num_frames, slot)[:, None] + j[None, :]).reshape(-1)
    counts = position_counts(table, slot, drafts) if batch.cb0_penalty else None
    tokens, fault = draw_cb0_rows(table, batch, logits, slots, frame_index, counts, eos_token_id=eos_token_id,
                                  allowed=allowed)
    return tokens.view(rows, positions), fault.view(rows, positions)


def _phase_word(lc: DeviceLifecycle, owned: torch.Tensor, facts: dict, after: dict):
    """Each position's index into a phase table before the state is added, and the state's weight."""
    weights, state_weight = lc.weights[tuple(facts), tuple(after)]
    masks = torch.stack([owned, *facts.values(), *after.values()], dim=-1)
    return (masks * weights).sum(dim=-1), state_weight.to(torch.int64)


def verify_frames(table: SlotTable, lc: DeviceLifecycle, batch: StepBatch, verify: torch.Tensor,
                  tokens: torch.Tensor, faults: torch.Tensor, drafts: torch.Tensor, frame_embeds: torch.Tensor,
                  *, eos_token_id: int | None) -> torch.Tensor:
    """The verify loop's sample and publish stages over every position (`sample_positions`'
    tokens and faults), the table's counters, frame log / cache / embedding and penalty
    counts for the positions that publish. frame_embeds: [B * (k + 1), H], each position's
    token embedded. Returns the packed output [B * (k + 1), OUT_CODES + 1]: each position's
    frame (if published) and the row's columns after the loop. Rows resting in an in-step
    state are not flagged (the drafter's stage, the step's last, checks them)."""
    rows, positions = tokens.shape
    slot, device = batch.idx_mapping, batch.idx_mapping.device
    owned = owned_rows(table, batch)
    state0 = at(table.state, slot)
    live0 = owned & in_class(lc, state0, CLASS_LIVE)
    j = torch.arange(positions, device=device)
    # num_computed once position j has sampled, on the path where it is reached.
    base = at(table.num_computed, slot) + torch.where(live0, first_widths(batch, verify), const(0, torch.int64, device))
    computed = base[:, None] + j[None, :]
    first = at(table.num_frames, slot)
    frame_index = first[:, None] + j[None, :]
    left = at(table.max_frames, slot)[:, None] - frame_index
    full = computed >= const(table.max_context, torch.int64, device)
    accepted = torch.zeros_like(tokens, dtype=torch.bool)
    if positions > 1:
        accepted[:, :-1] = verify[:, None] & (tokens[:, :-1] == drafts)
    owned_at = owned[:, None].expand(rows, positions)
    sample_facts = {Predicate.PROMPT_DONE: computed >= at(table.prompt_len, slot)[:, None], Predicate.CB0_FAULT: faults != 0}
    if eos_token_id is not None:  # a predicate left out of the facts reads false
        sample_facts[Predicate.EOS_SAMPLED] = tokens == eos_token_id
    sample_word, weight = _phase_word(lc, owned_at, sample_facts, {})
    publish_word, _ = _phase_word(lc, owned_at, {Predicate.LENGTH_REACHED: (left <= 0) | full,
                                                 Predicate.DRAFT_ACCEPTED: accepted},
                                  {Predicate.LENGTH_REACHED: (left <= 1) | full})
    # Both phases from every state at every position: [B, P, S] outcomes, one lookup per table.
    states = torch.arange(lc.num_states, device=device) * weight
    dest1, reason1, _, stuck1 = (t.index_select(0, (sample_word[..., None] + states).reshape(-1)).view(rows, positions, -1)
                                 for t in lc.phase_tables[Phase.SAMPLE, False])
    at_publish = (publish_word[..., None] + dest1.to(torch.int64) * weight).reshape(-1)
    dest2, reason2, published2, stuck2 = (t.index_select(0, at_publish).view(rows, positions, -1)
                                          for t in lc.phase_tables[Phase.PUBLISH, False])
    outcome = (dest2.to(torch.int64) | (published2.to(torch.int64) << _PUBLISHED)
               | ((stuck1 | stuck2).to(torch.int64) << _STUCK) | ((reason1 != 0).to(torch.int64) << _SAMPLE_ENDED)
               | (torch.where(reason2 != 0, reason2, reason1).to(torch.int64) << _REASON_SHIFT))
    # Each row's path: position j starts where position j - 1 left it.
    state, picked = state0.to(torch.int64), []
    for p in range(positions):
        picked.append(outcome[:, p].gather(1, state[:, None])[:, 0])
        state = picked[-1] & 0xFF
    picked = torch.stack(picked, dim=1)
    dest = picked & 0xFF
    published = ((picked >> _PUBLISHED) & 1) != 0
    # A row goes on to the next position while it published and stayed live (`accept`).
    going = published & in_class(lc, dest.reshape(-1), CLASS_LIVE).view(rows, positions) & verify[:, None]
    entered = torch.cat([torch.ones_like(going[:, :1]), going[:, :-1].to(torch.int64).cumprod(dim=1) != 0], dim=1)
    last = (entered.sum(dim=1) - 1)[:, None]
    published = published & entered
    count = published.sum(dim=1)
    final = picked.gather(1, last)[:, 0]
    reason = final >> _REASON_SHIFT
    stuck = (entered & (((picked >> _STUCK) & 1) != 0)).any(dim=1)
    put(table.state, slot, final & 0xFF)
    old_reason = at(table.finish_reason, slot)
    put(table.finish_reason, slot, torch.where(reason != 0, reason, old_reason))
    zero = const(0, torch.int32, device)
    put(table.error, slot, at(table.error, slot) | torch.where(stuck, const(ERR_ILLEGAL, torch.int32, device), zero))
    # The sample stage ended the row on a bad sample: its first fault word (record's rule).
    old_fault = at(table.fault, slot)
    ended = ((final >> _SAMPLE_ENDED) & 1) != 0
    put(table.fault, slot, torch.where(ended & (old_fault == 0), faults.gather(1, last)[:, 0].to(old_fault.dtype), old_fault))
    put(table.num_computed, slot, base + last[:, 0])
    put(table.num_frames, slot, first + count)
    newest = (count - 1).clamp(min=0)[:, None]
    any_frame = (count > 0)[:, None]
    put(table.frame_codes, slot, torch.where(any_frame, tokens.gather(1, newest), at(table.frame_codes, slot)))
    embeds = frame_embeds.view(rows, positions, -1)[torch.arange(rows, device=device), newest[:, 0]]
    put(table.frame_embed, slot, torch.where(any_frame, embeds.to(table.frame_embed.dtype), at(table.frame_embed, slot)))
    # Published positions write their frame; the others write the scratch row (never read).
    log_slot = torch.where(published, slot[:, None], const(table.max_slots, torch.int64, device))
    table.frame_log[log_slot, frame_index.clamp(max=table.max_context - 1)] = tokens[..., None].to(table.frame_log.dtype)
    cb0 = tokens.clamp(0, table.cb0_counts.shape[1] - 1)
    table.cb0_counts.index_put_((slot[:, None].expand(rows, positions), cb0), published.to(table.cb0_counts.dtype),
                                accumulate=True)
    # The packed rows: each position's frame, and the row's columns after the loop.
    per_row = [at(table.error, slot), final & 0xFF, torch.where(reason != 0, reason, old_reason), first + count,
               base + last[:, 0]]  # the layout of contract.OUT_ERROR .. OUT_NUM_COMPUTED
    per_row = [c.to(torch.int64)[:, None].expand(rows, positions) for c in per_row]
    codes = torch.where(published, tokens, torch.zeros_like(tokens))
    packed = torch.stack([published.to(torch.int64), frame_index, *per_row, codes], dim=-1)
    return packed.reshape(rows * positions, OUT_CODES + 1)
