"""A plan's rows checked against the request table before anything changes (vectorised; the
steady decode batch, the rows the step inputs hold as loaded, on arrays alone), with a
message naming the request, its state and what is wrong when a row fails."""

from __future__ import annotations

import numpy as np

from ..errors import PlanError
from ..lifecycle import State, Trigger
from .plan import Span


class RowChecks:
    """The Ledger's row validation (a mixin: it reads the ledger's records, request table and
    step inputs, and changes nothing but `_rows_steady`). The plan's host events are checked
    first (`host_events.HostEvents.validate`); `gone`, `resuming` and `prepared` say what they
    will do to the rows' requests."""

    def _validate_rows(self, rows: tuple[Span | None, ...], gone: set[str], resuming: set[str],
                       prepared: dict) -> None:
        """Rows of requests that already hold a slot are checked vectorised against the
        request table; anything else, or any row that fails, goes through the per-span check,
        which names the request and what is wrong. The steady decode batch (the rows the step
        inputs hold as loaded, in the same generation) is checked on arrays alone.
        Sets `_rows_steady`: every row decodes or overruns and the plan has no host event."""
        special = gone or resuming or prepared
        held = None if special else self.inputs.holds(rows, self.generation)
        if held is not None and self._states_ok(held.slots_np, held.tokens_np):
            self._rows_steady = True
            return
        self._rows_steady = False
        spans = [s for s in rows if s is not None]
        special = gone | resuming | prepared.keys()
        records = [self.records.get(s.request_id) for s in spans]
        simple = [
            i for i, (s, r) in enumerate(zip(spans, records))
            if r is not None and r.slot is not None and s.request_id not in special and type(s.num_tokens) is int
        ]
        bad: set[int] = set(range(len(spans))) - set(simple)
        if simple:
            slots = np.fromiter((records[i].slot for i in simple), np.int64, len(simple))
            tokens = np.fromiter((spans[i].num_tokens for i in simple), np.int64, len(simple))
            remaining = self.rows.prompt_len[slots] - self.rows.num_computed[slots]
            state = self.rows.state[slots]
            live, terminal = self._is_live[state], self._is_terminal[state]
            wrong = (tokens < 1) | (~live & ~terminal)
            wrong |= live & np.where(remaining > 0, tokens > remaining, tokens != self.decode_width)
            wrong |= terminal & (tokens != 1)
            bad.update(simple[i] for i in np.flatnonzero(wrong))
            if len(np.unique(slots)) != len(slots):
                bad.update(simple)  # a request in two rows: let the slow path name it
            self._rows_steady = not bad and not special and bool((remaining <= 0).all())
        seen: set[str] = set()
        for i, span in enumerate(spans):
            if i in bad:
                self._validate_span(span, gone, resuming, seen, prepared)
            elif span.request_id in seen:
                raise PlanError(span.request_id, None, "scheduled in two rows of one step")
            else:
                seen.add(span.request_id)

    def _states_ok(self, slots: np.ndarray, tokens: np.ndarray) -> bool:
        """Every real row (tokens > 0) is live with a decode row's width, or ended with one overrun token."""
        real = tokens > 0
        state = self.rows.state[slots[real]]
        live, terminal = self._is_live[state], self._is_terminal[state]
        return bool(np.all(np.where(live, tokens[real] == self.decode_width, terminal & (tokens[real] == 1))))

    def _validate_span(self, span: Span, gone: set[str], resuming: set[str], seen: set[str],
                       prepared: dict) -> None:
        rid = span.request_id
        record = self.records.get(rid)
        if rid in seen:
            raise PlanError(rid, None, "scheduled in two rows of one step")
        seen.add(rid)
        if rid in prepared:  # admitted by this very plan
            state, remaining = self._admitted_state, int(prepared[rid].prompt_embeds.shape[0])
        elif record is None:
            raise PlanError(rid, None, "scheduled but not in the engine (never admitted, or already released or aborted)")
        elif rid in gone or (record.slot is None and rid not in resuming):
            raise PlanError(rid, record.state.label, "scheduled but it holds no slot in this step")
        else:
            state = State(self._dest[Trigger.RESUME, record.state]) if rid in resuming else record.state
            remaining = self.resume_prompt_len(record) if rid in resuming else record.prompt_len - record.num_computed
        if type(span.num_tokens) is not int or span.num_tokens < 1:
            raise PlanError(rid, state.label, f"a span needs >= 1 token, got {span.num_tokens!r}")
        if state in self.live_states:
            if remaining > 0 and span.num_tokens > remaining:
                raise PlanError(rid, state.label, f"span of {span.num_tokens} tokens exceeds the {remaining} prompt tokens left")
            if remaining <= 0 and span.num_tokens != self.decode_width:
                what = "1 token" if self.decode_width == 1 else f"{self.decode_width} tokens (its last and the drafts)"
                raise PlanError(rid, state.label, f"a decode row takes exactly {what}, got {span.num_tokens}")
        elif state in self.terminal_states:  # a legal overrun (async scheduling): one token, like decode
            if span.num_tokens != 1:
                raise PlanError(rid, state.label, f"an overrun row of an ended request takes exactly 1 token, "
                                f"got {span.num_tokens}")
        elif state is State.STARVED:
            raise PlanError(rid, state.label, f"waits for conditioning row {max(record.num_frames - 1, 0)} "
                            "(engine.feed); it cannot be scheduled until it arrives")
        else:
            raise PlanError(rid, state.label, "cannot be scheduled in this state")
