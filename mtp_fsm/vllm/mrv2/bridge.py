"""MRV2Bridge: vLLM MRV2's add/remove events and batch rows -> one LockstepEngine StepPlan per step, CB0 back."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

import attrs

from ...engine import LockstepEngine
from ...engine.plan import FinishedRequest, NewRequest, Span, StepOutput, StepPlan
from ...errors import AdmissionError
from ...lifecycle import CLASS_TERMINAL, FinishReason, State
from ..frame_store import FrameStore
from ..schedule_mapping import engine_state


class MRV2EventError(RuntimeError):
    """vLLM's hook calls for a request make no sense for its engine state (names both)."""

    def __init__(self, request_id: str, state: str | None, what: str) -> None:
        super().__init__(f"request {request_id!r} (engine state {state or 'unknown'}): {what}")
        self.request_id, self.state = request_id, state


@attrs.frozen
class Row:
    """One MRV2 batch row: the request, its scheduled tokens, and whether vLLM samples a
    token for it (its prompt is complete after this step: vLLM's `num_sampled` rule)."""

    request_id: str
    num_tokens: int
    samples: bool


@attrs.frozen
class StepResult:
    """The engine's answer to one MRV2 batch, in batch-row order."""

    tokens: tuple[int, ...]  # CB0 of the published frame, the stop id, or 0 (a row vLLM does not sample)
    outputs: tuple[StepOutput, ...]  # the engine steps run (a boundary-only step may precede the row step)


