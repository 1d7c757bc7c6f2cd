"""The compiled lifecycle's tables on one device: the rules' layout, and each phase's stage chains
folded over (state, ownership, predicate word) so an executor moves a row with one gather."""

from __future__ import annotations

import attrs
import torch

from .phase_fold import PHASE_WORDS, fold_phase, phase_weights
from .predicates import Phase, Predicate

ILLEGAL = -1
# Planes of the rules tensor [plane, trigger, state].
RULE_DEST, RULE_MUST, RULE_MUST_NOT, RULE_REASON, RULE_PUBLISHES = range(5)
# Bits of the state-class word per state.
CLASS_LIVE, CLASS_TERMINAL, CLASS_IN_STEP, CLASS_VACANT = 1, 2, 4, 8


# The sticky error bit of a row no stage could move (re-exported by `slots` beside the other bits).
ERR_ILLEGAL = 2
# Rows of a phase's packed outcome table (`DeviceLifecycle.phase_rows`).
ROW_DEST, ROW_REASON, ROW_PUBLISHED, ROW_ILLEGAL = range(4)

# A stage's outcome for (state, predicate word), packed in one int32 (see `stage_outcomes`).
OUTCOME_FIRED, OUTCOME_PUBLISHES, OUTCOME_REASON_SHIFT = 1 << 8, 1 << 9, 10
WORDS = 1 << len(Predicate)  # every value of the predicate word


@attrs.frozen
class DeviceLifecycle:
    """The compiled tables on one device, plus host copies of the stage chains (static:
    which triggers a stage tries is known on the host, the guards are evaluated on device),
    and each stage's chain folded into an outcome table over (state, predicate word)."""

    rules: torch.Tensor  # int32 [5, num_triggers, num_states]
    state_class: torch.Tensor  # int32 [num_states], CLASS_* bits
    chains: dict[Phase, torch.Tensor]  # int32 [stages, 1 + longest]: total flag, triggers (-1 pad)
    host_chains: dict[Phase, tuple[tuple[bool, tuple[int, ...]], ...]]
    outcomes: dict[Phase, tuple[torch.Tensor, ...]] = attrs.field(init=False)
    # (phase, ends the step) -> the whole phase folded (`phase_fold`): (dest, reason, published,
    # stuck), one lookup each per phase.
    phase_tables: dict[tuple[Phase, bool], tuple[torch.Tensor, ...]] = attrs.field(init=False)
    # The same, packed for one gather per phase: int32 [4, states, PHASE_WORDS] (indexed by a
    # row's state and predicate word), planes ROW_*: destination, reason, published (0 / 1)
    # and the error bits a stuck row sets (ERR_ILLEGAL / 0).
    phase_rows: dict[tuple[Phase, bool], torch.Tensor] = attrs.field(init=False)
    # CLASS_* bit -> bool [num_states]: whether each state is in that class (one gather per test).
    class_masks: dict[int, torch.Tensor] = attrs.field(init=False)
    # (predicates, after) -> the index weights of a phase's columns (`phase_fold.phase_weights`),
    # built on first lookup: a hit is a plain dict read, no Python call (three a step).
    weights: dict = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        rules, device = self.rules.cpu(), self.rules.device
        host = {phase: tuple(stage_outcomes(rules, triggers) for _, triggers in chain)
                for phase, chain in self.host_chains.items()}
        in_step = (self.state_class.cpu() & CLASS_IN_STEP) != 0
        tables = {}
        for phase, stages in host.items():
            totals = [total for total, _ in self.host_chains[phase]]
            for last in (False, True):
                folded = fold_phase(self.num_states, stages, totals, WORDS, OUTCOME_FIRED, OUTCOME_PUBLISHES, OUTCOME_REASON_SHIFT,
                                    in_step if last else None)
                tables[phase, last] = tuple(t.to(device) for t in folded)
        object.__setattr__(self, "outcomes", {phase: tuple(t.to(device) for t in ts) for phase, ts in host.items()})
        object.__setattr__(self, "phase_tables", tables)
        object.__setattr__(self, "phase_rows", {key: torch.stack([
            dest, reason, published.to(torch.int32), stuck.to(torch.int32) * ERR_ILLEGAL]).view(4, self.num_states, PHASE_WORDS)
            for key, (dest, reason, published, stuck) in tables.items()})
        masks = {bit: (self.state_class & bit) != 0 for bit in (CLASS_LIVE, CLASS_TERMINAL, CLASS_IN_STEP, CLASS_VACANT)}
        object.__setattr__(self, "class_masks", masks)
        object.__setattr__(self, "weights", _WeightsByLayout(device))

    @property
    def num_states(self) -> int:
        return int(self.rules.shape[2])

    def has_stages(self, phase: Phase) -> bool:
        return bool(self.host_chains[phase])


def stage_outcomes(rules: torch.Tensor, triggers: tuple[int, ...]) -> torch.Tensor:
    """One stage's chain evaluated for every (state, predicate word): int32 [states * WORDS],
    entry = destination | OUTCOME_FIRED | OUTCOME_PUBLISHES | reason << OUTCOME_REASON_SHIFT
    (the destination is the state itself when nothing fires). Same semantics as a kernel
    walking the chain: each trigger is tried at the state the row had when the stage began,
    a later firing one overrides an earlier one (a compiled spec proves at most one fires)."""
    rules = rules.to(torch.int64)
    num_states = rules.shape[2]
    # Every (state, word) at once: [states, WORDS], the chain walked trigger by trigger.
    word = torch.arange(WORDS, dtype=torch.int64)[None, :]
    dest = torch.arange(num_states, dtype=torch.int64)[:, None].expand(num_states, WORDS).clone()
    reason, fired = torch.zeros_like(dest), torch.zeros_like(dest, dtype=torch.bool)
    publishes = torch.zeros_like(fired)
    for t in triggers:
        to, must, must_not = (rules[plane, t][:, None] for plane in (RULE_DEST, RULE_MUST, RULE_MUST_NOT))
        fires = (to >= 0) & ((word & must) == must) & ((word & must_not) == 0)
        dest = torch.where(fires, to, dest)
        fired = fired | fires
        edge_reason = rules[RULE_REASON, t][:, None]
        reason = torch.where(fires & (edge_reason != 0), edge_reason, reason)
        publishes = publishes | (fires & (rules[RULE_PUBLISHES, t][:, None] != 0))
    packed = dest | fired.long() * OUTCOME_FIRED | publishes.long() * OUTCOME_PUBLISHES
    return (packed | (reason << OUTCOME_REASON_SHIFT)).reshape(-1).to(torch.int32)


class _WeightsByLayout(dict):
    """(predicates, after) -> phase_weights(predicates, after) on one device, built when first read."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __missing__(self, key: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        value = self[key] = phase_weights(*key, self.device)
        return value
