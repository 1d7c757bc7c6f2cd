"""A whole phase's stage chains folded into one outcome table, so a step evaluates a phase with one gather."""

from __future__ import annotations

import torch

from .predicates import Predicate

# The phase word: the predicate word (bit = Predicate value), then whether the row owns its
# slot, then the publish-sensitive predicates' values once a stage of the phase has
# published (a publishing edge counts its frame before the next stage reads them).
PUBLISH_SENSITIVE = (Predicate.LENGTH_REACHED,)
OWNED_BIT = len(Predicate)
AFTER_PUBLISH_SHIFT = OWNED_BIT + 1
PHASE_WORDS = 1 << (AFTER_PUBLISH_SHIFT + len(PUBLISH_SENSITIVE))


def fold_phase(num_states: int, stage_tables, totals, words: int, fired_bit: int, publishes_bit: int,
               reason_shift: int, in_step: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The phase's stages run in order from each state, for each phase word, as four tables
    indexed by state * PHASE_WORDS + word: destination (int32), finish reason (int32),
    published (bool), stuck (bool); one lookup each, no bit decoding at run time.

    stage_tables: each stage's outcome table [states * words] (`compiled.stage_outcomes`);
    totals: whether each stage is total (a row it moves nothing is stuck); in_step: bool
    [states] when the phase ends the step (a row resting in an in-step state is stuck), else None.
    The same semantics as walking the stages one by one: a later stage sees the state, and
    the publish-sensitive predicates, that the earlier ones left; a later reason overrides."""
    word = torch.arange(PHASE_WORDS, dtype=torch.int64)[None, :]
    predicates = word & (words - 1)
    owned = ((word >> OWNED_BIT) & 1) != 0
    after = predicates
    for i, p in enumerate(PUBLISH_SENSITIVE):  # the word a stage reads once the row has published
        value = (word >> (AFTER_PUBLISH_SHIFT + i)) & 1
        after = (after & ~(1 << int(p))) | (value << int(p))
    state = torch.arange(num_states, dtype=torch.int64)[:, None].expand(num_states, PHASE_WORDS).clone()
    reason = torch.zeros_like(state)
    published = torch.zeros_like(state, dtype=torch.bool)
    stuck = torch.zeros_like(published)
    for table, total in zip(stage_tables, totals):
        read = torch.where(published, after, predicates)
        outcome = table.to(torch.int64)[state * words + read]
        fired = owned & ((outcome & fired_bit) != 0)
        why = outcome >> reason_shift
        reason = torch.where(fired & (why != 0), why, reason)
        published = published | (fired & ((outcome & publishes_bit) != 0))
        if total:
            stuck = stuck | (owned & ~fired)
        state = torch.where(fired, outcome & 0xFF, state)
    if in_step is not None:
        stuck = stuck | (owned & in_step.to(torch.bool)[state])
    return (state.reshape(-1).to(torch.int32), reason.reshape(-1).to(torch.int32), published.reshape(-1),
            stuck.reshape(-1))


def phase_weights(predicates: tuple[Predicate, ...], after: tuple[Predicate, ...], device):
    """(int64 [1 + len(predicates) + len(after)], 0-dim int32): the weights of the columns
    [owned, *predicates, *after-publish values] and of the state in the flat index into a
    phase table (state * PHASE_WORDS stays far below 2**31)."""
    weights = [1 << OWNED_BIT, *(1 << int(p) for p in predicates),
               *(1 << (AFTER_PUBLISH_SHIFT + PUBLISH_SENSITIVE.index(p)) for p in after)]
    return (torch.tensor(weights, dtype=torch.int64, device=device),
            torch.tensor(PHASE_WORDS, dtype=torch.int32, device=device))
