"""A plan's rows checked against the request table when they are not the steady decode batch:
rows of requests holding a slot vectorised, the rest (and any row that fails) one span at a
time, naming the request and what is wrong. Nothing changes in the ledger."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import PlanError
from ..lifecycle import State, Trigger
from .plan import Span

if TYPE_CHECKING:
    from .ledger import Ledger


def check_rows(ledger: "Ledger", rows: tuple[Span | None, ...], gone: set[str], resuming: set[str],
               prepared: dict) -> bool:
    """Rows of requests that already hold a slot are checked vectorised against the request
    table; anything else, or any row that fails, goes through `check_span`. Raises PlanError
    at the first bad row; else returns whether the rows are steady: every row decodes or
    overruns and the plan has no host event."""
    steady = False
    spans = [s for s in rows if s is not None]
    special = gone | resuming | prepared.keys()
    records = [ledger.records.get(s.request_id) for s in spans]
    simple = [
        i for i, (s, r) in enumerate(zip(spans, records))
        if r is not None and r.slot is not None and s.request_id not in special and type(s.num_tokens) is int
    ]
    bad: set[int] = set(range(len(spans))) - set(simple)
    if simple:
        slots = np.fromiter((records[i].slot for i in simple), np.int64, len(simple))
        tokens = np.fromiter((spans[i].num_tokens for i in simple), np.int64, len(simple))
        remaining = ledger.rows.prompt_len[slots] - ledger.rows.num_computed[slots]
        state = ledger.rows.state[slots]
        live, terminal = ledger._is_live[state], ledger._is_terminal[state]
        wrong = (tokens < 1) | (~live & ~terminal)
        wrong |= live & np.where(remaining > 0, tokens > remaining, tokens != ledger.decode_width)
        wrong |= terminal & (tokens != 1)
        bad.update(simple[i] for i in np.flatnonzero(wrong))
        if len(np.unique(slots)) != len(slots):
            bad.update(simple)  # a request in two rows: let the slow path name it
        steady = not bad and not special and bool((remaining <= 0).all())
    seen: set[str] = set()
    for i, span in enumerate(spans):
        if i in bad:
            check_span(ledger, span, gone, resuming, seen, prepared)
        elif span.request_id in seen:
            raise PlanError(span.request_id, None, "scheduled in two rows of one step")
        else:
            seen.add(span.request_id)
    return steady


def check_span(ledger: "Ledger", span: Span, gone: set[str], resuming: set[str], seen: set[str],
               prepared: dict) -> None:
    """One row, from its request's record (or the plan's own admission or resume): PlanError
    naming the request, its state and what is wrong."""
    rid = span.request_id
    record = ledger.records.get(rid)
    if rid in seen:
        raise PlanError(rid, None, "scheduled in two rows of one step")
    seen.add(rid)
    if rid in prepared:  # admitted by this very plan
        state, remaining = ledger._admitted_state, int(prepared[rid].prompt_embeds.shape[0])
    elif record is None:
        raise PlanError(rid, None, "scheduled but not in the engine (never admitted, or already released or aborted)")
    elif rid in gone or (record.slot is None and rid not in resuming):
        raise PlanError(rid, record.state.label, "scheduled but it holds no slot in this step")
    else:
        state = State(ledger._dest[Trigger.RESUME, record.state]) if rid in resuming else record.state
        remaining = (ledger.resume_prompt_len(record) if rid in resuming
                     else record.prompt_len - record.num_computed)
    if type(span.num_tokens) is not int or span.num_tokens < 1:
        raise PlanError(rid, state.label, f"a span needs >= 1 token, got {span.num_tokens!r}")
    decode_width = ledger.decode_width
    if state in ledger.live_states:
        if remaining > 0 and span.num_tokens > remaining:
            raise PlanError(rid, state.label, f"span of {span.num_tokens} tokens exceeds the {remaining} prompt tokens left")
        if remaining <= 0 and span.num_tokens != decode_width:
            what = "1 token" if decode_width == 1 else f"{decode_width} tokens (its last and the drafts)"
            raise PlanError(rid, state.label, f"a decode row takes exactly {what}, got {span.num_tokens}")
    elif state in ledger.terminal_states:  # a legal overrun (async scheduling): one token, like decode
        if span.num_tokens != 1:
            raise PlanError(rid, state.label, f"an overrun row of an ended request takes exactly 1 token, "
                            f"got {span.num_tokens}")
    elif state is State.STARVED:
        raise PlanError(rid, state.label, f"waits for conditioning row {max(record.num_frames - 1, 0)} "
                        "(engine.feed); it cannot be scheduled until it arrives")
    else:
        raise PlanError(rid, state.label, "cannot be scheduled in this state")
