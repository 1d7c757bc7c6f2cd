"""LockstepEngine: one step = a fixed pipeline of transition kernels over the slot table."""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np
import torch

from ..errors import EngineInvariantError, PlanTypeError, SchedulerStallError
from ..kernels.contract import OUT_CODES, OUT_ERROR, OUT_FRAME_INDEX, OUT_VALID
from ..lifecycle.spec import LifecycleSpec
from ..model_api import PreparedPrompt, TalkerModel
from ..sampling import describe_fault
from .assembly import assemble, unbind
from .decode_graphs import DEFAULT_BUCKETS
from .draft_policy import DraftPolicy
from .generate import generate
from .ledger import HostStep
from .pipeline import ModelFault
from .outputs import FrameBatch, Generation, RowOutput, StepOutput
from .plan import NewRequest, StepPlan
from .scheduler import is_empty
from .scheduling_policy import SchedulingPolicy


class LockstepEngine:
    """Advances every request's state machine together, one fused stage at a time.

    A step has three public phases, which `step()` runs in order: `stage(plan)` validates
    and stages a StepPlan on the host (raising leaves everything as it was), `run_device`
    runs the device stages (kernels + model) with no host synchronisation, and `finish`
    turns the step's one device-to-host copy into request-attributed frames. Its parts are
    checked and wired by `assembly.assemble`.
    """

    def __init__(
        self,
        model: TalkerModel,
        max_slots: int,
        *,
        device: torch.device | str = "cpu",
        kernels: str = "auto",
        lifecycle: LifecycleSpec | None = None,
        policy: SchedulingPolicy | None = None,
        speculate: int = 0,
        draft_policy: DraftPolicy | None = None,
        decode_graphs: str = "auto",
        graph_buckets: Iterable[int] = DEFAULT_BUCKETS,
        debug: bool = False,
    ) -> None:
        """speculate=k >= 1: speculative decoding with the model's drafter (`draft`), k drafts
        verified per decode row under the `speculative` lifecycle; the frames are those of
        speculate=0 (the plain single-codebook lifecycle), only the steps are fewer.
        draft_policy: how many of the k drafts a step proposes (DraftPolicy(): as many as pay,
        from measured acceptance; DraftPolicy(adaptive=False): always k). A decode row's width
        is 1 + the previous step's count: `decode_width` (a caller's own plans must use it).

        decode_graphs: decode-only steps through engine-owned padded buffers per batch bucket
        (`graph_buckets`), "cuda": captured and replayed as CUDA graphs (needs the Triton
        kernels), "eager": the same buffers run eagerly, "off": never, "auto": "cuda" where it
        can run, else off. The frames are the same in every mode.

        debug=True: after every step, the host request table is checked against the device
        slot table and every row's state move against the lifecycle's `transitions` machine
        (EngineInvariantError naming the request at the first disagreement; debug_checks.py).
        It reads the whole slot table back each step: for tests and bug hunts, not serving."""
        assemble(self, model, max_slots, device=device, kernels=kernels, lifecycle=lifecycle, policy=policy,
                 speculate=speculate, draft_policy=draft_policy, decode_graphs=decode_graphs,
                 graph_buckets=graph_buckets, debug=debug)

    @property
    def decode_width(self) -> int:
        """Tokens a decode row must have in the next step: 1, or 1 + the drafts it verifies."""
        return self.ledger.decode_width

    # -- public API ---------------------------------------------------------------------

    def close(self) -> None:
        """Unbind the model so another engine may use it (this engine must not step again)."""
        unbind(self.model, self)

    @property
    def max_slots(self) -> int:
        return self.table.max_slots

    @property
    def num_free_slots(self) -> int:
        return self.ledger.allocator.num_free

    def prepare(self, request: NewRequest) -> PreparedPrompt:
        """Let the model prepare a request's prompt ahead of admission (the result is kept
        and reused when this same request object is admitted). Model failures become an
        AdmissionError naming the request."""
        return self.ledger.admission.prepare(request)

    def check_new(self, request: NewRequest) -> list[str]:
        """Problems with a new request's own fields (empty when it is admissible)."""
        return self.ledger.admission.check_new(request)

    def request_state(self, request_id: str):
        """The request's lifecycle state as of the last step (host mirror)."""
        return self.ledger.record(request_id, "report its state").state

    def requests(self) -> dict[str, str]:
        """State label of every request the engine holds (queued requests are `free`)."""
        return {rid: r.state.label for rid, r in self.ledger.all_records()}

    # -- high-level API: the built-in policy plans every step ---------------------------

    def add_request(self, request: NewRequest) -> None:
        """Validate a request now (AdmissionError naming it if it can never run) and queue it."""
        self.ledger.enqueue(request)

    def abort(self, request_id: str) -> str:
        """'dropped' (was queued: gone now), 'scheduled' (aborted by the next step, reported
        in its output) or 'ignored' (already ended, already aborting, or unknown)."""
        return self.scheduler.abort(request_id)

    def preempt(self, request_id: str) -> bool:
        """Preempt a running request in the next step; it resumes when a slot is free."""
        return self.scheduler.preempt(request_id)

    def feed(self, request_id: str, rows: torch.Tensor | None = None, *, done: bool = False) -> None:
        """Append conditioning rows [n, feed_width] to a request's feed (a model with
        spec.feed_capacity > 0, e.g. Qwen3-Omni's thinker rows); done=True: no more will
        come (the model then supplies its end-of-feed rows). A request starved for a row
        is schedulable again from the next step. FeedError (nothing changed) on bad input."""
        self.feeds.feed(request_id, rows, done)

    @property
    def waiting_for_feed(self) -> int:
        """Requests that cannot run until engine.feed brings a conditioning row (starved, or
        preempted and not yet resumable)."""
        return self.feeds.num_starved()

    @property
    def idle(self) -> bool:
        """No request queued, running, preempted, awaiting release or pending an abort."""
        return self.scheduler.idle

    def generate(
        self, requests: Iterable[NewRequest], *, on_step: Callable[["LockstepEngine", StepOutput], None] | None = None
    ) -> dict[str, Generation]:
        """Run requests to their end with the built-in policy; frames and finish per request.
        on_step(engine, output) may abort or preempt between steps.

        All or nothing: every request is validated before any is queued (AdmissionError or
        DuplicateRequestError naming the first bad one, nothing queued). Every request gets
        exactly one end: one aborted while still queued ends with reason abort, 0 frames."""
        return generate(self, requests, on_step)

    def step(self, plan: StepPlan | None = None) -> StepOutput | None:
        """Run one lockstep step: `plan`, or the built-in policy's (None when idle).

        A bad plan raises before anything changes; a model that raises mid-step ends that
        step's scheduled requests with reason error and leaves every other request as it was.
        """
        if plan is not None and not isinstance(plan, StepPlan):
            raise PlanTypeError(f"step() takes a StepPlan or None, got {type(plan).__name__}")
        if plan is None:
            if self.scheduler.idle:
                return None
            plan = self.scheduler.schedule()
            if is_empty(plan) and self.waiting_for_feed:
                return None  # nothing can run until engine.feed brings a missing conditioning row
            if is_empty(plan):
                raise SchedulerStallError(
                    f"nothing can be scheduled: {len(self.ledger.queued)} queued, {len(self.ledger.records)} held, "
                    f"{self.scheduler.num_preempted} preempted, {self.num_free_slots} free slots"
                )
        host = self.stage(plan)
        try:
            packed = self.run_device(host)
        except ModelFault as fault:  # the step's requests end with reason error (host_events)
            output = self.ledger.events.fail_step(host, self.step_count, fault.__cause__ or fault, self.kernels,
                                                  self._lc)
            self.step_count += 1
        else:
            output = self.finish(host, packed)
        self.scheduler.update(plan, output)
        return output

    # -- the three phases of a step -----------------------------------------------------

    def stage(self, plan: StepPlan) -> HostStep:
        """Validate the plan all-or-nothing, commit it on the host and stage device inputs."""
        host = self.ledger.stage(plan)
        if self._debug is not None:
            self._debug.staged(host)
        return host

    def run_device(self, host: HostStep) -> torch.Tensor:
        """Every device stage of a staged step, in order; returns the packed output (+ a
        trailing table-wide error row) on the device. Model exceptions raise ModelFault."""
        with torch.inference_mode():
            self._apply_events(host)
            self._admit(host)
            if self.graphs is not None and self.graphs.eligible(host):
                return self.graphs.run(host.batch)
            return self._run_rows(host)

    def finish(self, host: HostStep, packed: torch.Tensor) -> StepOutput:
        """The step's single device-to-host copy, then frames and finish records from it."""
        # Non-blocking on CUDA; a copy either way, so published data never aliases an engine buffer.
        packed = packed.to("cpu", non_blocking=True, copy=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.step_count += 1
        output = self._build_output(host, packed.numpy())
        if self._drafts is not None:  # this step's proposals are the next one's verify rows
            self._drafts.advance()
            self._drafts.apply(self._pipeline.speculative, self.ledger)
        if self._debug is not None:  # before the feed's host triggers, which are not device stages
            self._debug.finished(host)
        if self.feeds.enabled:  # decoding requests whose next conditioning row is missing rest in starved
            self.feeds.refresh()
        return output

    # -- device pipeline ----------------------------------------------------------------

    def _apply_events(self, host: HostStep) -> None:
        """Stage 1a: releases, aborts and preemptions, through the transition table."""
        if host.events is not None:
            self.kernels.apply_host_events(self.table, self._lc, host.events)

    def _admit(self, host: HostStep) -> None:
        """Stage 1b: admissions (every column re-initialised, the model's slot state cleared)
        and the frames resumed requests replay into their prompt rows."""
        k, table, lc = self.kernels, self.table, self._lc
        if host.admits is not None:
            self._reset_slots(host.admits.slots)
            k.apply_admits(table, lc, host.admits)
            if host.replay is not None:
                k.replay_frames(table, host.replay, self._frame_embed, self._text_step)

    def _run_rows(self, host: HostStep) -> torch.Tensor:
        """Stages 2-5 over the step's rows; returns the packed output (+ a global error row)."""
        return self._pipeline.run(host.batch)

    # -- host side ----------------------------------------------------------------------

    def _explain_errors(self, slots: list[int]) -> list[str]:
        """Why each of these slots' requests ended in error this step: its fault word (the
        stage's sampler wrote which codebook and what was wrong), as a sentence."""
        words = self.table.fault[torch.tensor(slots, dtype=torch.int64, device=self.device)].tolist()
        return [describe_fault(w) for w in words]

    def _build_output(self, host: HostStep, packed_np: np.ndarray) -> StepOutput:
        per_row = self._pipeline.positions
        # The trailing row holds the sticky error bits of every slot (the rows' slots included).
        if packed_np[-1, OUT_ERROR]:
            bad = np.flatnonzero(self.table.error[: self.table.max_slots].cpu().numpy())
            owners = {r.slot: rid for rid, r in self.ledger.all_records() if r.slot is not None}
            raise EngineInvariantError(
                "sticky error bits set on slots "
                + ", ".join(f"{s} (owner {owners.get(s)!r}, bits {int(self.table.error[s])})" for s in bad)
            )
        # A speculative step packs k + 1 rows per step row (its verify positions, row-major);
        # the first carries the row's state after the step, every one the frame it published.
        frames_np = packed_np[:-1]
        rows_np = frames_np if per_row == 1 else frames_np[::per_row]
        ended = self.ledger.observe(host, rows_np, self._explain_errors)
        is_frame = frames_np[:, OUT_VALID] == 1
        valid = is_frame.nonzero()[0]
        if self.speculation is not None and host.verify_np is not None:
            accepted = self.speculation.record(host.verify_np, is_frame.reshape(-1, per_row))
            if self._drafts is not None:
                self._drafts.observe(per_row - 1, accepted)
        # Selected in numpy (a torch index op costs more than the rows it moves): `packed` is
        # this step's own copy, the row view shares it, and fancy indexing copies again, so
        # FrameBatch and RowOutput never alias each other or an engine buffer.
        if len(valid) == len(host.row_ids) and per_row == 1:  # the common step: every row published
            ids = host.row_ids
        else:
            ids = tuple(host.row_ids_np[valid if per_row == 1 else valid // per_row]) if len(valid) else ()
        published = torch.from_numpy(frames_np[valid, OUT_CODES:])
        payload = self.spec.payload
        frames = FrameBatch(
            request_ids=ids,
            frame_index=torch.from_numpy(frames_np[valid, OUT_FRAME_INDEX]),
            codes=published,
            payload=None if payload is None else payload.decode(published[:, self.spec.num_codebooks:]),
        )
        row_output = RowOutput(
            request_ids=host.row_ids,
            query_start_loc=host.query_start_loc.clone(),
            valid=torch.from_numpy(is_frame if per_row == 1 else rows_np[:, OUT_VALID] == 1),
            codes=torch.from_numpy(rows_np[:, OUT_CODES:]),
        )
        return StepOutput(self.step_count - 1, frames, tuple(ended), row_output, host.batch.num_tokens, host.preempted)
