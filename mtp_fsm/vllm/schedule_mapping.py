"""One vLLM V1 `SchedulerOutput` -> the LockstepEngine step(s) it means, and the CB0 tokens vLLM expects back."""

from __future__ import annotations

import time
from typing import Any, Callable

import attrs

from ..engine import LockstepEngine
from ..engine.plan import FinishedRequest, NewRequest, Span, StepOutput, StepPlan
from ..errors import AdmissionError, UnknownRequestError
from ..lifecycle import CLASS_TERMINAL, FinishReason, State
from ..serving.metrics import ServingMetrics, StepMetrics
from .frame_store import FrameStore
from .request_codec import EXTRA_ARGS_KEY, decode_request, with_vllm_rules
from .speculation import DraftBook


@attrs.frozen
class MappedStep:
    """The engine's answer to one scheduler output, in vLLM's terms."""

    sampled: dict[str, list[int]]  # per scheduled request: [] (no token), [cb0] or [stop id]; speculative: the
    # CB0 of every frame the verify row published, then the stop id if the engine ended it
    output: StepOutput | None  # the engine step run (None: nothing to do)


class ScheduleMapper:
    """Maps vLLM's decisions onto the engine, which executes them (vLLM schedules, mtp_fsm executes).

    - new requests -> NewRequest decoded from `sampling_params.extra_args["mtp_fsm"]`
      (max_frames = `max_tokens`); one whose prompt length differs from the engine's, or
      that the engine refuses, is rejected alone: its row gets the stop id and its finish is
      recorded with reason error.
    - `preempted_req_ids` -> preempts; `resumed_req_ids` (V1) or a new request for a
      preempted id (MRV2's shape) -> resumes. vLLM re-prefills prompt + output tokens, which
      is the engine's resume prompt (prompt + published frames).
    - `finished_req_ids` mixes finishes and aborts: an id the engine has ended is released; a
      running or preempted one is aborted (its slot is free for this step's admissions).
    - rows: `num_scheduled_tokens`, one Span each.
    The CB0 of a published frame is the sampled token; an EOS finish (or an error) returns
    the stop id so vLLM's stop check ends the request; every other row returns nothing.
    A speculative engine (vllm/speculation.py) returns every frame its verify row published,
    the stop id after them also when it ended the request at the context's end (vLLM's
    max_model_len is past it), and keeps the drafts for `take_draft_token_ids`.
    """

    def __init__(self, engine: LockstepEngine, stop_token_id: int, inputs_type: type,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.engine, self.stop_token_id, self.inputs_type, self.clock = engine, stop_token_id, inputs_type, clock
        self.frames = FrameStore(engine.spec.num_codebooks)
        self.metrics = ServingMetrics()
        self._terminal = frozenset(engine.compiled.states_in(CLASS_TERMINAL))
        self._caller: dict[str, str] = {}  # vLLM's internal id -> the caller's id
        self._rejected: set[str] = set()  # refused at admission: vLLM still schedules them once
        self._max_frames: dict[str, int] = {}  # speculative: a LENGTH end short of max_frames is the context's
        self.drafts = DraftBook(engine) if engine.speculate else None

    # -- the step ------------------------------------------------------------------------

    def step(self, sched: Any) -> MappedStep:
        releases, aborts = self._finished_ids(sched.finished_req_ids)
        new, resumes, rows, sampled = self._admissions(sched)
        preempts = [rid for rid in sorted(sched.preempted_req_ids or ()) if self._holds_live(rid)]
        plan = StepPlan(new_requests=tuple(new), rows=tuple(rows), aborts=tuple(aborts), preempts=tuple(preempts),
                        resumes=tuple(resumes), releases=tuple(releases))
        output = None
        if plan.new_requests or plan.rows or plan.aborts or plan.preempts or plan.resumes or plan.releases:
            output = self._run(plan)
            sampled.update(self._sampled(output))
            if self.drafts is not None:
                self.drafts.after_step(output.rows.request_ids)
        for rid in (*plan.releases, *plan.aborts):
            self._caller.pop(rid, None)
            self._max_frames.pop(rid, None)
        return MappedStep(sampled, output)

    def _finished_ids(self, finished: set[str]) -> tuple[list[str], list[str]]:
        releases, aborts = [], []
        for rid in sorted(finished):
            if rid in self._rejected:
                self._rejected.discard(rid)
                continue
            state = self._state(rid)
            if state is None:
                continue  # never admitted (vLLM ended it before its first step)
            # Ended by the engine: release. Running or preempted (vLLM's abort, max_model_len
            # cap, ...): abort, which frees the slot at this boundary, before admissions.
            (releases if state in self._terminal else aborts).append(rid)
        return releases, aborts

    def _admissions(self, sched: Any):
        new, resumes, rows, sampled = [], [], [], {}
        resumed = set(getattr(sched.scheduled_cached_reqs, "resumed_req_ids", ()) or ())
        for data in sched.scheduled_new_reqs:
            rid = data.req_id
            if self._state(rid) is State.PREEMPTED:
                resumed.add(rid)  # MRV2 resends a resumed request as a new one
                continue
            request = self._accept(data)
            if request is None:
                sampled[rid] = [self.stop_token_id]
            else:
                new.append(request)
        resumes.extend(sorted(rid for rid in resumed if self._state(rid) is State.PREEMPTED))
        for rid, num_tokens in sched.num_scheduled_tokens.items():
            if rid in self._rejected:
                sampled.setdefault(rid, [])
            else:
                rows.append(Span(rid, int(num_tokens)))
        return new, resumes, rows, sampled

    def _accept(self, data: Any) -> NewRequest | None:
        rid, params = data.req_id, data.sampling_params
        extra = (params.extra_args or {}) if params is not None else {}
        try:
            request = decode_request(rid, extra.get(EXTRA_ARGS_KEY), max_frames=int(params.max_tokens),
                                     inputs_type=self.inputs_type)
            request = with_vllm_rules(request, params)
            caller = extra[EXTRA_ARGS_KEY]["request_id"]
            if self.frames.is_open(caller):
                raise AdmissionError(rid, f"caller id {caller!r} is already in flight")
            problems = self.engine.check_new(request)
            if problems:
                raise AdmissionError(rid, "; ".join(problems))
            prompt_len = int(self.engine.prepare(request).prompt_embeds.shape[0])
            if prompt_len != len(data.prompt_token_ids):
                raise AdmissionError(rid, f"vLLM holds a prompt of {len(data.prompt_token_ids)} tokens but the talker's "
                                     f"prompt is {prompt_len} rows: submit {prompt_len} placeholder ids "
                                     "(mtp_fsm.vllm.TalkerLLM does)")
        except AdmissionError as exc:
            self._reject(rid, extra, exc)
            return None
        except Exception as exc:  # a malformed payload or a model's own input check: this request alone
            self._reject(rid, extra, AdmissionError(rid, f"{type(exc).__name__}: {exc}"))
            return None
        self._caller[rid] = caller
        self._max_frames[rid] = request.max_frames
        self.frames.open(caller)
        self.metrics.on_submit(caller, self.clock())
        return request

    def _reject(self, rid: str, extra: dict, exc: Exception) -> None:
        payload = extra.get(EXTRA_ARGS_KEY)
        caller = payload.get("request_id", rid) if isinstance(payload, dict) else rid
        self._rejected.add(rid)
        if not self.frames.is_open(caller):
            self.frames.open(caller)
            self.frames.finish(caller, FinishedRequest(caller, FinishReason.ERROR, 0, str(exc)))
        self.metrics.on_submit(caller, self.clock())
        self.metrics.on_finished(caller, FinishReason.ERROR, self.clock(), str(exc))

    # -- results -------------------------------------------------------------------------

    def _run(self, plan: StepPlan) -> StepOutput:
        start = self.clock()
        output = self.engine.step(plan)
        now = self.clock()
        self.frames.add_frames(output.frames, self._caller)
        for rid in output.frames.request_ids:
            self.metrics.on_frame(self._caller[rid], now)
        for finished in output.finished:
            caller = self._caller[finished.request_id]
            self.frames.finish(caller, finished)
            self.metrics.on_finished(caller, finished.reason, now, finished.detail or None)
        self.metrics.on_step(StepMetrics(step=output.step, wall_s=now - start, num_tokens=output.num_tokens,
                                         num_frames=len(output.frames), preempts=output.num_preempted,
                                         states=self._state_counts()), start, now)
        return output

    def _sampled(self, output: StepOutput) -> dict[str, list[int]]:
        sampled: dict[str, list[int]] = {rid: [] for rid in output.rows.request_ids if rid is not None}
        codes = output.frames.codes
        for row, rid in enumerate(output.frames.request_ids):
            sampled[rid].append(int(codes[row, 0]))  # one frame a step, or a verify row's several
        speculative = self.drafts is not None
        for finished in output.finished:
            rid = finished.request_id
            if rid not in sampled:
                continue
            stop = finished.reason in (FinishReason.EOS, FinishReason.ERROR) or (
                speculative and finished.reason is FinishReason.LENGTH
                and finished.num_frames < self._max_frames.get(rid, finished.num_frames))
            if stop:  # speculative: after the frames published before the end; else instead of the token
                sampled[rid] = [*sampled[rid], self.stop_token_id] if speculative else [self.stop_token_id]
        return sampled

    def _state(self, rid: str) -> State | None:
        return engine_state(self.engine, rid)

    def _holds_live(self, rid: str) -> bool:
        state = self._state(rid)
        return state is not None and state not in self._terminal and state is not State.PREEMPTED

    def _state_counts(self) -> dict[str, int]:
        counts = {"finished": self.metrics.num_finished}
        for state_label in self.engine.requests().values():
            counts[state_label] = counts.get(state_label, 0) + 1
        return counts


def engine_state(engine: LockstepEngine, request_id: str) -> State | None:
    """The request's state, or None when the engine does not hold it (both vLLM routes ask
    this of ids vLLM names, which the engine may never have admitted or already released)."""
    try:
        return engine.request_state(request_id)
    except UnknownRequestError:
        return None