class MRV2Bridge:
    """Turns MRV2's per-request events into the engine's boundary events, and its batch into rows.

    MRV2 calls `remove_request` for finished *and* preempted ids without saying which, and
    for every id it is about to add (a streaming-input re-add guard). The rules:

    - remove of an unknown id: nothing (the guard before a first add);
    - remove of a request the engine has ended (eos, length, error): release;
    - remove of a live request: preempt, and the request is *parked* (its published frames
      are what a resume replays);
    - add of a parked id: resume. vLLM re-prefills prompt + outputs, and must send exactly
      the engine's resume prompt (P + frames published), else MRV2EventError;
    - remove of a parked id not followed by its re-add before the step runs: vLLM ended it
      while it waited (e.g. a client abort): abort;
    - a live request vLLM aborts looks like a preemption and is parked; it is never re-added,
      so parked requests are aborted oldest first beyond `max_parked`, and after
      `max_park_steps` steps when that is set. A request re-added after it was so aborted
      is rejected (finish reason error, stop id as its token), like any refused request.

    Events are held until `step()`, which runs them and the batch as one StepPlan (the
    engine applies releases, aborts, preempts, then resumes and new requests, then rows).
    Frames reach the FrameStore (keyed by the caller's request id) at `commit()`.
    """

    def __init__(self, engine: LockstepEngine, stop_token_id: int, *, max_parked: int | None = None,
                 max_park_steps: int | None = None) -> None:
        if engine.lifecycle.deferred:
            raise ValueError(f"lifecycle {engine.lifecycle.name!r} defers the MTP to the next step; MRV2 needs CB0 and "
                             "its frame in the same step (current-step MTP)")
        self.engine, self.stop_token_id = engine, stop_token_id
        self.max_parked = max(8, 2 * engine.max_slots) if max_parked is None else max_parked
        self.max_park_steps = max_park_steps
        self.frames = FrameStore(engine.spec.num_codebooks)
        self._terminal = frozenset(engine.compiled.states_in(CLASS_TERMINAL))
        self._caller: dict[str, str] = {}  # vLLM's id -> the caller's id (FrameStore key)
        self._num_frames: dict[str, int] = {}  # frames published so far, per engine request
        self._parked: OrderedDict[str, int] = OrderedDict()  # preempted id -> step it was parked at
        self._rejected: dict[str, str] = {}  # refused at add -> caller id; rows get the stop id until removed
        self._new: list[NewRequest] = []
        self._resumes: list[str] = []
        self._preempts: list[str] = []
        self._releases: list[str] = []
        self._removed_parked: list[str] = []  # removed while parked: aborted unless re-added before the step
        self._staged: list[tuple[StepOutput, tuple[str, ...]]] = []  # (stepped output, ids gone with it)
        self.steps = 0

    # -- events (MRV2's finish_requests / add_requests phases) -----------------------------

    def state(self, request_id: str) -> State | None:
        return engine_state(self.engine, request_id)

    def remove(self, request_id: str) -> None:
        """`ModelState.remove_request`: see the class docstring for what it means."""
        if request_id in self._rejected:
            del self._rejected[request_id]
            return
        if any(r.request_id == request_id for r in self._new):
            raise MRV2EventError(request_id, "new", "removed before its first step ran; MRV2 schedules every added "
                                 "request in the step that adds it")
        if request_id in self._parked:
            # Parked in an earlier step: a client abort, or the guard before its resume (add follows).
            # Parked by this very step's held preempt: only the guard can remove it again.
            if request_id not in self._preempts and request_id not in self._removed_parked:
                self._removed_parked.append(request_id)
            return
        state = self.state(request_id)
        if state is None or request_id in self._releases:
            return
        if state in self._terminal:
            self._releases.append(request_id)
        else:
            self._preempts.append(request_id)
            self._parked[request_id] = self.steps

    def add(self, request_id: str, prompt_len: int, prefill_len: int, decode: Callable[[], NewRequest],
            caller_id: str | None = None) -> None:
        """`ModelState.add_request`: a new request (decode() builds it) or the resume of a parked one.
        caller_id: the FrameStore key (the id the caller submitted; default request_id)."""
        if request_id in self._parked:
            self._resume(request_id, prompt_len, prefill_len)
            return
        state = self.state(request_id)
        if state is not None or request_id in self._rejected or any(r.request_id == request_id for r in self._new):
            raise MRV2EventError(request_id, state.label if state is not None else "new",
                                 "added while the engine still holds it (MRV2 removes an id before it re-adds it)")
        caller = caller_id or request_id
        try:
            if prefill_len != prompt_len:
                raise AdmissionError(request_id, f"arrives as a resume ({prefill_len} prefill tokens for a prompt of "
                                     f"{prompt_len}) but the engine holds no preempted request of this id (aborted "
                                     "after waiting beyond the park limits, or never run here)")
            if self.frames.is_open(caller):
                raise AdmissionError(request_id, f"caller id {caller!r} is already in flight")
            request = decode()
            problems = self.engine.check_new(request)
            if problems:
                raise AdmissionError(request_id, "; ".join(problems))
            rows = int(self.engine.prepare(request).prompt_embeds.shape[0])
            if rows != prompt_len:
                raise AdmissionError(request_id, f"vLLM holds a prompt of {prompt_len} tokens but the talker's prompt "
                                     f"is {rows} rows: submit {rows} placeholder ids")
        except AdmissionError as exc:
            self._reject(request_id, caller, exc)
            return
        self._caller[request_id], self._num_frames[request_id] = caller, 0
        self.frames.open(caller)
        self._new.append(request)

    def _resume(self, request_id: str, prompt_len: int, prefill_len: int) -> None:
        if request_id in self._preempts:
            # Its preempt has not run (the preempting step scheduled no tokens, so MRV2 never
            # sampled): run the held boundary events first, the resume needs a preempted request.
            self._run(self._take_plan((), boundary_only=True))
        if request_id in self._removed_parked:
            self._removed_parked.remove(request_id)
        expected = prompt_len + self._num_frames.get(request_id, 0)
        if prefill_len != expected:
            raise MRV2EventError(request_id, "preempted", f"resumed with {prefill_len} prefill tokens; the engine "
                                 f"replays prompt {prompt_len} + {self._num_frames.get(request_id, 0)} published "
                                 f"frames = {expected} (a streaming-input update cannot grow a talker prompt)")
        del self._parked[request_id]
        self._resumes.append(request_id)

    def _reject(self, request_id: str, caller: str, exc: Exception) -> None:
        self._rejected[request_id] = caller
        if not self.frames.is_open(caller):
            self.frames.open(caller)
            self.frames.finish(caller, FinishedRequest(caller, FinishReason.ERROR, 0, str(exc)))

    # -- the step (the custom sampler) ----------------------------------------------------------

    def _expired(self) -> list[str]:
        """Parked requests to abort at this boundary (see the class docstring)."""
        aborts = list(self._removed_parked)
        waiting = [rid for rid in self._parked if rid not in aborts and rid not in self._preempts]
        if self.max_park_steps is not None:
            old = [rid for rid in waiting if self.steps - self._parked[rid] > self.max_park_steps]
            aborts += old
            waiting = [rid for rid in waiting if rid not in old]
        return aborts + waiting[: max(0, len(waiting) - self.max_parked)]  # oldest first (insertion order)

    def _take_plan(self, rows: Sequence[Row], boundary_only: bool = False) -> StepPlan:
        aborts = self._expired()
        for rid in aborts:
            del self._parked[rid]
        plan = StepPlan(
            releases=tuple(self._releases), aborts=tuple(aborts), preempts=tuple(self._preempts),
            resumes=() if boundary_only else tuple(self._resumes),
            new_requests=() if boundary_only else tuple(self._new),
            rows=tuple(Span(r.request_id, r.num_tokens) for r in rows if r.request_id not in self._rejected),
        )
        self._releases, self._preempts, self._removed_parked = [], [], []
        if not boundary_only:
            self._resumes, self._new = [], []
        return plan

    def _run(self, plan: StepPlan) -> StepOutput:
        output = self.engine.step(plan)
        self.steps += 1
        self._staged.append((output, plan.releases + plan.aborts))
        for i, rid in enumerate(output.frames.request_ids):
            self._num_frames[rid] = int(output.frames.frame_index[i]) + 1
        return output

    def step(self, rows: Sequence[Row]) -> StepResult:
        """One engine step for MRV2's batch (rows in batch order); the token vLLM records per row."""
        plan = self._take_plan(rows)
        if not _has_work(plan):
            return StepResult(tuple(self.stop_token_id if r.samples else 0 for r in rows), ())
        output = self._run(plan)
        cb0 = {rid: int(output.frames.codes[i, 0]) for i, rid in enumerate(output.frames.request_ids)}
        stops = {f.request_id for f in output.finished if f.reason is not FinishReason.LENGTH}
        tokens = []
        for row in rows:
            rid = row.request_id
            if rid in self._rejected:
                token, engine_samples = self.stop_token_id, row.samples
            elif rid in cb0:
                token, engine_samples = cb0[rid], True
            elif rid in stops or self.state(rid) in self._terminal:
                token, engine_samples = self.stop_token_id, True  # eos, error, or an overrun row of an ended request
            else:
                token, engine_samples = 0, False  # a prefill chunk short of the prompt's end
            if engine_samples != row.samples:
                state = self.state(rid)
                raise MRV2EventError(rid, state.label if state is not None else None,
                                     f"vLLM {'samples' if row.samples else 'does not sample'} its row of "
                                     f"{row.num_tokens} tokens but the engine {'did' if engine_samples else 'did not'}"
                                     " (prompt lengths disagree)")
            tokens.append(token)
        return StepResult(tuple(tokens), tuple(o for o, _ in self._staged))

    def commit(self) -> None:
        """`postprocess_state`: hand the stepped frames and finishes to the FrameStore; forget
        released and aborted requests."""
        for output, gone in self._staged:
            self.frames.add_frames(output.frames, self._caller)
            for finished in output.finished:
                caller = self._caller.get(finished.request_id)
                if caller is not None:
                    self.frames.finish(caller, finished)
            for rid in gone:
                self._caller.pop(rid, None)
                self._num_frames.pop(rid, None)
        self._staged = []

    @property
    def num_parked(self) -> int:
        return len(self._parked)


def _has_work(plan: StepPlan) -> bool:
    return bool(plan.rows or plan.new_requests or plan.resumes or plan.preempts or plan.releases or plan.aborts)
