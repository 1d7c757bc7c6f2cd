"""The steady decode batch: a plan whose rows equal the last validated one (same requests,
same slots, every row decoding or an overrun) is checked and staged without a Python loop
over its rows."""

from __future__ import annotations

import attrs
import numpy as np


@attrs.define
class SteadyRows:
    """What validating and staging `rows` produced, reused while `generation` (bumped by
    every admission, release, abort, preemption, resume and failed step) is unchanged: then
    the same request ids hold the same records and slots, and a decode row stays one."""

    rows: tuple
    generation: int
    slots: np.ndarray  # int64 [B], the rows' slots (scratch for padding)
    tokens: np.ndarray  # int64 [B], tokens per row (0 for padding)
    real: np.ndarray  # bool [B], not padding
    staged: tuple | None = None  # (records, counts, batch, slots_np, query_start_loc, row_ids, row_ids_np)

    def matches(self, rows: tuple, generation: int) -> bool:
        return generation == self.generation and rows == self.rows

    def states_ok(self, slot_state: np.ndarray, is_live: np.ndarray, is_terminal: np.ndarray,
                  decode_width: int) -> bool:
        """Every real row is live with a decode row's width, or ended with one overrun token."""
        state = slot_state[self.slots[self.real]]
        tokens = self.tokens[self.real]
        live, terminal = is_live[state], is_terminal[state]
        return bool(np.all(np.where(live, tokens == decode_width, terminal & (tokens == 1))))
